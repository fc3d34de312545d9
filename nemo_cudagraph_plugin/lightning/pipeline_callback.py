"""Lightning callback: refresh FP8 weight transposes of all model chunks right after each optimizer
step, so no pipeline stage computes one inside a microbatch (see :mod:`nemo_cudagraph_plugin.pipeline`).

Example::

    from nemo_cudagraph_plugin.lightning.pipeline_callback import AlignPipelineTransposes

    trainer = L.Trainer(callbacks=[AlignPipelineTransposes(sync_group=True)], ...)

With NeMo's ``MegatronStrategy`` the model chunks are the strategy's ``MegatronParallel`` list
(all virtual stages); otherwise the LightningModule. Pass ``model_chunks=`` to choose.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import lightning.pytorch as pl
from torch import nn

from nemo_cudagraph_plugin.megatron import ParamSyncHook, default_pp_group
from nemo_cudagraph_plugin.pipeline import ModelChunks, TransposeAligner, sync_pipeline_group

__all__ = ["AlignPipelineTransposes"]


def _resolve_chunks(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[Any]:
    model = getattr(trainer.strategy, "model", None)
    # NeMo's MegatronParallel is an nn.ModuleList of the virtual-stage chunks of this rank.
    if isinstance(model, nn.ModuleList) and len(model) > 0:
        return list(model)
    return [pl_module]


class AlignPipelineTransposes(pl.Callback):
    """Refresh every FP8 transpose of every model chunk after each optimizer step, in one pass.

    How: a torch ``optimizer.register_step_post_hook`` on each of the trainer's optimizers runs
    the refresh right after ``optimizer.step()``. When the step is captured into a CUDA graph
    (``CudaGraphCallback``/``CudaGraphStrategy``) the refresh kernels are captured with it and
    replay every step; otherwise they run eagerly. The hooks are removed at fit end.

    The optional barrier over the pipeline group (``sync_group=True``) blocks the host, so it is
    never captured: it runs once per optimizer step at the end of the training batch that stepped
    (after the refresh was enqueued, before the next schedule starts).

    Megatron DDP chunks that overlap their parameter all-gather with the forward
    (``ddp_config.overlap_param_gather=True``) get the new FP8 bytes only when that all-gather
    finishes, so the callback finishes it first (``start_param_sync(force_sync=True)``, as
    :func:`nemo_cudagraph_plugin.megatron.make_param_sync_hook` does), then refreshes; that part is
    eager-only (a graphed step with such chunks raises a clear error).

    If an optimizer's ``step`` does not run torch step hooks (a wrapper that bypasses
    ``torch.optim.Optimizer.__init__``), that is detected after the first step: the callback warns
    and from then on refreshes at the end of each stepping batch instead (outside any graph).

    Args:
        model_chunks: the chunks to refresh; default: the strategy's ``nn.ModuleList`` of chunks
            (NeMo ``MegatronParallel``) or the LightningModule.
        sync_group: barrier over ``pp_group`` once per optimizer step.
        pp_group: the pipeline-parallel group; default Megatron-core's when initialised, else world.

    Attributes: ``refreshes`` (host-side refresh calls; a graph replay refreshes without coming
    back to Python), ``syncs``, ``fallback`` (True once refreshing outside the optimizer step).
    """

    def __init__(
        self,
        model_chunks: Optional[ModelChunks] = None,
        *,
        sync_group: bool = False,
        pp_group: Optional[Any] = None,
    ) -> None:
        super().__init__()
        self.model_chunks = model_chunks
        self.sync_group = bool(sync_group)
        self.pp_group = pp_group
        self.hook: Optional[ParamSyncHook] = None
        self.fallback = False
        self.syncs = 0
        self._handles: list[Any] = []
        self._hook_calls = 0
        self._last_step: Optional[int] = None
        self._checked = False
        self._pp_group: Optional[Any] = None

    @property
    def aligner(self) -> Optional[TransposeAligner]:
        return None if self.hook is None else self.hook.aligner

    @property
    def refreshes(self) -> int:
        return 0 if self.hook is None else self.hook.aligner.calls

    # -- hooks ----------------------------------------------------------------------------------

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # Runs inside optimizer.step(): captured with it under CUDA graphs, eager otherwise.
        self._hook_calls += 1
        self.hook.align()  # type: ignore[union-attr]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        chunks = self.model_chunks if self.model_chunks is not None else _resolve_chunks(trainer, pl_module)
        pp_group = self.pp_group
        if self.sync_group and pp_group is None:
            pp_group = default_pp_group()
        # The barrier is done at batch end, outside the step, so the hook itself never syncs.
        self.hook = ParamSyncHook(chunks, sync_group=False, finish_param_sync=True)
        self._pp_group = pp_group
        if len(self.hook.aligner.plan) == 0:
            warnings.warn(
                "AlignPipelineTransposes: the model chunks hold no FP8 (TransformerEngine Float8Tensor) "
                "parameter, so there is no transpose to align; remove the callback or create the model under "
                "te.quantized_model_init / te.fp8_model_init.",
                stacklevel=2,
            )
        self._remove_hooks()
        self._hook_calls = 0
        self._checked = False
        self.fallback = False
        self._last_step = trainer.global_step
        for opt in trainer.optimizers:
            try:
                self._handles.append(opt.register_step_post_hook(self._post_step))
            except AttributeError:
                self._use_fallback(
                    f"{type(opt).__name__} does not support torch step hooks (no register_step_post_hook)"
                )

    def _use_fallback(self, why: str) -> None:
        if not self.fallback:
            warnings.warn(
                f"AlignPipelineTransposes: {why}; refreshing FP8 transposes at the end of each training batch "
                "that stepped instead (eager, outside any CUDA graph). Still before the next microbatch.",
                stacklevel=3,
            )
        self.fallback = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.hook is None or trainer.global_step == self._last_step:
            return  # accumulating gradients: no optimizer step in this batch
        self._last_step = trainer.global_step
        if not self._checked:
            self._checked = True
            if self._hook_calls == 0 and not self.fallback:
                self._use_fallback("the optimizer stepped but its torch step post-hook never ran")
        if self.fallback:
            self.hook.align()
        if self.sync_group:
            if sync_pipeline_group(self._pp_group):
                self.syncs += 1

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()
