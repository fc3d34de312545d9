"""``CudaGraphStrategy``: a strategy plugin that owns the captured step, single-device or DDP.

``CudaGraphStrategy(inner)`` returns an instance of a subclass of ``inner``'s class (so Lightning
and user code still see a ``DDPStrategy``/``SingleDeviceStrategy``) mixed with this class, with
``inner``'s configuration. It drives the same engine as :class:`CudaGraphCallback` (one
:class:`~.runner.LightningStepRunner`), and adds what only a strategy can do:

* DDP: ``find_unused_parameters=True`` refused (its per-step search for unused parameters
  runs on the host); at least 11 eager warm-up steps before capture (PyTorch's DDP + CUDA graph
  guidance: the reducer rebuilds its buckets during the first iterations);
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` set for this process only while the process group is
  created, then restored; the model is wrapped on a side stream (Lightning's DDP already does);
  the gradient all-reduce is captured inside the graph; gradient accumulation steps are captured
  inside ``no_sync`` (Lightning enters it before the step, so the accumulation graph holds no
  all-reduce and the stepping graph does).
* The NaN guard observes gradients inside the strategy's ``optimizer_step``, before clipping.

Refused with a reason: FSDP, DeepSpeed, ModelParallel, XLA.
"""

import os
from collections.abc import Callable
from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info

from ..core.config import CaptureConfig, CaptureStats
from .runner import _REFUSED_STRATEGIES, LightningStepRunner

__all__ = ["CudaGraphStrategy"]

DDP_MIN_WARMUP = 11
_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


class CudaGraphStrategy(Strategy):
    """Wrap a Lightning strategy so that each training step is one CUDA graph replay.

    Usage::

        Trainer(accelerator="gpu", devices=1, strategy=CudaGraphStrategy())
        Trainer(accelerator="gpu", devices=8, strategy=CudaGraphStrategy("ddp"))
        Trainer(..., strategy=CudaGraphStrategy(DDPStrategy(static_graph=True)))

    Args:
        inner: ``None`` (single device), ``"ddp"``, or a configured ``SingleDeviceStrategy`` /
            ``DDPStrategy`` instance.
        **options: the options of :class:`~nemo_cudagraph_plugin.core.config.CaptureConfig`
            (the same as :class:`CudaGraphCallback`).

    What is captured and what is not: as for :class:`CudaGraphCallback`.
    """

    _cg_config: CaptureConfig
    stats: CaptureStats

    def __new__(cls, inner: Union[None, str, Strategy] = None, **options: Any) -> "CudaGraphStrategy":
        if cls is not CudaGraphStrategy:  # a concrete mixed class being instantiated by copy/pickle
            return super().__new__(cls)
        base = _resolve_inner(inner)
        mixed = _mixed_class(type(base))
        obj = Strategy.__new__(mixed)
        obj.__dict__.update(base.__dict__)
        obj._cg_init(**options)
        return obj

    def __init__(self, inner: Union[None, str, Strategy] = None, **options: Any) -> None:
        # State comes from the wrapped instance (copied in __new__); nothing to initialise twice.
        pass

    def _cg_init(
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
        if isinstance(self, DDPStrategy):
            if self._ddp_kwargs.get("find_unused_parameters"):
                raise ValueError(
                    "CudaGraphStrategy('ddp') cannot capture DDP with find_unused_parameters=True: DDP then searches "
                    "the autograd graph for unused parameters on the host every step. Make every parameter "
                    "contribute to the loss (or freeze unused ones) and use find_unused_parameters=False."
                )
            warmup_steps = max(warmup_steps, DDP_MIN_WARMUP)
        self._cg_config = CaptureConfig.from_options(locals())
        self.stats = CaptureStats()
        self._cg_runner = LightningStepRunner(self._cg_config, self.stats)

    @property
    def capture_config(self) -> CaptureConfig:
        return self._cg_config

    def register_generator(self, generator: torch.Generator) -> None:
        """Make an extra CUDA ``torch.Generator`` used inside the step graph-safe (torch >= 2.5)."""
        self._cg_runner.generators.register(generator)

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
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        from .callback import CudaGraphCallback

        if any(isinstance(cb, CudaGraphCallback) for cb in trainer.callbacks):
            raise ValueError(
                "Both CudaGraphCallback and CudaGraphStrategy are configured; they capture the same step. "
                "Keep one: remove the callback (pass its options to CudaGraphStrategy) or use a plain strategy."
            )
        if isinstance(self, DDPStrategy):
            # DDP's reducer collects runtime statistics with CUDA events (a host sync) during its
            # first 10 *synchronising* iterations; under accumulation only every k-th batch syncs.
            need = DDP_MIN_WARMUP * trainer.accumulate_grad_batches + 1
            if self._cg_config.warmup_steps < need:
                self._cg_config.warmup_steps = need
        self._cg_runner.bind(trainer, self.lightning_module)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        runner = self._cg_runner

        def closure_then_observe() -> Any:
            out = closure()
            # After backward (and the DDP all-reduce), before clipping and the update.
            runner.observe_grads()
            return out

        return super().optimizer_step(optimizer, closure_then_observe, model, **kwargs)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if not self._cg_runner._grads and self._cg_runner.active:
            self._cg_runner.remember_grads()

    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._cg_runner.reattach_grads()

    def on_train_end(self) -> None:
        try:
            self._cg_runner.check_nan()
        finally:
            self._cg_runner.unbind()
            super().on_train_end()
        if self._cg_runner.engine is not None:
            rank_zero_info(f"CudaGraphStrategy: {self.stats.summary()}")

    def on_exception(self, exception: BaseException) -> None:
        self._cg_runner.unbind()
        super().on_exception(exception)

    def teardown(self) -> None:
        self._cg_runner.unbind()
        super().teardown()

    def optimizer_state(self, optimizer: Any) -> dict:
        state = super().optimizer_state(optimizer)
        if self._cg_runner.prep is not None:
            from ..core.optim import portable_optimizer_state

            # state_dict() shares nothing mutable we change below except the copied group dicts.
            portable_optimizer_state(state, self._cg_runner.prep._saved)
        return state

    @property
    def eager_reason(self) -> Optional[str]:
        r = self._cg_runner
        return r.eager_reason or (r.engine.disabled_reason if r.engine else None)


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
        if cls.__name__ in _REFUSED_STRATEGIES:
            raise ValueError(
                f"CudaGraphStrategy cannot wrap {type(inner).__name__}: {_REFUSED_STRATEGIES[cls.__name__]}. "
                "Supported: SingleDeviceStrategy and DDPStrategy."
            )
    if not isinstance(inner, (SingleDeviceStrategy, DDPStrategy)):
        raise ValueError(
            f"CudaGraphStrategy cannot wrap {type(inner).__name__}: only SingleDeviceStrategy and DDPStrategy "
            "(and their subclasses) are supported."
        )
    return inner
