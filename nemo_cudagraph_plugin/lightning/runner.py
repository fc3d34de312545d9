"""Binds the capture engine to one Lightning ``Trainer`` (shared by the callback and the strategy).

Per training batch Lightning calls ``automatic_optimization.run(optimizer, batch_idx, kwargs)``.
While bound, that call (on this trainer's loop instance only) goes through
:meth:`LightningStepRunner.run`, which hands the engine a step function covering the whole
``run``: training_step, zero_grad, backward, gradient clipping and optimizer.step.

Replayed steps skip Python, so the runner repeats the host-side effects Lightning relies on:

* ``self.log`` / ``log_dict`` calls made inside the step (by the module or by callbacks in
  ``on_before_backward``/``on_after_backward``/``on_before_optimizer_step``) are recorded at
  capture and re-emitted after every replay with that step's values;
* the optimization progress counters (``trainer.global_step``) advance as in eager mode.

Other Python side effects of hooks inside the step run once, at capture.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from ..core.config import CaptureConfig, CaptureStats
from ..core.engine import CaptureEngine, GraphEntry
from ..core.errors import CaptureError
from ..core.nan_guard import NanGuard
from ..core.optim import OptimizerPrep, portable_optimizer_state
from ..core.rng import GeneratorRegistry
from . import _compat

__all__ = ["LightningStepRunner"]

_REFUSED_STRATEGIES = {
    "FSDPStrategy": "FSDP re-shards parameters and allocates gradient buffers inside every step",
    "DeepSpeedStrategy": "DeepSpeed's engine owns the optimizer step and synchronises with the host",
    "ModelParallelStrategy": "DTensor/FSDP2 collectives and re-sharding are not captured by this plugin",
    "XLAStrategy": "CUDA graphs need a CUDA device",
    "MegatronStrategy": (
        "NeMo's MegatronStrategy drives the step with Megatron's pipeline schedules (a dataloader_iter training step), "
        "not Lightning's closure; use nemo_cudagraph_plugin.nemo.with_cuda_graph(recipe), which turns on "
        "Megatron-core's own CUDA graphs and keeps our FP8 transpose care"
    ),
}


# A hyperparameter a graph bakes in may change a couple of times (a manual change, an LR finder);
# more than this and it is being scheduled, which graphs cannot follow.
_MAX_HP_RECAPTURES = 2


class _LogRecord:
    __slots__ = ("fx", "name", "args", "kwargs", "tensor")

    def __init__(self, fx: Any, name: str, args: tuple, kwargs: dict, tensor: bool) -> None:
        self.fx, self.name, self.args, self.kwargs, self.tensor = fx, name, args, kwargs, tensor


class LightningStepRunner:
    """Owns the engine, the optimizer preparation and the NaN guard for one ``fit``."""

    def __init__(self, config: CaptureConfig, stats: CaptureStats, generators: Optional[GeneratorRegistry] = None) -> None:
        self.config = config
        self.stats = stats
        self.generators = generators or GeneratorRegistry()
        self.engine: Optional[CaptureEngine] = None
        self.prep: Optional[OptimizerPrep] = None
        self.guard: Optional[NanGuard] = None
        self.trainer: Any = None
        self.pl_module: Any = None
        self._loop: Any = None
        self._orig_run: Optional[Callable] = None
        self._orig_zero_grad: Optional[Callable] = None
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._hooks: list[Any] = []
        self._records: dict[int, list[_LogRecord]] = {}
        self._kept_tokens: set[int] = set()
        self._next_token = 0
        self._frozen_warned: set[str] = set()
        self._steps = 0
        self._grads: list[tuple[Tensor, Tensor]] = []
        self._last_delta: Optional[_compat.ProgressDelta] = None
        self._last_token = 0
        self._fp8_handle: Any = None
        self.eager_reason: Optional[str] = None
        self._hp_changes = 0
        self._checked_at = 0

    # ------------------------------------------------------------------------------------------
    # binding
    # ------------------------------------------------------------------------------------------
    def refusal(self, trainer: Any, pl_module: Any, require_cuda: bool = True) -> Optional[str]:
        """Why this fit cannot be graphed (``None`` if it can). Raises nothing."""
        if not self.config.enabled:
            return "disabled by the user (enabled=False)"
        if require_cuda and not torch.cuda.is_available():
            return "no CUDA device is available"
        if require_cuda and pl_module.device.type != "cuda":
            return f"the model is on {pl_module.device}, not on a CUDA device (Trainer(accelerator='gpu'))"
        name = type(trainer.strategy).__name__
        for refused, why in _REFUSED_STRATEGIES.items():
            if any(c.__name__ == refused for c in type(trainer.strategy).__mro__):
                return f"{name} is not supported: {why}. Use a single device or CudaGraphStrategy('ddp')"
        if not pl_module.automatic_optimization:
            return (
                "manual optimization (automatic_optimization=False) is not captured: the step's structure is your "
                "code, so the plugin cannot see where it begins and ends. Capture your own step with "
                "nemo_cudagraph_plugin.core.CaptureEngine, or use automatic optimization"
            )
        precision = str(trainer.precision)
        if precision.startswith("16") or precision in ("fp16", "half"):
            return (
                f"precision={precision!r} uses a GradScaler, whose step reads found_inf on the host every step; use "
                "precision='bf16-mixed' (or '32-true')"
            )
        if len(trainer.optimizers) != 1:
            return f"automatic optimization with {len(trainer.optimizers)} optimizers is not captured; use one optimizer"
        return None

    def bind(self, trainer: Any, pl_module: Any) -> None:
        """Prepare the optimizer and route this trainer's step through the engine.

        Raises :class:`CaptureError` (``on_capture_error="raise"``) when the fit cannot be graphed
        for a reason the user must fix; warns once and leaves training eager otherwise.
        """
        _compat.check_lightning_version()
        self.trainer, self.pl_module = trainer, pl_module
        why = self.refusal(trainer, pl_module)
        if why is not None:
            soft = (not self.config.enabled) or (not torch.cuda.is_available()) or pl_module.device.type != "cuda"
            if soft or self.config.on_capture_error == "eager":
                self.eager_reason = why
                warnings.warn(f"nemo_cudagraph_plugin: training eagerly: {why}.", stacklevel=2)
                return
            raise CaptureError(
                f"cannot capture this training step into CUDA graphs: {why}. "
                "Pass on_capture_error='eager' to train without graphs instead.",
                rule="configuration",
            )
        optimizer = trainer.optimizers[0]
        try:
            self.prep = OptimizerPrep(optimizer, pl_module.device, skip_nonfinite=self.config.nan_action == "skip")
            self.prep.apply()
        except TypeError as exc:
            if self.config.on_capture_error == "eager":
                self.prep = None
                self.eager_reason = str(exc)
                warnings.warn(f"nemo_cudagraph_plugin: training eagerly: {exc}", stacklevel=2)
                return
            raise CaptureError(str(exc), rule="optimizer") from exc
        self._optimizer = optimizer
        named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        if self.config.nan_mode != "off" or self.config.nan_action == "skip":
            self.guard = NanGuard(named, pl_module.device, "full" if self.config.nan_mode == "off" else self.config.nan_mode)
        self._loop = _compat.automatic_loop(trainer)
        self.engine = CaptureEngine(
            self.config,
            pl_module.device,
            named,
            state_fn=self._state_tensors,
            generators=self.generators,
            host_state=lambda: _compat.restorer(self._loop, pl_module),
            stats=self.stats,
        )
        self.engine.guards.append(self._hyperparam_guard)
        self.engine.after_replay = self._after_replay
        self.engine.on_capture = self._on_capture
        self._install(optimizer, pl_module)

    def _install(self, optimizer: torch.optim.Optimizer, pl_module: Any) -> None:
        loop = self._loop
        self._orig_run = loop.run
        loop.run = self.run  # instance attribute: this trainer only

        # Gradients must keep their addresses across graphs: zero them in place inside the step.
        orig_zero = optimizer.zero_grad
        self._orig_zero_grad = orig_zero

        def zero_grad_in_place(set_to_none: bool = True) -> None:
            orig_zero(set_to_none=False)

        optimizer.zero_grad = zero_grad_in_place
        # Replacing parameters or optimizer state (load_state_dict) invalidates captured addresses.
        self._hooks.append(optimizer.register_load_state_dict_post_hook(lambda *_: self._mark_dirty(reprep=True)))
        self._hooks.append(pl_module.register_load_state_dict_post_hook(lambda *_: self._mark_dirty()))
        if self.config.fp8_refresh:
            self._install_fp8(optimizer, pl_module)

    def _install_fp8(self, optimizer: torch.optim.Optimizer, pl_module: Any) -> None:
        try:
            from ..fp8 import install_fp8_refresh, iter_fp8_params
        except ImportError:  # the FP8 module itself failed to import: only fatal if FP8 was required
            if self.config.fp8_refresh is True:
                raise
            return
        has_fp8 = any(True for _ in iter_fp8_params(pl_module))
        if not has_fp8:
            if self.config.fp8_refresh is True:
                raise CaptureError(
                    "fp8_refresh=True but the model has no TransformerEngine Float8Tensor parameters "
                    "(build it under te.quantized_model_init / te.fp8_model_init, or use fp8_refresh='auto').",
                    rule="configuration",
                )
            return
        self._fp8_handle = install_fp8_refresh(optimizer, pl_module)
        # TransformerEngine's other graph hazards (see nemo_cudagraph_plugin.fp8.hazards): the RNG
        # tracker's generators advance per replay, a frozen is_first_microbatch=False is refused, and
        # modules whose delayed-scaling amax would never update are refused.
        from ..fp8.hazards import (
            FirstMicrobatchCheck,
            check_delayed_scaling_registered,
            register_rng_generators,
        )

        register_rng_generators(self.generators)
        self.engine.capture_contexts.append(lambda: FirstMicrobatchCheck(pl_module))
        self.engine.post_capture_checks.append(lambda: check_delayed_scaling_registered(pl_module))

    def unbind(self) -> None:
        """Undo everything :meth:`bind` changed (also after an exception)."""
        if self._loop is not None and self._orig_run is not None:
            if self._loop.__dict__.get("run") == self.run:
                del self._loop.run
        if self._optimizer is not None and self._orig_zero_grad is not None:
            self._optimizer.__dict__.pop("zero_grad", None)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._fp8_handle is not None:
            self._fp8_handle.remove()
            self._fp8_handle = None
        if self.prep is not None:
            self.prep.restore()
        if self.engine is not None:
            self.engine.cache.clear()  # frees the graphs; stats.graphs keeps the count at the end of fit
        self._orig_run = None
        self._orig_zero_grad = None

    @property
    def active(self) -> bool:
        return self.engine is not None and self._orig_run is not None

    # ------------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------------
    def run(self, optimizer: torch.optim.Optimizer, batch_idx: int, kwargs: OrderedDict) -> Any:
        """Replacement for ``automatic_optimization.run`` on this trainer."""
        engine = self.engine
        phase = _compat.step_phase(self.trainer, self._loop, batch_idx)
        orig_run = self._orig_run

        def fn(batch: Any, quiet: bool = False) -> Any:
            kw = kwargs if batch is kwargs.get("batch") else OrderedDict(kwargs, batch=batch)
            return self._recorded(lambda: orig_run(optimizer, batch_idx, kw), quiet)

        out, values, token = engine.step(kwargs.get("batch"), phase, fn, quiet_fn=lambda b: fn(b, quiet=True))
        records = self._records.get(token, ())
        if token not in self._kept_tokens:
            self._records.pop(token, None)
        self._emit(records, values)
        self._steps += 1
        if self.guard is not None and self._steps % self.config.nan_check_every == 0:
            self.check_nan()
        return out

    def _recorded(self, call: Callable[[], Any], quiet: bool) -> Any:
        """Run ``call`` with ``self.log`` recorded instead of performed; return outputs + log values."""
        pl_module = self.pl_module
        records: list[_LogRecord] = []
        values: list[Tensor] = []

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            is_t = isinstance(value, Tensor)
            rec = _LogRecord(_compat.current_fx(pl_module), name, args, kwargs, is_t)
            if is_t:
                # detach + clone: the logged value becomes a graph output of its own, so later
                # in-place changes to the source tensor within the step cannot alter it.
                values.append(value.detach().clone())
            else:
                rec.args = (value, *args)
            records.append(rec)

        before = _compat.progress_snapshot(self._loop)
        pl_module.__dict__["log"] = log
        try:
            out = call()
        finally:
            pl_module.__dict__.pop("log", None)
        self._last_delta = _compat.ProgressDelta(before, _compat.progress_snapshot(self._loop))
        if self.guard is not None and isinstance(out, dict) and isinstance(out.get("loss"), Tensor):
            self.guard.observe_loss(out["loss"])
        if quiet:
            return out, values, -1
        # Records of an eager step are used once (popped in run); those of a capture are kept for
        # every replay of its graph (see _on_capture).
        self._next_token += 1
        token = self._next_token
        self._records[token] = records
        self._last_token = token
        return out, values, token

    def _on_capture(self, entry: GraphEntry) -> None:
        entry.meta["progress"] = self._last_delta
        self._kept_tokens.add(self._last_token)
        for rec in self._records[self._last_token]:
            if not rec.tensor and rec.name not in self._frozen_warned:
                self._frozen_warned.add(rec.name)
                warnings.warn(
                    f"self.log('{rec.name}', ...) logged a Python value inside the captured step; replays re-emit the "
                    "value seen at capture. Log a tensor to see per-step values.",
                    stacklevel=2,
                )
        out_leaves = entry.out_leaves
        if not out_leaves:
            warnings.warn("training_step returned no loss tensor; nothing is reported per step.", stacklevel=2)

    def _after_replay(self, entry: GraphEntry) -> None:
        delta = entry.meta.get("progress")
        if delta is not None:
            delta.apply()

    def _emit(self, records: list[_LogRecord], values: list[Tensor]) -> None:
        if not records:
            return
        pl_module = self.pl_module
        prev = _compat.current_fx(pl_module)
        it = iter(values)
        try:
            for rec in records:
                _compat.set_current_fx(pl_module, rec.fx)
                if rec.tensor:
                    pl_module.log(rec.name, next(it), *rec.args, **rec.kwargs)
                else:
                    pl_module.log(rec.name, *rec.args, **rec.kwargs)
        finally:
            _compat.set_current_fx(pl_module, prev)

    # ------------------------------------------------------------------------------------------
    # guards and events
    # ------------------------------------------------------------------------------------------
    def _hyperparam_guard(self) -> Optional[str]:
        if self.prep is None:
            return None
        changed = self.prep.sync_hyperparams()
        if changed is None:
            return None
        self.prep.freeze_scalars()
        self._hp_changes += 1
        if self._hp_changes > _MAX_HP_RECAPTURES:
            msg = (
                f"optimizer hyperparameter keeps changing ({changed}): a scheduler cycles a value this torch's "
                f"{type(self.prep.optimizer).__name__} cannot read from device memory inside a CUDA graph (betas are "
                "turned into host scalars; SGD momentum is a Python float), so every change would need a new "
                "capture. Use OneCycleLR/CyclicLR(cycle_momentum=False) — the learning rate itself is a device "
                "tensor and may change every step"
            )
            if self.config.on_capture_error == "raise":
                raise CaptureError(msg + ", or pass on_capture_error='eager'.", rule="scheduled-hyperparameter")
            self.engine.disable(msg)
            return msg
        return f"optimizer hyperparameter changed ({changed}); it is baked into the graph as a constant"

    def _state_tensors(self) -> list[Tensor]:
        return self.prep.state_tensors() if self.prep is not None else []

    def _mark_dirty(self, reprep: bool = False) -> None:
        if reprep and self.prep is not None:
            self.prep.apply()  # a loaded state may bring float lr / CPU step counters back
        if self.engine is not None:
            self.engine.dirty = True

    def observe_grads(self) -> None:
        """Called right before clipping and the optimizer step (inside the captured region)."""
        if self.guard is not None and self.active:
            self.guard.observe_grads(self.prep.found_inf if self.prep is not None else None)

    def reattach_grads(self) -> None:
        """Lightning frees gradients before validation; give the graphs' gradient buffers back."""
        if self.engine is None:
            return
        if not self._grads:
            self._grads = [(p, p.grad) for _, p in self.engine.named_params if p.grad is not None]
        for p, g in self._grads:
            if p.grad is None:
                p.grad = g
        self.engine.dirty = True

    def remember_grads(self) -> None:
        if self.engine is not None and not self._grads:
            self._grads = [(p, p.grad) for _, p in self.engine.named_params if p.grad is not None]

    def check_nan(self) -> None:
        """Read the NaN guard (one host sync); raise or report."""
        if self.guard is None:
            return
        gs = self.trainer.global_step if self.trainer is not None else self._steps
        window = f"in the optimizer steps after global step {self._checked_at} up to {gs}"
        self._checked_at = gs
        report = self.guard.check(raise_on_bad=self.config.nan_action == "raise", window=window)
        self.stats.skipped_steps = self.guard.skipped_steps() if self.config.nan_action == "skip" else 0
        if report is not None:
            warnings.warn(f"{report} The optimizer update of those steps was skipped.", stacklevel=2)

    def portable_checkpoint(self, checkpoint: dict) -> None:
        """Write floats (not device tensors) for lr/betas into a checkpoint being saved."""
        if self.prep is None:
            return
        for state in checkpoint.get("optimizer_states", []):
            portable_optimizer_state(state, self.prep._saved)
