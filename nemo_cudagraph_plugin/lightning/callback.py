"""``CudaGraphCallback``: whole-step CUDA graphs for an unmodified LightningModule."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from ..core.config import CaptureConfig, CaptureStats, with_capture_options
from . import _compat
from .runner import LightningStepRunner

__all__ = ["CudaGraphCallback"]


class CudaGraphCallback(Callback):
    """Capture each training step — zero-grad, forward, backward, clipping, optimizer step — into
    one CUDA graph and replay it.

    Usage::

        trainer = Trainer(accelerator="gpu", devices=1, callbacks=[CudaGraphCallback()])
        trainer.fit(model, datamodule)

    The first ``warmup_steps`` steps run eagerly (on a side stream); the last of them checks the
    step for host syncs. Then each key — input signature (shapes, dtypes, non-tensor batch values)
    and step key (whether the step zeroes gradients / steps the optimizer, ``accumulate_grad_batches``,
    gradient clipping, precision) — is captured once and replayed for every later batch with that key.

    Captured: every CUDA kernel of ``training_step``, ``zero_grad``, ``backward``, gradient
    clipping, ``optimizer.step`` and hooks called in between. Replayed per step on the host:
    ``self.log`` values and Lightning's step counters. Kept live: the learning rate (a device
    tensor LR schedulers update). Not captured: validation, test, predict, LR scheduler steps,
    ``on_train_batch_start/end`` and everything else outside the step. Python side effects of code
    inside the step (counters, prints) happen only at capture; code inside the step that assigns an
    optimizer hyperparameter is refused at capture with its file:line.

    Requirements, checked at ``setup`` on any machine: automatic optimization, one optimizer among
    Adam/AdamW/SGD or one with ``capturable=True``, precision ``32-true``/``bf16-mixed``/``bf16-true``,
    a single-device strategy (for DDP use :class:`CudaGraphStrategy`). Without CUDA, or with
    ``enabled=False``, it warns once and training is plain eager Lightning (counted in
    ``stats.eager_reasons``).

    Args:
        config: a :class:`~nemo_cudagraph_plugin.core.config.CaptureConfig` to start from.
        **options: the options of :class:`~nemo_cudagraph_plugin.core.config.CaptureConfig`,
            as typed keywords (``CudaGraphCallback(warmup_steps=5, nan_guard="loss")``).
    """

    @with_capture_options
    def __init__(self, config: Optional[CaptureConfig] = None, **options: Any) -> None:
        self.config = CaptureConfig.build(config, options, owner="CudaGraphCallback")
        self.stats = CaptureStats()
        self.step_runner = LightningStepRunner(self.config, self.stats, owner="CudaGraphCallback")

    @property
    def state_key(self) -> str:
        # Lightning reads this around every hook call (twice per step); the options it names never change.
        key = self.__dict__.get("_state_key")
        if key is None:
            key = self.__dict__["_state_key"] = _compat.callback_state_key(
                self, warmup_steps=self.config.warmup_steps, max_graphs=self.config.max_graphs
            )
        return key

    def register_generator(self, generator: torch.Generator) -> None:
        """Make an extra CUDA ``torch.Generator`` used inside the step graph-safe (torch >= 2.5)."""
        self.step_runner.generators.register(generator)

    @property
    def eager_reason(self) -> Optional[str]:
        """Why this fit trained eagerly (``None`` when graphs were used)."""
        return self.step_runner.eager_reason

    # -- lifecycle ----------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.step_runner.check_setup(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step_runner.bind(trainer, pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.step_runner.count_unbound_step()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training or trainer.state.fn == "fit":
            self.step_runner.reattach_grads()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step_runner.reattach_grads()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step_runner.check_nan()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self.step_runner.check_nan()
        finally:
            self.step_runner.unbind()
        rank_zero_info(f"CudaGraphCallback: {self.stats.summary()}")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.step_runner.unbind()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.step_runner.unbind()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.step_runner.portable_checkpoint(checkpoint)
