"""Whole-iteration CUDA graph: megatron-core's ``FullCudaGraphWrapper``, checked so that it engages, and counting
the graphs megatron-core has captured."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from torch import nn

from ...fp8.pipeline import ModelChunks
from .graph_fields import scope_names
from .param_gather import find_megatron_ddp
from .param_sync import _as_chunk_list

__all__ = ["count_megatron_graphs", "full_iteration_forward_backward"]


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
            ``nemo_cudagraph_plugin.integrations.megatron.apply_megatron_graph_fields(config, scope=["full_iteration"])``).
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
    names = scope_names(getattr(config, "cuda_graph_scope", None))
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
