"""What the installed megatron-core does itself, relevant to CUDA graphs and FP8 primary weights.

Decided from megatron-core's version (the tested minor series) plus cheap probes of public attributes; a version
that is unknown, unreadable or does not have the expected shape gets the safe graph choice for every fact, and
one warning says so (:func:`megatron_capabilities`). Megatron is imported only when a function here is called.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

from packaging.version import InvalidVersion, Version

from ...core.warn import warn_once

__all__ = [
    "MegatronCapabilities",
    "fused_wgrad_graph_safety",
    "megatron_capabilities",
    "per_layer_parity_note",
    "per_layer_refusal",
]


@dataclass(frozen=True)


class MegatronCapabilities:
    """What the installed megatron-core does itself, relevant to CUDA graphs and FP8 primary weights.

    Attributes:
        version: the installed megatron-core's version (``"?"`` when it cannot be read).
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
        where: fact -> ``megatron/core/<file>:<line>`` of the code that shows it (tested versions only).
        tested: the facts come from a tested megatron-core series; ``False``: the safe choice for each (see
            :func:`megatron_capabilities`).
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
    tested: bool = True

    def megatron_rebuilds(self, path: str) -> bool:
        """Whether megatron-core leaves the FP8 transposes current after an all-gather on ``path``
        (``"overlapped"``, ``"sync"`` or ``"forced"``)."""
        attr = {"overlapped": self.rebuild_after_overlapped_gather, "sync": self.rebuild_after_sync_gather,
                "forced": self.rebuild_after_forced_gather}
        if path not in attr:
            raise ValueError(f"path={path!r}: use 'overlapped', 'sync' or 'forced'.")
        return self.te_post_all_gather_processing and attr[path]


#: The megatron-core minor series whose behaviour below was read from its source and run in the test bed, with the
#: source line that shows each fact. A version outside them gets the safe choice for every fact (:data:`_SAFE`).
_TESTED: dict[tuple[int, int], dict[str, Any]] = {
    (0, 16): {
        "rebuild_after_overlapped_gather": True,
        "rebuild_after_sync_gather": True,
        "rebuild_after_forced_gather": False,
        "replay_sets_grad_added_to_main_grad": True,
        "ddp_hooks_skip_megatron_capture": True,
        "per_layer_input_buffer_reuse": True,
        "where": {
            "rebuild_after_overlapped_gather": "megatron/core/distributed/param_and_grad_buffer.py:362",
            "rebuild_after_sync_gather": "megatron/core/distributed/distributed_data_parallel.py:511",
            "rebuild_after_forced_gather": "megatron/core/distributed/param_and_grad_buffer.py:264 "
                                           "(force_sync returns without post_all_gather_processing)",
            "replay_sets_grad_added_to_main_grad": "megatron/core/transformer/cuda_graphs.py:657",
            "per_layer_input_buffer_reuse": "megatron/core/transformer/cuda_graphs.py:995",
        },
    },
}

#: Unknown megatron-core: the choice that cannot corrupt training. Refresh FP8 transposes on every all-gather
#: path ourselves, turn TE's fused wgrad accumulation off under per-layer graphs, and prefer the whole-iteration
#: graph to per-layer graphs (``per_layer_input_buffer_reuse`` is then ``full_cuda_graph_wrapper``).
_SAFE: dict[str, Any] = {
    "rebuild_after_overlapped_gather": False,
    "rebuild_after_sync_gather": False,
    "rebuild_after_forced_gather": False,
    "replay_sets_grad_added_to_main_grad": False,
    "ddp_hooks_skip_megatron_capture": False,
}


def _version_of(core: Any) -> Optional[Version]:
    """The imported megatron-core's version: its ``package_info``, else its ``__version__``, else the installed
    distribution's metadata; ``None`` when none of them parses."""
    candidates = []
    try:
        candidates.append(importlib.import_module("megatron.core.package_info").__version__)
    except (ImportError, AttributeError):
        pass
    candidates.append(getattr(core, "__version__", None))
    try:
        candidates.append(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        pass
    for text in candidates:
        try:
            return Version(str(text))
        except (InvalidVersion, TypeError):
            continue
    return None


def _hooks_have_their_shape(ddp_module: Any, pgb_module: Any) -> bool:
    """The methods :class:`~nemo_cudagraph_plugin.integrations.megatron.ParamGatherRefresh` wraps exist with the
    parameters it passes (a cheap check that a tested version's facts still describe this code)."""
    ddp_cls = getattr(ddp_module, "DistributedDataParallel", None)
    group = getattr(pgb_module, "_ParamAndGradBucketGroup", None)
    try:
        start = inspect.signature(ddp_cls.start_param_sync).parameters
        group_start = inspect.signature(group.start_param_sync).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return "force_sync" in start and "force_sync" in group_start and callable(getattr(group, "finish_param_sync", None))


def megatron_capabilities() -> Optional[MegatronCapabilities]:
    """:class:`MegatronCapabilities` of the installed megatron-core; ``None`` when it is missing.

    Decided by the version (the tested minor series in :data:`_TESTED`) and by cheap probes of public attributes
    (``fp8_utils.te_post_all_gather_processing``, ``full_cuda_graph.FullCudaGraphWrapper``, the signatures of the
    methods the all-gather refresh wraps). A version outside the tested series, one that cannot be read, or code
    whose shape does not match gets the safe choice for every fact (:data:`_SAFE`), with one warning.
    """
    try:
        core = importlib.import_module("megatron.core")
        pgb = importlib.import_module("megatron.core.distributed.param_and_grad_buffer")
        ddp = importlib.import_module("megatron.core.distributed.distributed_data_parallel")
        fp8_utils = importlib.import_module("megatron.core.fp8_utils")
    except ImportError:
        return None
    te_hook = getattr(fp8_utils, "te_post_all_gather_processing", None) is not None
    try:
        importlib.import_module("megatron.core.full_cuda_graph").FullCudaGraphWrapper  # noqa: B018
        full = True
    except (ImportError, AttributeError):
        full = False
    version = _version_of(core)
    known = _TESTED.get((version.major, version.minor)) if version is not None else None
    tested = known is not None and _hooks_have_their_shape(ddp, pgb)
    if tested:
        facts = {**known, "where": dict(known["where"])}
    else:
        facts = {**_SAFE, "per_layer_input_buffer_reuse": full, "where": {}}
        why = ("its version could not be read" if version is None else
               f"it is outside the tested series ({', '.join(f'{a}.{b}.x' for a, b in _TESTED)})" if known is None
               else "its DistributedDataParallel / bucket-group methods do not have the tested parameters")
        warn_once(
            "megatron-core-capabilities",
            f"nemo_cudagraph_plugin: megatron-core {version or '?'} is not one whose CUDA-graph behaviour was checked "
            f"({why}); assuming the safe choice: FP8 transposes refreshed after every parameter all-gather, "
            "TransformerEngine's fused wgrad accumulation off under per-layer graphs"
            + (", and the whole-iteration graph instead of per-layer graphs" if full else "")
            + ". Please report the version if training looks different with graphs.",
        )
    return MegatronCapabilities(
        version=str(version) if version is not None else "?",
        te_post_all_gather_processing=te_hook,
        full_cuda_graph_wrapper=full,
        tested=tested,
        **facts,
    )


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
    H200 (megatron-core 0.16.1): per-layer graphs differ from eager from the first replayed step, in exactly two gradients (layer 0's input-norm weight, 98 % off, and the
    embedding's); with those buffers kept out of the pool (what megatron-core 0.18 does) they are bitwise equal to
    eager over 120 steps. An untested megatron-core (:attr:`MegatronCapabilities.tested` false) is refused too
    when it has the whole-iteration graph to use instead.
    """
    if capabilities is None or not capabilities.per_layer_input_buffer_reuse:
        return None
    if not capabilities.tested:
        return (
            f"megatron-core {capabilities.version} is not a version whose per-layer CUDA graphs were checked, and on "
            "megatron-core 0.16 they do not reproduce eager training (" + _PER_LAYER_MEASURED + "), so the "
            "whole-iteration graph is the safe choice"
        )
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
    if not capabilities.tested:
        return False, (
            f"megatron-core {capabilities.version} is not a tested version, so it is unknown whether its graph replay "
            "restores TE's grad_added_to_main_grad side effect (Megatron-LM #1279)"
        )
    return False, (
        f"megatron-core {capabilities.version}'s per-layer graph replay does not restore TE's "
        "grad_added_to_main_grad (_CudagraphReplayNode.backward), so Megatron DDP's hook would add TE's "
        "uninitialised placeholder wgrad into main_grad after every replay (Megatron-LM #1279: NaN gradients)"
    )
