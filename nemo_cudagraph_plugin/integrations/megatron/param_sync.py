"""FP8 transposes aligned right after the optimizer step, by *finishing* the parameter all-gather first.

:func:`make_param_sync_hook` builds a hook to call after ``optimizer.step()`` in a Megatron-core loop::

       from nemo_cudagraph_plugin.integrations.megatron import make_param_sync_hook

       align = make_param_sync_hook(model, sync_group=True)   # model: this rank's list of chunks
       for it in range(train_iters):
           losses = forward_backward_func(forward_step_func=..., model=model, ...)
           update_successful, grad_norm, _ = optimizer.step()
           align()                                             # refresh every chunk before the next schedule

As ``config.param_sync_func`` (interleaved schedule only: Megatron-core calls that function only from
``forward_backward_pipelining_with_interleaving``): ``install_param_sync_hook(config, model)``; the work
happens on the call for chunk 0.

With the distributed optimizer and ``overlap_param_gather=True`` the hook finishes the all-gather first
(``start_param_sync(force_sync=True)``), which gives up its overlap with the first forward. Prefer
:func:`~nemo_cudagraph_plugin.integrations.megatron.install_param_gather_refresh` there.

CUDA graphs: the refresh is capturable; forced syncs and barriers are not captured.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ...fp8.pipeline import ModelChunks, TransposeAligner

__all__ = ["ParamSyncHook", "default_pp_group", "install_param_sync_hook", "make_param_sync_hook"]


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

    Attributes: ``aligner`` (the :class:`~nemo_cudagraph_plugin.fp8.pipeline.TransposeAligner`),
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
    :class:`ParamSyncHook`. ``hook.uninstall()`` puts the previous function back and removes the refresh.

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
        hook.aligner.remove()

    hook.uninstall = uninstall  # type: ignore[attr-defined]
    config.param_sync_func = hook
    return hook
