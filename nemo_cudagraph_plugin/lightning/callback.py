"""``CudaGraphCallback``: whole-step CUDA graphs for an unmodified LightningModule."""

from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from ..core.config import CaptureConfig, CaptureStats
from .runner import LightningStepRunner

__all__ = ["CudaGraphCallback"]


class CudaGraphCallback(Callback):
    """Capture each training step — zero-grad, forward, backward, clipping, optimizer step — into
    one CUDA graph and replay it.

    Usage::

        trainer = Trainer(accelerator="gpu", devices=1, callbacks=[CudaGraphCallback()])
        trainer.fit(model, datamodule)

    The first ``warmup_steps`` steps run eagerly (on a side stream); the last of them checks the
    step for host syncs. Then each input signature (shapes, dtypes, non-tensor batch values, and
    whether the step zeroes gradients / steps the optimizer under ``accumulate_grad_batches``) is
    captured once and replayed for every later batch with that signature.

    Captured: every CUDA kernel of ``training_step``, ``zero_grad`` (in place), ``backward``,
    gradient clipping, ``optimizer.step`` and hooks called in between. Replayed per step on the
    host: ``self.log`` values and Lightning's step counters. Not captured: validation, test,
    predict, LR scheduler steps (they update the graph's device-side learning rate in place),
    ``on_train_batch_start/end`` and everything else outside the step. Python side effects of
    code inside the step (counters, prints) happen only at capture.

    Requirements: one CUDA device (for DDP use :class:`CudaGraphStrategy`), automatic
    optimization, one optimizer among Adam/AdamW/SGD or one with ``capturable=True``,
    precision ``32-true``/``bf16-mixed``/``bf16-true``. Without CUDA, or with ``enabled=False``,
    it warns once and training is plain eager Lightning.

    Args: see :class:`~nemo_cudagraph_plugin.core.config.CaptureConfig`.
    """

    def __init__(
        self,
        enabled: bool = True,
        warmup_steps: int = 3,
        max_graphs: int = 8,
        on_cache_full: Literal["eager", "evict"] = "eager",
        on_capture_error: Literal["raise", "eager"] = "raise",
        nan_guard: Union[bool, Literal["loss", "full"]] = True,
        nan_check_every: int = 50,
        nan_action: Literal["raise", "skip"] = "raise",
        verify_steps: int = 0,
        verify_rtol: float = 0.0,
        sync_check: bool = True,
        fp8_refresh: Union[bool, Literal["auto"]] = "auto",
        align_pp_transposes: bool = False,
    ) -> None:
        self.config = CaptureConfig.from_options(locals())
        self.stats = CaptureStats()
        self._runner = LightningStepRunner(self.config, self.stats)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(warmup_steps=self.config.warmup_steps, max_graphs=self.config.max_graphs)

    def register_generator(self, generator: torch.Generator) -> None:
        """Make an extra CUDA ``torch.Generator`` used inside the step graph-safe (torch >= 2.5)."""
        self._runner.generators.register(generator)

    # -- lifecycle ----------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from .strategy import CudaGraphStrategy

        if isinstance(trainer.strategy, CudaGraphStrategy):
            raise ValueError(
                "Both CudaGraphCallback and CudaGraphStrategy are configured; they capture the same step. "
                "Keep one: remove the callback (pass its options to CudaGraphStrategy) or use a plain strategy."
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._runner.bind(trainer, pl_module)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # Before clipping, so a NaN is attributed to its parameter, not smeared by the clip factor.
        self._runner.observe_grads()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._runner._grads and self._runner.active:
            self._runner.remember_grads()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training or trainer.state.fn == "fit":
            self._runner.reattach_grads()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._runner.reattach_grads()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._runner.check_nan()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self._runner.check_nan()
        finally:
            self._runner.unbind()
        if self._runner.engine is not None:
            rank_zero_info(f"CudaGraphCallback: {self.stats.summary()}")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._runner.unbind()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._runner.unbind()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._runner.portable_checkpoint(checkpoint)

    @property
    def eager_reason(self) -> Optional[str]:
        """Why this fit trained eagerly (``None`` when graphs were used)."""
        return self._runner.eager_reason or (self._runner.engine.disabled_reason if self._runner.engine else None)
