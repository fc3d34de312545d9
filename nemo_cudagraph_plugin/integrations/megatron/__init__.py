"""megatron-core integration: its own CUDA graphs configured consistently, FP8 transposes on its parameter
all-gather path, and its whole-iteration graph made to engage. Megatron is imported lazily (only when a function
that needs it is called), and Lightning only by :mod:`.callbacks`.

One concern per module:

* :mod:`.capabilities`: what the installed megatron-core does itself (version gates plus cheap probes; the safe
  choice, said once, when unsure) and the refusals that follow (per-layer graphs, fused wgrad accumulation).
* :mod:`.graph_fields`: the CUDA-graph fields of a model config, planned and applied
  (:func:`apply_megatron_graph_fields`; the NeMo recipe flag uses the same code path).
* :mod:`.param_gather`: FP8 transposes refreshed when a parameter all-gather completes, only where megatron-core
  does not rebuild them (:func:`install_param_gather_refresh`).
* :mod:`.param_sync`: FP8 transposes aligned after the optimizer step by finishing the all-gather first
  (:func:`make_param_sync_hook`, :func:`install_param_sync_hook`).
* :mod:`.full_iteration`: megatron-core's ``FullCudaGraphWrapper`` around the forward-backward, checked so that
  it engages (:func:`full_iteration_forward_backward`), and :func:`count_megatron_graphs`.
* :mod:`.callbacks`: the Lightning callbacks (``AlignPipelineTransposes``, ``Fp8ParamGatherRefresh``,
  ``MegatronFullIterationGraph``), imported on first access.

CUDA graphs: refreshes are capturable; parameter all-gathers, forced syncs and barriers are not captured by
these helpers (inside a whole-iteration graph megatron-core's own all-gather and rebuild are captured with the
step).
"""

from __future__ import annotations

from typing import Any

from .capabilities import (
    MegatronCapabilities,
    fused_wgrad_graph_safety,
    megatron_capabilities,
    per_layer_parity_note,
    per_layer_refusal,
)
from .full_iteration import count_megatron_graphs, full_iteration_forward_backward
from .graph_fields import (
    MEGATRON_IMPLS,
    Change,
    MegatronGraphSetup,
    apply_megatron_graph_fields,
    plan_megatron_graph_fields,
)
from .param_gather import ParamGatherRefresh, find_megatron_ddp, install_param_gather_refresh
from .param_sync import ParamSyncHook, default_pp_group, install_param_sync_hook, make_param_sync_hook

_CALLBACKS = ("AlignPipelineTransposes", "Fp8ParamGatherRefresh", "MegatronFullIterationGraph")


def __getattr__(name: str) -> Any:
    # The Lightning callbacks, imported on first use: Megatron-core loops need no Lightning.
    if name in _CALLBACKS:
        from . import callbacks

        return getattr(callbacks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MEGATRON_IMPLS",
    "Change",
    "MegatronCapabilities",
    "MegatronGraphSetup",
    "ParamGatherRefresh",
    "ParamSyncHook",
    "apply_megatron_graph_fields",
    "count_megatron_graphs",
    "default_pp_group",
    "find_megatron_ddp",
    "full_iteration_forward_backward",
    "fused_wgrad_graph_safety",
    "install_param_gather_refresh",
    "install_param_sync_hook",
    "make_param_sync_hook",
    "megatron_capabilities",
    "per_layer_parity_note",
    "per_layer_refusal",
    "plan_megatron_graph_fields",
    *_CALLBACKS,
]
