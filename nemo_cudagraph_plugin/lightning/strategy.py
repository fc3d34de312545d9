"""``CudaGraphStrategy``: a strategy plugin that owns the captured step, single-device or DDP.

``CudaGraphStrategy(inner)`` returns an instance of a subclass of ``inner``'s class (so Lightning
and user code still see a ``DDPStrategy``/``SingleDeviceStrategy``) mixed with this class, with
``inner``'s configuration. It drives the same engine as :class:`CudaGraphCallback` (one
:class:`~.runner.LightningStepRunner`), and adds what only a strategy can do:

* DDP: ``find_unused_parameters=True`` refused (its per-step search for unused parameters
  runs on the host); at least 11 x ``accumulate_grad_batches`` + 1 eager warm-up steps before
  capture (DDP's reducer logs its first 10 synchronising iterations with CUDA events, a host sync);
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` set for this process only while the process group is
  created, then restored; the gradient all-reduce is captured inside the graph; gradient
  accumulation steps are captured inside ``no_sync`` (Lightning enters it before the step, so the
  accumulation graph holds no all-reduce and the stepping graph does).

Refused with a reason: FSDP, DeepSpeed, ModelParallel, XLA, Megatron.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info

from ..core.config import CaptureConfig, CaptureStats, with_capture_options
from . import _compat
from .checks import REFUSED_STRATEGIES
from .runner import LightningStepRunner

__all__ = ["CudaGraphStrategy"]

DDP_MIN_WARMUP = 11
_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


class CudaGraphStrategy(Strategy):
    """Wrap a Lightning strategy so that each training step is one CUDA graph replay.

    Usage::

        Trainer(accelerator="gpu", devices=1, strategy=CudaGraphStrategy())
        Trainer(accelerator="gpu", devices=8, strategy=CudaGraphStrategy("ddp"))
        Trainer(..., strategy=CudaGraphStrategy(DDPStrategy(static_graph=True), warmup_steps=20))

    Args:
        inner: ``None`` (single device), ``"ddp"``, or a configured ``SingleDeviceStrategy`` /
            ``DDPStrategy`` instance.
        config: a :class:`~nemo_cudagraph_plugin.core.config.CaptureConfig` to start from.
        **options: the options of :class:`~nemo_cudagraph_plugin.core.config.CaptureConfig`
            (the same typed keywords as :class:`CudaGraphCallback`).

    What is captured and what is not: as for :class:`CudaGraphCallback`.
    """

    capture_config: CaptureConfig
    stats: CaptureStats
    step_runner: LightningStepRunner

    @with_capture_options
    def __new__(cls, inner: Union[None, str, Strategy] = None, config: Optional[CaptureConfig] = None, **options: Any) -> CudaGraphStrategy:
        if cls is not CudaGraphStrategy:  # a concrete mixed class being instantiated by copy/pickle
            return super().__new__(cls)
        base = _resolve_inner(inner)
        cfg = CaptureConfig.build(config, options, owner="CudaGraphStrategy")
        if isinstance(base, DDPStrategy):
            if _compat.ddp_finds_unused_parameters(base):
                raise ValueError(
                    "CudaGraphStrategy('ddp') cannot capture DDP with find_unused_parameters=True: DDP then searches "
                    "the autograd graph for unused parameters on the host every step. Make every parameter "
                    "contribute to the loss (or freeze unused ones) and use find_unused_parameters=False."
                )
            cfg.warmup_steps = max(cfg.warmup_steps, DDP_MIN_WARMUP)
        obj = _compat.rebase_strategy(base, _mixed_class(type(base)))
        obj.capture_config = cfg
        obj.stats = CaptureStats()
        obj.step_runner = LightningStepRunner(cfg, obj.stats, owner="CudaGraphStrategy")
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # State comes from the wrapped instance (copied in __new__); nothing to initialise twice.
        pass

    def register_generator(self, generator: torch.Generator) -> None:
        """Make an extra CUDA ``torch.Generator`` used inside the step graph-safe (torch >= 2.5)."""
        self.step_runner.generators.register(generator)

    @property
    def eager_reason(self) -> Optional[str]:
        """Why this fit trained eagerly (``None`` when graphs were used)."""
        return self.step_runner.eager_reason

    # -- distributed setup ----------------------------------------------------------------------
    def setup_distributed(self) -> None:  # only reached for DDP
        # PyTorch: with NCCL async error handling on, the watchdog may query work created during
        # capture; it must be off for graph capture of collectives. Process-local, restored below.
        prev = os.environ.get(_ENV)
        os.environ[_ENV] = "0"
        try:
            super().setup_distributed()  # type: ignore[misc]
        finally:
            if prev is None:
                os.environ.pop(_ENV, None)
            else:
                os.environ[_ENV] = prev

    # -- step ownership --------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self.step_runner.check_setup(trainer, self.lightning_module)

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        if isinstance(self, DDPStrategy):
            # DDP's reducer collects runtime statistics with CUDA events (a host sync) during its
            # first 10 *synchronising* iterations; under accumulation only every k-th batch syncs.
            need = DDP_MIN_WARMUP * trainer.accumulate_grad_batches + 1
            if self.capture_config.warmup_steps < need:
                self.capture_config.warmup_steps = need
        self.step_runner.bind(trainer, self.lightning_module)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.step_runner.count_unbound_step()

    def on_validation_end(self) -> None:
        super().on_validation_end()
        self.step_runner.reattach_grads()

    def on_train_end(self) -> None:
        try:
            self.step_runner.check_nan()
        finally:
            self.step_runner.unbind()
            super().on_train_end()
        rank_zero_info(f"CudaGraphStrategy: {self.stats.summary()}")

    def on_exception(self, exception: BaseException) -> None:
        self.step_runner.unbind()
        super().on_exception(exception)

    def teardown(self) -> None:
        self.step_runner.unbind()
        super().teardown()

    def optimizer_state(self, optimizer: Any) -> dict:
        # Checkpoints get float lr/betas and the user's kernel flags, so they load anywhere.
        return self.step_runner.portable_optimizer_state(super().optimizer_state(optimizer))


_MIXED: dict[type, type] = {}


def _mixed_class(base_cls: type) -> type:
    cls = _MIXED.get(base_cls)
    if cls is None:
        cls = type(f"CudaGraph{base_cls.__name__}", (CudaGraphStrategy, base_cls), {"__module__": __name__})
        _MIXED[base_cls] = cls
    return cls


def _resolve_inner(inner: Union[None, str, Strategy]) -> Strategy:
    if inner is None or inner == "single_device" or inner == "auto":
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return SingleDeviceStrategy(device=dev)
    if isinstance(inner, str):
        if inner == "ddp":
            return DDPStrategy()
        raise ValueError(
            f"CudaGraphStrategy({inner!r}): unknown strategy name; use None (single device), 'ddp', or pass a "
            "configured SingleDeviceStrategy/DDPStrategy instance."
        )
    if isinstance(inner, CudaGraphStrategy):
        raise ValueError("CudaGraphStrategy(CudaGraphStrategy(...)): wrap a plain strategy once.")
    for cls in type(inner).__mro__:
        if cls.__name__ in REFUSED_STRATEGIES:
            raise ValueError(
                f"CudaGraphStrategy cannot wrap {type(inner).__name__}: {REFUSED_STRATEGIES[cls.__name__]}. "
                "Supported: SingleDeviceStrategy and DDPStrategy."
            )
    if not isinstance(inner, (SingleDeviceStrategy, DDPStrategy)):
        raise ValueError(
            f"CudaGraphStrategy cannot wrap {type(inner).__name__}: only SingleDeviceStrategy and DDPStrategy "
            "(and their subclasses) are supported."
        )
    return inner
