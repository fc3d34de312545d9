"""Plain function hooks for Megatron-core training loops (Megatron itself is imported lazily).

Three groups:

* **What the installed megatron-core already does** (:func:`megatron_capabilities`): whether it rebuilds FP8
  weight transposes itself after its parameter all-gather (``post_all_gather_processing``), whether its
  per-layer graph replay restores TransformerEngine's ``grad_added_to_main_grad`` side effect, whether it has
  ``FullCudaGraphWrapper``. Found by reading the code objects of the functions (no version table), with the
  file and line of each fact.
* **FP8 transposes on the all-gather completion path** (:func:`install_param_gather_refresh`): refresh a
  bucket's ``Float8Tensor`` transposes when its parameter all-gather *completes*, only on the paths where
  megatron-core does not rebuild them itself. No forced sync, so an overlapped all-gather stays overlapped.
* **Whole-iteration CUDA graph** (:func:`full_iteration_forward_backward`): megatron-core's
  ``FullCudaGraphWrapper`` around ``get_forward_backward_func()``, checked so that it really engages.

And, from before, a hook that aligns FP8 transposes right after the optimizer step by *forcing* the parameter
all-gather (:func:`make_param_sync_hook`, :func:`install_param_sync_hook`)::

       from nemo_cudagraph_plugin.megatron import make_param_sync_hook

       align = make_param_sync_hook(model, sync_group=True)   # model: this rank's list of chunks
       for it in range(train_iters):
           losses = forward_backward_func(forward_step_func=..., model=model, ...)
           update_successful, grad_norm, _ = optimizer.step()
           align()                                             # refresh every chunk before the next schedule

   As ``config.param_sync_func`` (interleaved schedule only: Megatron-core calls that function only from
   ``forward_backward_pipelining_with_interleaving``): ``install_param_sync_hook(config, model)``; the work
   happens on the call for chunk 0.

With the distributed optimizer and ``overlap_param_gather=True`` that hook finishes the all-gather first
(``start_param_sync(force_sync=True)``), which gives up its overlap with the first forward. Prefer
:func:`install_param_gather_refresh` there: megatron-core >= 0.16 with a TransformerEngine that has
``post_all_gather_processing`` rebuilds the transposes itself when each bucket's all-gather completes, and the
completion hook fills only the gaps.

CUDA graphs: refreshes are capturable; parameter all-gathers, forced syncs and barriers are not captured by
these helpers (inside a whole-iteration graph megatron-core's own all-gather and rebuild are captured with the
step).
"""

from __future__ import annotations

import dis
import importlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from nemo_cudagraph_plugin.pipeline import ModelChunks, TransposeAligner

__all__ = [
    "MegatronCapabilities",
    "ParamGatherRefresh",
    "ParamSyncHook",
    "count_megatron_graphs",
    "default_pp_group",
    "find_megatron_ddp",
    "full_iteration_forward_backward",
    "fused_wgrad_graph_safety",
    "install_param_gather_refresh",
    "install_param_sync_hook",
    "make_param_sync_hook",
    "megatron_capabilities",
]


def default_pp_group() -> Optional[Any]:
    """Megatron-core's pipeline-parallel group when its ``parallel_state`` is initialised, else
    ``None`` (= the default world group)."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    try:
        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_pipeline_model_parallel_group()
    except Exception:  # an older/newer parallel_state without these functions: fall back to world
        return None
    return None


def _overlaps_param_gather(chunk: Any) -> bool:
    cfg = getattr(chunk, "ddp_config", None)
    return bool(getattr(cfg, "overlap_param_gather", False)) and callable(
        getattr(chunk, "start_param_sync", None)
    )


def _as_chunk_list(model_chunks: ModelChunks) -> list[Any]:
    if isinstance(model_chunks, (nn.Module, Tensor)) and not isinstance(model_chunks, nn.ModuleList):
        return [model_chunks]
    try:
        chunks = list(model_chunks)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"model_chunks must be this rank's model chunk(s) (a module or a list of modules), got "
            f"{type(model_chunks).__name__}."
        ) from None
    if not chunks:
        raise ValueError("model_chunks is empty: pass this rank's list of model chunks (Megatron's `model`).")
    return chunks


class ParamSyncHook:
    """Finish the parameter sync of every chunk, then refresh every FP8 transpose, once per step.

    Callable as ``hook()`` (after ``optimizer.step()``) or as Megatron-core's
    ``config.param_sync_func`` (``hook(chunk_params)``; does the work on chunk 0's call).
    Returns the number of FP8 parameters refreshed by that call (0 for the no-op calls).

    Attributes: ``aligner`` (the :class:`~nemo_cudagraph_plugin.pipeline.TransposeAligner`),
    ``alignments`` (how many times the work ran), ``param_syncs_forced``.
    """

    def __init__(
        self,
        model_chunks: ModelChunks,
        *,
        pp_group: Optional[Any] = None,
        sync_group: bool = False,
        finish_param_sync: bool = True,
    ) -> None:
        self.chunks = _as_chunk_list(model_chunks)
        overlapping = [i for i, c in enumerate(self.chunks) if _overlaps_param_gather(c)]
        if overlapping and not finish_param_sync:
            raise ValueError(
                f"model chunk(s) {overlapping} overlap their parameter all-gather with the forward "
                "(ddp_config.overlap_param_gather=True): their new FP8 bytes arrive only when the all-gather "
                "finishes, so refreshing transposes before that would read stale weights. Keep "
                "finish_param_sync=True (the hook then finishes the all-gather first) or turn "
                "overlap_param_gather off."
            )
        self.finish_param_sync = bool(finish_param_sync)
        self._overlapping = overlapping
        if sync_group and pp_group is None:
            pp_group = default_pp_group()
        self.aligner = TransposeAligner(self.chunks, pp_group=pp_group, sync_group=sync_group)
        # First parameter of each chunk -> chunk index, to tell which chunk param_sync_func is called for.
        self._chunk_of: dict[int, int] = {}
        for i, c in enumerate(self.chunks):
            params = list(c.parameters()) if isinstance(c, nn.Module) else list(c)
            if params:
                self._chunk_of.setdefault(id(params[0]), i)
        self.alignments = 0
        self.param_syncs_forced = 0

    def _which_chunk(self, params: Iterable[Tensor]) -> int:
        first = next(iter(params), None)
        if first is None:
            return -1
        idx = self._chunk_of.get(id(first))
        if idx is None:
            raise ValueError(
                "param_sync_func was called with parameters of a module that is not one of the model chunks this "
                "hook was built with; build it with the same `model` list the schedule is given."
            )
        return idx

    def align(self) -> int:
        """Finish pending parameter all-gathers (overlapping chunks), then refresh every chunk."""
        if self.finish_param_sync and self._overlapping:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"model chunk(s) {self._overlapping} overlap their parameter all-gather "
                    "(ddp_config.overlap_param_gather=True); finishing it before the refresh waits on the host "
                    "and cannot be captured into a CUDA graph. Call the hook after the graph replay, or turn "
                    "overlap_param_gather off for graphed steps."
                )
            for i in self._overlapping:
                # Waits for an in-flight all-gather, or runs it synchronously: the FP8 bytes are final after.
                self.chunks[i].start_param_sync(force_sync=True)
                self.param_syncs_forced += 1
        n = self.aligner()
        self.alignments += 1
        return n

    def __call__(self, params: Optional[Iterable[Tensor]] = None, *unused: Any, **unused_kw: Any) -> int:
        if params is None:
            return self.align()
        if self._which_chunk(params) == 0:
            return self.align()
        return 0  # chunks >= 1 of this step were synced and refreshed with chunk 0


def make_param_sync_hook(
    model_chunks: ModelChunks,
    *,
    pp_group: Optional[Any] = None,
    sync_group: bool = False,
    finish_param_sync: bool = True,
) -> ParamSyncHook:
    """Build the hook; see the module docstring for the two ways to use it.

    Args:
        model_chunks: this rank's model chunks (Megatron's ``model`` list, all virtual stages).
        pp_group: group for the optional barrier; default Megatron's pipeline group when
            ``parallel_state`` is initialised, else the world.
        sync_group: barrier over ``pp_group`` once after the refresh (host-blocking, never captured).
        finish_param_sync: finish an overlapped parameter all-gather before refreshing (required
            when a chunk has ``ddp_config.overlap_param_gather=True``).
    """
    return ParamSyncHook(
        model_chunks, pp_group=pp_group, sync_group=sync_group, finish_param_sync=finish_param_sync
    )


def install_param_sync_hook(config: Any, model_chunks: Sequence[Any], **kwargs: Any) -> ParamSyncHook:
    """Set ``config.param_sync_func`` (a Megatron ``ModelParallelConfig``/``TransformerConfig``) to a
    :class:`ParamSyncHook`. ``hook.uninstall()`` puts the previous function back.

    Megatron-core calls ``param_sync_func`` only in the interleaved schedule, so this needs two or
    more chunks; with one chunk call ``make_param_sync_hook(...)()`` after ``optimizer.step()``.
    """
    if not hasattr(config, "param_sync_func"):
        raise TypeError(
            f"{type(config).__name__} has no `param_sync_func`; pass Megatron-core's model config "
            "(get_model_config(model[0]))."
        )
    chunks = _as_chunk_list(model_chunks)
    if len(chunks) < 2:
        raise ValueError(
            "Megatron-core calls config.param_sync_func only in the interleaved (virtual pipeline) schedule, "
            "which needs >= 2 model chunks; with one chunk call the hook after optimizer.step() instead: "
            "align = make_param_sync_hook(model); ...; optimizer.step(); align()."
        )
    hook = ParamSyncHook(chunks, **kwargs)
    previous = config.param_sync_func

    def uninstall() -> None:
        config.param_sync_func = previous

    hook.uninstall = uninstall  # type: ignore[attr-defined]
    config.param_sync_func = hook
    return hook


# --------------------------------------------------------------------------------------------
# What the installed megatron-core does itself (read from its code objects)
# --------------------------------------------------------------------------------------------


def _code_line(code: Any, name: str) -> Optional[int]:
    """First source line of ``code`` (or a function nested in it) that loads ``name``."""
    for ins in dis.get_instructions(code):
        if ins.argval == name and ins.opname.startswith(("LOAD_", "STORE_ATTR", "IMPORT_NAME")):
            pos = getattr(ins, "positions", None)
            if pos is not None and pos.lineno is not None:
                return pos.lineno
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            line = _code_line(const, name)
            if line is not None:
                return line
    return None


def _names(code: Any) -> set[str]:
    """Every global/attribute name ``code`` and the functions nested in it use."""
    out = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            out |= _names(const)
    return out


def _uses(fn: Any, name: str, where: dict[str, str], key: str) -> bool:
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    if name not in _names(code):
        return False
    line = _code_line(code, name) or code.co_firstlineno
    where[key] = f"{_short_path(code.co_filename)}:{line}"
    return True


def _short_path(path: str) -> str:
    marker = "megatron/core/"
    i = path.replace("\\", "/").rfind(marker)
    return path[i:] if i >= 0 else path


@dataclass(frozen=True)
class MegatronCapabilities:
    """What the installed megatron-core does itself, relevant to CUDA graphs and FP8 primary weights.

    Attributes:
        version: ``megatron.core.__version__`` (informational; nothing below is decided from it).
        te_post_all_gather_processing: megatron-core found TransformerEngine's ``post_all_gather_processing``.
            Then its FP8 cast asks TE *not* to invalidate the transposes (``manual_post_all_gather_processing``),
            so a transpose is current only if megatron-core rebuilds it after the all-gather: where it does
            not, even eager TE reads a stale one (nothing is flagged).
        rebuild_after_overlapped_gather: ``finish_param_sync`` (overlapped all-gather, forward pre-hook) calls
            ``post_all_gather_processing`` when the all-gather it waited for completes.
        rebuild_after_sync_gather: ``DistributedDataParallel.start_param_sync`` calls it after a synchronous
            all-gather (``overlap_param_gather=False``).
        rebuild_after_forced_gather: a *forced* sync of a chunk that overlaps its all-gather
            (``start_param_sync(force_sync=True)``: NeMo's checkpoint save, ``disable_forward_pre_hook``) is
            followed by a rebuild. ``False`` in megatron-core 0.16.1: the bucket group waits or gathers and
            returns without it, and the next forward's pre-hook finds nothing pending.
        replay_sets_grad_added_to_main_grad: the per-layer graph replay (``cuda_graph_impl="local"``) sets
            ``param.grad_added_to_main_grad`` as TransformerEngine's fused wgrad accumulation does eagerly, so
            Megatron DDP's gradient hook does not add TE's placeholder wgrad into ``main_grad`` a second time.
        ddp_hooks_skip_megatron_capture: DDP's hooks return early while megatron-core's per-layer capture runs.
        full_cuda_graph_wrapper: ``megatron.core.full_cuda_graph.FullCudaGraphWrapper`` exists.
        per_layer_input_buffer_reuse: the per-layer forward capture (``_CudaGraphRunner.create_fwd_graph``)
            returns its input buffers to megatron-core's tensor reuse pool right after the forward capture,
            although TransformerEngine's layers save their input for the backward (the norm input of
            ``LayerNormLinear``); a later backward capture can take the same buffer for its output gradient
            and overwrite it on every replay (megatron-core 0.16.1: ``cuda_graphs.py:995``; see
            :func:`per_layer_refusal`).
        where: fact -> ``megatron/core/<file>:<line>`` of the code that shows it.
    """

    version: str
    te_post_all_gather_processing: bool
    rebuild_after_overlapped_gather: bool
    rebuild_after_sync_gather: bool
    rebuild_after_forced_gather: bool
    replay_sets_grad_added_to_main_grad: bool
    ddp_hooks_skip_megatron_capture: bool
    full_cuda_graph_wrapper: bool
    per_layer_input_buffer_reuse: bool = False
    where: dict[str, str] = field(default_factory=dict)

    def megatron_rebuilds(self, path: str) -> bool:
        """Whether megatron-core leaves the FP8 transposes current after an all-gather on ``path``
        (``"overlapped"``, ``"sync"`` or ``"forced"``)."""
        attr = {"overlapped": self.rebuild_after_overlapped_gather, "sync": self.rebuild_after_sync_gather,
                "forced": self.rebuild_after_forced_gather}
        if path not in attr:
            raise ValueError(f"path={path!r}: use 'overlapped', 'sync' or 'forced'.")
        return self.te_post_all_gather_processing and attr[path]


def megatron_capabilities() -> Optional[MegatronCapabilities]:
    """Read :class:`MegatronCapabilities` from the installed megatron-core; ``None`` when it is missing."""
    try:
        core = importlib.import_module("megatron.core")
        pgb = importlib.import_module("megatron.core.distributed.param_and_grad_buffer")
        ddp = importlib.import_module("megatron.core.distributed.distributed_data_parallel")
        fp8_utils = importlib.import_module("megatron.core.fp8_utils")
    except ImportError:
        return None
    where: dict[str, str] = {}
    group = getattr(pgb, "_ParamAndGradBucketGroup", None)
    ddp_cls = getattr(ddp, "DistributedDataParallel", None)
    finish = _uses(getattr(group, "finish_param_sync", None), "post_all_gather_processing", where,
                   "rebuild_after_overlapped_gather")
    sync = _uses(getattr(ddp_cls, "start_param_sync", None), "post_all_gather_processing", where,
                 "rebuild_after_sync_gather")
    forced = _uses(getattr(group, "start_param_sync", None), "post_all_gather_processing", where,
                   "rebuild_after_forced_gather")
    if not forced:
        fn = getattr(group, "start_param_sync", None)
        code = getattr(fn, "__code__", None)
        if code is not None:
            where["rebuild_after_forced_gather"] = (
                f"{_short_path(code.co_filename)}:{_code_line(code, 'param_gather_handle') or code.co_firstlineno} "
                "(force_sync returns without post_all_gather_processing)"
            )
    te_hook = getattr(fp8_utils, "te_post_all_gather_processing", None) is not None
    _uses(getattr(fp8_utils, "_quantize_param_shard_impl", None), "te_post_all_gather_processing", where,
          "te_post_all_gather_processing")
    replay_sets = False
    skip = False
    reuse = False
    try:
        cg = importlib.import_module("megatron.core.transformer.cuda_graphs")
        node = getattr(cg, "_CudagraphReplayNode", None)
        replay_sets = _uses(getattr(node, "backward", None), "groundtruth_grad_added_to_main_grad", where,
                            "replay_sets_grad_added_to_main_grad")
        hook_maker = getattr(ddp_cls, "_make_backward_post_hook", None)
        skip = _uses(hook_maker, "is_graph_capturing", where, "ddp_hooks_skip_megatron_capture")
        fwd = getattr(getattr(cg, "_CudaGraphRunner", None), "create_fwd_graph", None)
        fwd_code = getattr(fwd, "__code__", None)
        if fwd_code is not None and {"tensor_reuse_pool", "insert"} <= _names(fwd_code):
            reuse = True
            where["per_layer_input_buffer_reuse"] = (
                f"{_short_path(fwd_code.co_filename)}:{_code_line(fwd_code, 'insert') or fwd_code.co_firstlineno}"
            )
    except ImportError:
        pass
    try:
        importlib.import_module("megatron.core.full_cuda_graph").FullCudaGraphWrapper  # noqa: B018
        full = True
    except (ImportError, AttributeError):
        full = False
    return MegatronCapabilities(
        version=str(getattr(core, "__version__", "?")),
        te_post_all_gather_processing=te_hook,
        rebuild_after_overlapped_gather=finish,
        rebuild_after_sync_gather=sync,
        rebuild_after_forced_gather=forced,
        replay_sets_grad_added_to_main_grad=replay_sets,
        ddp_hooks_skip_megatron_capture=skip,
        full_cuda_graph_wrapper=full,
        per_layer_input_buffer_reuse=reuse,
        where=where,
    )


# Measured on an H200 (megatron-core 0.16.1, TransformerEngine 2.20.2; docs/gpu-evidence/2026-12-03-megatron-per-layer.md,
# 2026-12-03-megatron-layerdiag.md).
_PER_LAYER_MEASURED = (
    "layer 0's input-norm weight gradient is wrong from the first replayed step and the loss curves drift apart by "
    "up to 0.027 over 120 steps, where eager against eager is bitwise; scope=['full_iteration'] was bitwise equal "
    "to eager on the same models"
)


def per_layer_parity_note(capabilities: Optional[MegatronCapabilities]) -> Optional[str]:
    """The warning for megatron-core's per-layer graphs (``cuda_graph_impl="local"``) when the installed megatron-core
    could not be read (``capabilities is None``); ``None`` otherwise (:func:`per_layer_refusal` decides then).
    """
    if capabilities is not None:
        return None
    return (
        "megatron-core could not be read; its per-layer CUDA graphs (megatron-core 0.16.1) were measured not to "
        "reproduce eager training bit for bit: " + _PER_LAYER_MEASURED
    )


def per_layer_refusal(capabilities: Optional[MegatronCapabilities]) -> Optional[str]:
    """Why megatron-core's per-layer graphs (``cuda_graph_impl="local"``) must not be turned on with ``capabilities``
    installed; ``None`` when nothing is known against them.

    megatron-core 0.16.1's forward capture returns a layer's input buffer to its tensor reuse pool although
    TransformerEngine saved that input for the layer's backward
    (:attr:`MegatronCapabilities.per_layer_input_buffer_reuse`); a later backward graph takes the buffer for its
    output gradient and overwrites it on every replay, so layer 0's backward reads a wrong input. Measured on an
    H200 (megatron-core 0.16.1, docs/gpu-evidence/2026-12-03-megatron-layerdiag.md): per-layer graphs differ from
    eager from the first replayed step, in exactly two gradients (layer 0's input-norm weight, 98 % off, and the
    embedding's); with those buffers kept out of the pool (what megatron-core 0.18 does) they are bitwise equal to
    eager over 120 steps.
    """
    if capabilities is None or not capabilities.per_layer_input_buffer_reuse:
        return None
    at = capabilities.where.get("per_layer_input_buffer_reuse", "megatron/core/transformer/cuda_graphs.py")
    return (
        f"megatron-core {capabilities.version}'s per-layer CUDA graphs do not reproduce eager training: "
        + _PER_LAYER_MEASURED
        + f". Its forward capture returns each layer's input buffer to the reuse pool ({at}) although "
        "TransformerEngine keeps that input for the layer's backward, and a later backward graph overwrites it on "
        "every replay (megatron-core 0.18 keeps those buffers)"
    )


def fused_wgrad_graph_safety(
    *, impl: str, full_iteration: bool, capabilities: Optional[MegatronCapabilities]
) -> tuple[bool, str]:
    """Is TransformerEngine's fused wgrad accumulation (``gradient_accumulation_fusion=True``) safe under the
    given Megatron CUDA graphs? Returns ``(safe, reason)``.

    The mechanism (Megatron-LM issue #1279, NaN gradients with CUDA graphs): with fused accumulation TE adds the
    weight gradient into ``param.main_grad`` itself, sets the Python attribute ``param.grad_added_to_main_grad``
    and returns a placeholder wgrad (``torch.empty``, uninitialised). Megatron DDP's gradient hook adds
    ``param.grad`` into ``main_grad`` unless that attribute is set. A graph replay runs TE's kernels but not its
    Python, so unless something sets the attribute again the hook adds the placeholder: double counting, or NaN.

    * per-layer graphs (``impl="local"``): safe when megatron-core's replay sets the attribute itself
      (:attr:`MegatronCapabilities.replay_sets_grad_added_to_main_grad`);
    * ``impl="transformer_engine"``: megatron-core keeps the attribute across ``zero_grad_buffer`` for that impl;
      safe with the same megatron-core (the attribute is never cleared, so the hook never adds);
    * whole iteration (``FullCudaGraphWrapper``): the DDP hook itself is captured (it runs once, at capture,
      with TE's attribute set) and replays never consult the attribute: safe;
    * unknown megatron-core (not importable): not known to be safe.
    """
    if full_iteration:
        return True, (
            "whole-iteration graph: Megatron DDP's gradient hook runs once, during capture, right after TE set "
            "grad_added_to_main_grad; replays run only the captured kernels and never read the attribute"
        )
    if capabilities is None:
        return False, (
            "megatron-core could not be imported, so it is unknown whether its graph replay restores TE's "
            "grad_added_to_main_grad side effect (Megatron-LM #1279)"
        )
    if capabilities.replay_sets_grad_added_to_main_grad:
        at = capabilities.where.get("replay_sets_grad_added_to_main_grad", "megatron/core/transformer/cuda_graphs.py")
        return True, f"megatron-core {capabilities.version} restores grad_added_to_main_grad after each replay ({at})"
    return False, (
        f"megatron-core {capabilities.version}'s per-layer graph replay does not restore TE's "
        "grad_added_to_main_grad (_CudagraphReplayNode.backward), so Megatron DDP's hook would add TE's "
        "uninitialised placeholder wgrad into main_grad after every replay (Megatron-LM #1279: NaN gradients)"
    )


# --------------------------------------------------------------------------------------------
# FP8 transposes on the parameter all-gather completion path
# --------------------------------------------------------------------------------------------


def find_megatron_ddp(chunk: Any) -> Optional[Any]:
    """The Megatron-core ``DistributedDataParallel`` in ``chunk`` (the chunk itself, or its ``.module`` up to
    three levels down, as in NeMo's ``MegatronParallel``); ``None`` if there is none."""
    obj = chunk
    for _ in range(4):
        if obj is None:
            return None
        if hasattr(obj, "bucket_groups") and hasattr(obj, "ddp_config") and callable(
            getattr(obj, "start_param_sync", None)
        ):
            return obj
        obj = getattr(obj, "module", None)
    return None


def _bucket_params(group: Any) -> list[Tensor]:
    out: list[Tensor] = []
    seen: set[int] = set()
    for bucket in getattr(group, "buckets", ()):
        params = getattr(bucket, "params_list", None) or list(getattr(bucket, "params", ()))
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class ParamGatherRefresh:
    """Refresh FP8 transposes when a Megatron parameter all-gather completes, where megatron-core does not.

    Built by :func:`install_param_gather_refresh`. Per Megatron DDP chunk it wraps (instance attributes, undone
    by :meth:`remove`):

    * each bucket group's ``finish_param_sync`` (the forward pre-hook's wait on an overlapped all-gather):
      refreshes that group's FP8 parameters after the wait, **only** when megatron-core does not rebuild there
      itself (``MegatronCapabilities.megatron_rebuilds("overlapped")`` false: older megatron-core, or a
      TransformerEngine without ``post_all_gather_processing``);
    * the chunk's ``start_param_sync``: after a *forced* sync of an overlapping chunk (NeMo's
      ``save_checkpoint`` -> ``force_param_sync()``, ``disable_forward_pre_hook()``, ...) it refreshes the
      chunk's FP8 parameters, which megatron-core 0.16.1 does not; after a synchronous all-gather
      (``overlap_param_gather=False``) only when megatron-core does not.

    Nothing is forced: an overlapped all-gather stays overlapped, and the refresh runs where the bytes land.
    Inside a whole-iteration graph the finish-path refresh is captured with the step (it replays every step);
    the forced path runs eagerly between steps.

    Attributes: ``refreshed`` (Counter path -> parameters refreshed by host-side calls), ``calls`` (Counter
    path -> calls that refreshed), ``paths`` (the paths hooked), ``plans`` (how many bucket groups hold FP8
    parameters).
    """

    def __init__(
        self,
        model_chunks: ModelChunks,
        *,
        capabilities: Optional[MegatronCapabilities] = None,
        fused: Any = "auto",
    ) -> None:
        from nemo_cudagraph_plugin.fp8 import Fp8RefreshPlan

        chunks = _as_chunk_list(model_chunks)
        ddps = [find_megatron_ddp(c) for c in chunks]
        missing = [i for i, d in enumerate(ddps) if d is None]
        if missing:
            raise TypeError(
                f"model chunk(s) {missing} are not Megatron-core DistributedDataParallel modules (no bucket_groups / "
                "start_param_sync): the all-gather completion path exists only there. Pass Megatron's list of "
                "DDP-wrapped chunks (NeMo: trainer.strategy.model)."
            )
        caps = capabilities if capabilities is not None else megatron_capabilities()
        self.capabilities = caps
        rebuilds = (lambda path: caps.megatron_rebuilds(path)) if caps is not None else (lambda path: False)
        self.paths: set[str] = set()
        if not rebuilds("overlapped"):
            self.paths.add("overlapped")
        if not rebuilds("sync"):
            self.paths.add("sync")
        if not rebuilds("forced"):
            self.paths.add("forced")
        self.refreshed: Counter = Counter()
        self.calls: Counter = Counter()
        self.plans = 0
        self._undo: list[tuple[Any, str]] = []
        for ddp in ddps:
            self._install(ddp, Fp8RefreshPlan, fused)

    def _install(self, ddp: Any, plan_cls: Any, fused: Any) -> None:
        groups = list(getattr(ddp, "bucket_groups", ())) + list(getattr(ddp, "expert_parallel_bucket_groups", ()))
        chunk_plan = plan_cls([p for g in groups for p in _bucket_params(g)], fused=fused)
        if len(chunk_plan) == 0:
            return  # no FP8 parameter in this chunk: nothing can go stale
        cfg = ddp.ddp_config
        overlap = bool(getattr(cfg, "overlap_param_gather", False))
        if overlap and "overlapped" in self.paths:
            for group in groups:
                plan = plan_cls(_bucket_params(group), fused=fused)
                if len(plan):
                    self.plans += 1
                    self._wrap(group, "finish_param_sync", self._finish_wrapper(group, plan))
        if (overlap and "forced" in self.paths) or (not overlap and "sync" in self.paths):
            self._wrap(ddp, "start_param_sync", self._start_wrapper(ddp, chunk_plan, overlap))

    def _wrap(self, obj: Any, name: str, wrapper: Callable[..., Any]) -> None:
        wrapper.__nemo_cudagraph_wrapped__ = getattr(obj, name)  # type: ignore[attr-defined]
        setattr(obj, name, wrapper)
        self._undo.append((obj, name))

    def _refresh(self, plan: Any, path: str) -> int:
        n = plan.refresh()
        if n:
            self.refreshed[path] += n
            self.calls[path] += 1
        return n

    def _finish_wrapper(self, group: Any, plan: Any) -> Callable[..., Any]:
        original = group.finish_param_sync

        def finish_param_sync(*args: Any, **kwargs: Any) -> Any:
            # Completes an all-gather if one is in flight, or dispatches-and-waits if none was dispatched yet.
            completing = getattr(group, "param_gather_handle", None) is not None or not getattr(
                group, "param_gather_dispatched", True
            )
            out = original(*args, **kwargs)
            if completing:
                self._refresh(plan, "overlapped")
            return out

        return finish_param_sync

    def _start_wrapper(self, ddp: Any, plan: Any, overlap: bool) -> Callable[..., Any]:
        original = ddp.start_param_sync

        def start_param_sync(*args: Any, force_sync: bool = False, **kwargs: Any) -> Any:
            out = original(*args, force_sync=force_sync, **kwargs)
            if overlap and force_sync:
                self._refresh(plan, "forced")  # megatron-core waited or gathered, and rebuilt nothing
            elif not overlap and not getattr(ddp, "overlap_param_gather_with_optimizer_step", False):
                self._refresh(plan, "sync")
            return out

        return start_param_sync

    def remove(self) -> None:
        """Undo every wrapper (idempotent)."""
        for obj, name in reversed(self._undo):
            if name in obj.__dict__:
                delattr(obj, name)
        self._undo = []

    @property
    def active(self) -> bool:
        return bool(self._undo)

    def summary(self) -> str:
        if self.capabilities is None:
            basis = "megatron-core not importable: every completion path is hooked"
        else:
            basis = (f"megatron-core {self.capabilities.version} rebuilds after overlapped/sync/forced all-gathers: "
                     f"{self.capabilities.megatron_rebuilds('overlapped')}/{self.capabilities.megatron_rebuilds('sync')}"
                     f"/{self.capabilities.megatron_rebuilds('forced')}")
        return f"ParamGatherRefresh: hooked {sorted(self.paths)} ({basis}); refreshed {dict(self.refreshed)}"


def install_param_gather_refresh(
    model_chunks: ModelChunks,
    *,
    capabilities: Optional[MegatronCapabilities] = None,
    fused: Any = "auto",
) -> ParamGatherRefresh:
    """Refresh FP8 transposes on megatron-core's all-gather completion path, only where it does not itself.

    Use it instead of forcing the all-gather after the optimizer step (:func:`make_param_sync_hook`): with
    ``overlap_param_gather=True`` the all-gather keeps overlapping the first forward. See
    :class:`ParamGatherRefresh` for the paths. Returns the handle; ``.remove()`` uninstalls. Chunks without
    FP8 parameters get no wrapper.

    Raises:
        TypeError: a chunk is not a Megatron-core ``DistributedDataParallel`` (or a wrapper of one).
    """
    return ParamGatherRefresh(model_chunks, capabilities=capabilities, fused=fused)


# --------------------------------------------------------------------------------------------
# Whole-iteration CUDA graph (megatron-core's FullCudaGraphWrapper), and counting graphs
# --------------------------------------------------------------------------------------------


def _scope_names(scope: Any) -> list[str]:
    if scope is None:
        return []
    items = scope if isinstance(scope, (list, tuple)) else [scope]
    out = []
    for s in items:
        for part in (s.split(",") if isinstance(s, str) else [s]):
            name = str(getattr(part, "name", part)).strip()
            if name:
                out.append(name)
    return [] if out == ["full"] else out


def full_iteration_forward_backward(
    forward_backward_func: Optional[Callable[..., Any]] = None,
    *,
    config: Any,
    model_chunks: Optional[ModelChunks] = None,
    warmup_steps: Optional[int] = None,
) -> Any:
    """megatron-core's ``FullCudaGraphWrapper`` around the forward-backward of every microbatch, made to engage.

    Captured (after ``warmup_steps`` eager steps): the whole ``forward_backward_func`` call — every
    microbatch's forward and backward, the DDP gradient hooks and reduce-scatters, ``finalize_model_grads``,
    and with ``overlap_param_gather`` the parameter all-gathers and megatron-core's FP8 transpose rebuild.
    Not captured: the data loading (copied into static buffers each step), ``zero_grad_buffer`` and the
    optimizer step (run them eagerly around the call, as Megatron-LM does). Call the result exactly like
    ``get_forward_backward_func()``'s function, with keyword arguments.

    The checks here are the reasons a wrapper would capture nothing or fail later:
    ``config.cuda_graph_impl`` must be ``"local"`` and ``cuda_graph_scope`` exactly ``["full_iteration"]``
    (else megatron-core builds per-layer graph managers too, and its schedules create per-layer graphs inside
    the whole-iteration capture); Megatron DDP's ``check_for_nan_in_grad`` / ``check_for_large_grads`` read
    the gradient norm on the host inside the step and cannot be captured.

    Args:
        forward_backward_func: default ``megatron.core.pipeline_parallel.get_forward_backward_func()``.
        config: the model's ``TransformerConfig`` (set its fields with
            ``nemo_cudagraph_plugin.nemo.apply_megatron_graph_fields(config, scope=["full_iteration"])``).
        model_chunks: the DDP chunks, to check their NaN-check settings (recommended).
        warmup_steps: eager steps before the capture; default ``config.cuda_graph_warmup_steps``.

    Raises:
        ValueError: one of the settings above; the message says what to change.
        ImportError: this megatron-core has no ``FullCudaGraphWrapper`` (added in 0.14).
    """
    try:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    except ImportError as exc:
        raise ImportError(
            "megatron.core.full_cuda_graph.FullCudaGraphWrapper is missing (megatron-core >= 0.14 has it); "
            "upgrade megatron-core or use the per-layer graphs (cuda_graph_impl='local')."
        ) from exc
    impl = getattr(config, "cuda_graph_impl", None)
    names = _scope_names(getattr(config, "cuda_graph_scope", None))
    if impl is not None and impl != "local":
        raise ValueError(
            f"config.cuda_graph_impl={impl!r}: the whole-iteration graph needs cuda_graph_impl='local' and "
            "cuda_graph_scope=['full_iteration'] (apply_megatron_graph_fields(config, scope=['full_iteration']))."
        )
    if names != ["full_iteration"]:
        raise ValueError(
            f"config.cuda_graph_scope={names}: set it to ['full_iteration'] (alone). With another scope "
            "megatron-core builds per-layer CUDA graph managers and creates their graphs inside the "
            "whole-iteration capture (schedules.py calls create_cudagraphs() unless full_iteration is in scope)."
        )
    for i, chunk in enumerate(_as_chunk_list(model_chunks) if model_chunks is not None else []):
        ddp = find_megatron_ddp(chunk)
        cfg = getattr(ddp, "ddp_config", None)
        on = [n for n in ("check_for_nan_in_grad", "check_for_large_grads") if getattr(cfg, n, False)]
        if on:
            raise ValueError(
                f"model chunk {i}: DistributedDataParallelConfig {on}=True reads the gradient norm on the host in "
                "the gradient-reduce hook, which runs inside the whole-iteration graph and cannot be captured. "
                "Set them to False (check the loss outside the graph instead)."
            )
    if warmup_steps is None:
        warmup_steps = int(getattr(config, "cuda_graph_warmup_steps", 1) or 1)
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps={warmup_steps}: use >= 1 (the first step must run eagerly).")
    if forward_backward_func is None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_backward_func = get_forward_backward_func()
    return FullCudaGraphWrapper(forward_backward_func, cuda_graph_warmup_steps=warmup_steps)


def count_megatron_graphs(model_chunks: Optional[ModelChunks] = None) -> dict[str, int]:
    """CUDA graphs megatron-core has actually captured: per-layer forward/backward graphs of the chunks'
    graph managers (``cuda_graph_impl="local"``) and the whole-iteration training graph."""
    fwd = bwd = runners = 0
    seen: set[int] = set()
    for chunk in _as_chunk_list(model_chunks) if model_chunks is not None else []:
        mods = chunk.modules() if isinstance(chunk, nn.Module) else []
        for m in mods:
            for attr in ("cudagraph_manager", "cudagraph_manager_router", "cudagraph_manager_postprocess"):
                mgr = getattr(m, attr, None)
                if mgr is None or id(mgr) in seen:
                    continue
                seen.add(id(mgr))
                for r in getattr(mgr, "cudagraph_runners", ()):
                    runners += 1
                    fwd += getattr(r, "fwd_graph", None) is not None
                    bwd += getattr(r, "bwd_graph", None) is not None
    full = 0
    try:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper

        full = int(FullCudaGraphWrapper.cuda_graph.get("training") is not None)
    except (ImportError, AttributeError):
        pass
    return {"layer_runners": runners, "layer_fwd_graphs": fwd, "layer_bwd_graphs": bwd, "full_iteration_graphs": full}
