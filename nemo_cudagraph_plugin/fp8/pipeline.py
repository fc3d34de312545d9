"""Align FP8 weight transposes across pipeline-parallel stages.

Why: TransformerEngine computes the transpose of an FP8 weight lazily, the first time a
microbatch needs it after the weight changed (every optimizer step invalidates it). In a
pipeline the stage that pays for it does so inside its *first* microbatch; that microbatch runs
slower than the others and every stage behind it idles, and with interleaved (virtual) pipelines
each virtual stage adds its own delay. :func:`align_fp8_transposes` instead refreshes the
transposes of every FP8 parameter of every model chunk on this rank in one pass right after the
optimizer step (or after the distributed optimizer's parameter all-gather), so no transpose is
computed inside any microbatch; optionally the pipeline group is synchronised once afterwards so
all stages start the schedule together.

Framework-free: torch and :mod:`nemo_cudagraph_plugin.fp8` only. The imbalance itself is measured with
:class:`nemo_cudagraph_plugin.diagnostics.MicrobatchTimer`. Adapters:
:mod:`nemo_cudagraph_plugin.integrations.megatron` (Megatron-core loops, and the Lightning callback
``AlignPipelineTransposes``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .refresh import Fp8RefreshHandle, Fused, install_fp8_refresh

__all__ = [
    "ModelChunks",
    "TransposeAligner",
    "align_fp8_transposes",
    "chunk_parameters",
    "sync_pipeline_group",
]

ModelChunks = Union[nn.Module, Tensor, Sequence[Union[nn.Module, Iterable[Tensor]]]]


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def chunk_parameters(model_chunks: ModelChunks) -> list[Tensor]:
    """All parameters of all model chunks, each tensor once, in chunk order.

    ``model_chunks`` is one module, or a list of modules (Megatron's list of virtual-stage
    chunks, NeMo's ``MegatronParallel``, an ``nn.ModuleList``), or a list of iterables of tensors.
    Tensors shared between chunks (tied embeddings) appear once, so they are refreshed once.
    """
    if model_chunks is None:
        raise ValueError(
            "model_chunks is None: pass the model chunks of this pipeline rank (one module, or the list of "
            "virtual-stage chunks, e.g. Megatron's `model` list)."
        )
    if isinstance(model_chunks, (nn.Module, Tensor)):
        chunks: list[Any] = [model_chunks]
    else:
        try:
            chunks = list(model_chunks)
        except TypeError:
            raise TypeError(
                f"model_chunks must be an nn.Module or a list of modules / iterables of tensors, got "
                f"{type(model_chunks).__name__}."
            ) from None
    if not chunks:
        raise ValueError("model_chunks is empty: pass at least one model chunk of this pipeline rank.")
    seen: set[int] = set()
    params: list[Tensor] = []
    for i, chunk in enumerate(chunks):
        if isinstance(chunk, nn.Module):
            tensors: Iterable[Any] = chunk.parameters()
        elif isinstance(chunk, Tensor):
            tensors = (chunk,)
        else:
            try:
                tensors = iter(chunk)
            except TypeError:
                raise TypeError(
                    f"model_chunks[{i}] is a {type(chunk).__name__}; each chunk must be an nn.Module or an "
                    "iterable of tensors."
                ) from None
        for t in tensors:
            if not isinstance(t, Tensor):
                raise TypeError(f"model_chunks[{i}] yielded a {type(t).__name__}, not a tensor.")
            if id(t) not in seen:
                seen.add(id(t))
                params.append(t)
    return params


def sync_pipeline_group(pp_group: Optional[Any] = None) -> bool:
    """Barrier over ``pp_group`` (default: the whole world). Returns ``False`` (nothing done)
    when ``torch.distributed`` is not initialised, i.e. a single-process run has nothing to wait for.

    Not capturable: a barrier blocks the host. Under CUDA graphs call it outside the graph (the
    Lightning callback does so at the end of each training batch whose step ran).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if _is_capturing():
        raise RuntimeError(
            "sync_pipeline_group() was called while a CUDA graph is being captured; a barrier blocks the "
            "host and cannot be part of a graph. Call it after the graph replay (outside the captured step), "
            "or use align_fp8_transposes(..., sync_group=False) inside the step."
        )
    if dist.get_backend(pp_group) == "nccl" and torch.cuda.is_available():
        # Naming the device avoids NCCL guessing it from the rank (and the warning it prints).
        dist.barrier(group=pp_group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=pp_group)
    return True


def _refuse_sync_in_capture() -> None:
    if _is_capturing():
        raise RuntimeError(
            "align_fp8_transposes(sync_group=True) cannot run inside a CUDA graph capture: the group "
            "barrier blocks the host. Refresh inside the graph with sync_group=False and call "
            "sync_pipeline_group() after the replay (the Lightning callback AlignPipelineTransposes "
            "does this for you)."
        )


class TransposeAligner:
    """:func:`align_fp8_transposes` with the chunk parameter list collected once.

    Call it (no arguments) after each optimizer step / parameter sync. The refresh is set up once by
    :func:`~nemo_cudagraph_plugin.fp8.install_fp8_refresh`, the aligner's call being its event, so the
    per-step Python work is the refresh loop itself; build a new aligner if parameters are replaced.

    Args:
        model_chunks: this rank's model chunks (all virtual stages); see :func:`chunk_parameters`.
        pp_group: process group synchronised when ``sync_group`` is set (default: world).
        sync_group: barrier over ``pp_group`` once after the refresh so all stages start the
            schedule together. Never inside a CUDA graph capture (raises there).
        fused: see :class:`~nemo_cudagraph_plugin.fp8.Fp8RefreshPlan`.

    Attributes: ``handle`` (the :class:`~nemo_cudagraph_plugin.fp8.Fp8RefreshHandle`; ``None`` when the chunks
    hold no FP8 parameter), ``plan`` (its plan, or ``None``), ``calls`` (host-side calls; a captured call
    replays without coming back here), ``syncs``, ``last_refreshed``. ``len(aligner)``: the FP8 parameters.
    """

    def __init__(
        self, model_chunks: ModelChunks, pp_group: Optional[Any] = None, sync_group: bool = False, fused: Fused = "auto"
    ):
        self.params = chunk_parameters(model_chunks)
        self._refresh: Optional[Callable[[], int]] = None
        # mode="auto": chunks without FP8 parameters install nothing and refresh nothing.
        self.handle: Optional[Fp8RefreshHandle] = install_fp8_refresh(
            self._attach, self.params, mode="auto", owner="TransposeAligner", require_stable_address=None, fused=fused
        )
        self.plan = None if self.handle is None else self.handle.plan
        self.pp_group = pp_group
        self.sync_group = bool(sync_group)
        self.calls = 0
        self.syncs = 0
        self.last_refreshed = 0

    def _attach(self, refresh: Callable[[], int]) -> Callable[[], None]:
        self._refresh = refresh

        def detach() -> None:
            self._refresh = None

        return detach

    def __len__(self) -> int:
        return 0 if self.plan is None else len(self.plan)

    def remove(self) -> None:
        """Uninstall the refresh: later calls refresh nothing (idempotent)."""
        if self.handle is not None:
            self.handle.remove()

    def refresh(self) -> int:
        """Refresh every FP8 transpose of the chunks; capturable. Returns how many were refreshed."""
        n = self._refresh() if self._refresh is not None else 0
        self.calls += 1
        self.last_refreshed = n
        return n

    def sync(self) -> bool:
        """The optional group barrier (host-blocking, not capturable)."""
        done = sync_pipeline_group(self.pp_group)
        self.syncs += int(done)
        return done

    def __call__(self) -> int:
        if self.sync_group:
            _refuse_sync_in_capture()
        n = self.refresh()
        if self.sync_group:
            self.sync()
        return n


def align_fp8_transposes(
    model_chunks: ModelChunks, pp_group: Optional[Any] = None, sync_group: bool = False
) -> int:
    """Refresh the transposes of every FP8 parameter of every model chunk on this rank, in one pass.

    Call it after the optimizer step (or, with a distributed optimizer, after the parameter
    all-gather has *finished*: the refresh reads the FP8 bytes, so it must see the new ones).
    Then no transpose is computed inside any microbatch of the next schedule.

    Captured: the refresh kernels, when called inside a graphed optimizer step (e.g. from a torch
    ``optimizer.register_step_post_hook``). Not captured: the optional barrier; ``sync_group=True``
    during a capture raises.

    Args:
        model_chunks: one module or this rank's list of chunks (all virtual stages).
        pp_group: the pipeline-parallel process group to synchronise (default: world).
        sync_group: barrier over ``pp_group`` once after the refresh, so all stages start the
            schedule together. Ignored (nothing to wait for) without ``torch.distributed``.

    Returns:
        The number of FP8 parameters refreshed (0 when the chunks hold none).
    """
    # One refresh through the installer (TransposeAligner), removed again: a loop calls the aligner itself.
    aligner = TransposeAligner(model_chunks, pp_group, sync_group)
    try:
        return aligner()
    finally:
        aligner.remove()
