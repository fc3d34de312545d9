"""Binds the capture engine to one Lightning ``Trainer`` (shared by the callback and the strategy).

Per training batch Lightning calls ``automatic_optimization.run(optimizer, batch_idx, kwargs)``.
While bound, that call (on this trainer's loop instance only) goes through
:meth:`LightningStepRunner.run`, which hands the engine a step function covering the whole
``run``: training_step, zero_grad, backward, gradient clipping and optimizer.step, and the
step's key (:class:`~._compat.StepKey`: accumulation phase, ``accumulate_grad_batches``,
clipping, precision).

Replayed steps skip Python, so the runner repeats the host-side effects Lightning relies on:
``self.log`` calls made inside the step are re-emitted (:mod:`.logs`) and the optimization
progress counters (``trainer.global_step``) advance as in eager mode. Hyperparameters the optimizer
reads are kept live by a guard before every step; code inside the step that assigns them
(a manual LR warm-up in ``optimizer_step``) is refused at capture with its file:line. Other
Python side effects of hooks inside the step run once, at capture.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from ..core.adam_step import GroupScalarAdam
from ..core.adapter import Guard
from ..core.backend import GraphBackend
from ..core.config import CaptureConfig, CaptureStats
from ..core.engine import CaptureEngine, GraphEntry
from ..core.errors import CaptureError, locate_frames
from ..core.module_state import ModuleStateWatch
from ..core.nan_guard import NanGuard, NanPolicy
from ..core.optim import OptimizerPrep, ParamGroupWatch
from ..core.rng import GeneratorRegistry
from ..hf import (
    EXPERTS_GRAPH_SAFE,
    SDPA_GRAPH_SAFE,
    graph_safe_attention,
    graph_safe_experts,
    restore_attention,
    restore_experts,
)
from . import _compat
from .checks import Refusal, device_refusal, optimizer_refusal, setup_refusal
from .logs import StepLogs

__all__ = ["LightningStepRunner"]

# A hyperparameter a graph bakes in may change a couple of times (a manual change, an LR finder);
# more than this and it is being scheduled, which graphs cannot follow.
_MAX_HP_RECAPTURES = 2
# Module state (dropout p, train/eval, requires_grad) may change now and then (fine-tuning schedules, an
# epoch-wise anneal). Changed again before the graphs captured for it replayed this often, three times in a
# row, it is changed every step or two: graphs cannot pay off.
_RAPID_REPLAYS = 2
_MAX_RAPID_MODULE_CHANGES = 2


class LightningStepRunner:
    """Owns the engine, the optimizer preparation and the NaN guard for one ``fit``.

    It is the engine's adapter (:class:`~nemo_cudagraph_plugin.core.adapter.StepAdapter`): the state the step
    reads and writes, the guards run before every step, the hazard checks around each capture, and what a replay
    must repeat on the host. Everything :meth:`bind` changes on Lightning's objects is undone by :meth:`unbind`
    (one ``ExitStack``).

    Args:
        config: the options.
        stats: counters shared with the owner (``callback.stats``).
        owner: the class the user configured (``"CudaGraphCallback"``/``"CudaGraphStrategy"``),
            used in messages and for owner-specific refusals.
        generators: extra generators to register with every graph.
        backend: device interface of the engine (CUDA unless a test supplies a stand-in).
    """

    def __init__(
        self,
        config: CaptureConfig,
        stats: CaptureStats,
        owner: str = "CudaGraphCallback",
        generators: Optional[GeneratorRegistry] = None,
        backend: Optional[GraphBackend] = None,
    ) -> None:
        self.config = config
        self.stats = stats
        self.owner = owner
        self.generators = generators or GeneratorRegistry()
        self.backend = backend
        self.engine: Optional[CaptureEngine] = None
        self.prep: Optional[OptimizerPrep] = None
        self.fast_adam: Optional[GroupScalarAdam] = None
        #: the NaN guard and its policy (None: nan_guard=False and nothing skipped)
        self.nan: Optional[NanPolicy] = None
        self.logs: Optional[StepLogs] = None
        self.trainer: Any = None
        self.pl_module: Any = None
        self.refused: Optional[Refusal] = None
        self.modules: Optional[ModuleStateWatch] = None
        self._loop: Any = None
        self._orig_run: Optional[Callable] = None
        # What bind() changed on Lightning's and torch's objects, undone in reverse by unbind().
        self._undo = contextlib.ExitStack()
        # The engine adapter's parts (StepAdapter): verify_steps snapshots, hazard checks around each capture.
        self._mutable: list[Callable[[], list[Tensor]]] = []
        self._contexts: list[Callable[[], contextlib.AbstractContextManager]] = []
        self._checks: list[Callable[[], None]] = []
        self._state: Callable[[], list] = lambda: []
        self._steps = 0
        self._grads: list[tuple[Tensor, Tensor]] = []
        self._last_delta: Optional[_compat.ProgressDelta] = None
        self._ddp = False
        self._fresh = False
        self._hp_changes = 0
        self._key: Any = None
        self._rapid = 0
        self._replays_at_change = -_RAPID_REPLAYS
        self._drop_grads: list[Tensor] = []

    @property
    def eager_reason(self) -> Optional[str]:
        """Why this fit trains eagerly (``None`` while graphs are used)."""
        if self.refused is not None:
            return self.refused.message
        return self.engine.disabled_reason if self.engine is not None else None

    # ------------------------------------------------------------------------------------------
    # checks and binding
    # ------------------------------------------------------------------------------------------
    def _refuse(self, refusal: Refusal) -> None:
        """Train eagerly with one warning, or stop with a :class:`CaptureError` (see ``Refusal.soft``)."""
        if refusal.soft or self.config.on_capture_error == "eager":
            self.refused = refusal
            warnings.warn(f"nemo_cudagraph_plugin: training eagerly: {refusal.message}.", stacklevel=3)
            return
        raise CaptureError(
            f"{self.owner}: cannot capture this training step into CUDA graphs: {refusal.message}. "
            "Pass on_capture_error='eager' to train without graphs instead.",
            rule="configuration",
        )

    def check_setup(self, trainer: Any, pl_module: Any) -> None:
        """At ``setup``, on any machine: refusals that need no optimizer and no GPU."""
        check_single_owner(trainer)
        self.refused = None
        why = setup_refusal(self.config, trainer, pl_module, self.owner)
        if why is not None:
            self._refuse(why)

    def bind(self, trainer: Any, pl_module: Any) -> None:
        """Prepare the optimizer and route this trainer's step through the engine (``on_train_start``).

        Raises :class:`CaptureError` (``on_capture_error="raise"``) when the fit cannot be graphed
        for a reason the user must fix; warns once and leaves training eager otherwise.
        """
        _compat.check_lightning_version()
        self.trainer, self.pl_module = trainer, pl_module
        if self.refused is not None:  # refused at setup, already said
            return
        why = setup_refusal(self.config, trainer, pl_module, self.owner) or optimizer_refusal(trainer)
        if why is None and (self.backend is None or self.backend.device_type == "cuda"):
            why = device_refusal(pl_module)
        if why is not None:
            self._refuse(why)
            return
        if self.config.hf_attention == "graph_safe" and (switched := graph_safe_attention(pl_module)):
            self._undo.callback(restore_attention, pl_module, switched)
            rank_zero_info(f"{self.owner}: Hugging Face attention {SDPA_GRAPH_SAFE!r} (SDPA without a host read of "
                           f"the attention mask) for {', '.join(n or type(pl_module).__name__ for n in switched)}"
                           " until the end of fit")
        if self.config.hf_experts == "graph_safe" and (experts := graph_safe_experts(pl_module)):
            self._undo.callback(restore_experts, pl_module, experts)
            rank_zero_info(f"{self.owner}: Hugging Face experts {EXPERTS_GRAPH_SAFE!r} (grouped GEMMs in the autocast "
                           "dtype, offsets on the device) for "
                           f"{', '.join(n or type(pl_module).__name__ for n, _ in experts)} until the end of fit")
        optimizer = trainer.optimizers[0]
        named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        self._ddp = "DDPStrategy" in {c.__name__ for c in type(trainer.strategy).__mro__}
        try:
            self.prep = OptimizerPrep(optimizer, pl_module.device, skip_nonfinite=self.config.nan_skips,
                                      math=self.config.optimizer_math, step_count=lambda: trainer.global_step,
                                      device_type=self.backend.device_type if self.backend is not None else None)
            self.prep.apply()
        except TypeError as exc:
            self.prep = None
            self._refuse(Refusal("optimizer", str(exc).rstrip(".")))
            return
        self._undo.callback(self.prep.restore)
        self.nan = NanPolicy.from_config(self.config, named, pl_module.device, self.stats, one_process=not self._ddp,
                                         step=lambda: trainer.global_step,
                                         checked_at=self.nan.checked_at if self.nan is not None else 0)
        self._loop = _compat.automatic_loop(trainer)
        self.logs = StepLogs(pl_module)
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self._state = lambda: self.prep.state_tensors(names) if self.prep is not None else []
        # verify_steps restores what the eager half wrote; module buffers (BatchNorm statistics) and the NaN
        # guard's accumulators (written by a Triton kernel) are listed because the dispatcher does not see them.
        self._mutable = [lambda: list(pl_module.buffers())]
        if self.guard is not None:
            self._mutable.append(self.guard.state_tensors)
        self.modules = ModuleStateWatch(pl_module)
        watch = ParamGroupWatch(optimizer)
        self._contexts = [lambda: watch]
        self._checks = [lambda: _refuse_group_writes(watch)]
        self.engine = CaptureEngine(self.config, pl_module.device, named, self, generators=self.generators,
                                    stats=self.stats, backend=self.backend)
        # Only an Adam/AdamW is concerned: for other optimizers there is nothing to say (fast_adam is on by default).
        # The user's own update captured (optimizer_math="eager"): fast_adam's capturable update is not concerned.
        self.stats.optimizer_math = self.prep.math_differs
        if self.config.fast_adam and isinstance(optimizer, torch.optim.Adam) and self.prep.user is None:
            self.fast_adam = GroupScalarAdam(optimizer, self.engine.backend.device_type)
            self._contexts.append(self.fast_adam.during_capture)
            if self.fast_adam.reason is not None:  # stats.fast_adam_unused says it after each capture
                rank_zero_info(f"{self.owner}(fast_adam=True): the optimizer's own step is captured: "
                               f"{self.fast_adam.reason}")
        self._install(optimizer, pl_module)

    # ------------------------------------------------------------------------------------------
    # the engine's adapter (core.adapter.StepAdapter)
    # ------------------------------------------------------------------------------------------
    def guards(self) -> list[Guard]:
        return [self._hyperparam_guard, self._module_guard]

    def state_tensors(self) -> list:
        return self._state()

    def watched_tensors(self) -> list[tuple[str, Tensor]]:
        return _watched(self.pl_module)

    def mutable_tensors(self) -> list[Tensor]:
        return [t for fn in self._mutable for t in fn()]

    def host_state(self) -> Callable[[], None]:
        return _compat.restorer(self._loop, self.pl_module)

    def capture_contexts(self) -> list[Callable[[], contextlib.AbstractContextManager]]:
        return self._contexts

    def reference_step(self) -> contextlib.AbstractContextManager:
        """Around the eager half of ``verify_steps``: the user's own optimizer step runs in it."""
        return self.prep.reference_step() if self.prep is not None else contextlib.nullcontext()

    def users_step(self) -> Optional[contextlib.AbstractContextManager]:
        """Where the graphed optimizer math is not the user's: the optimizer with their own settings, for
        ``verify_steps`` to say by how much (``None``: it is theirs)."""
        return self.prep.users_step() if self.prep is not None else None

    def post_capture_checks(self) -> list[Callable[[], None]]:
        return self._checks

    @property
    def guard(self) -> Optional[NanGuard]:
        """The NaN guard's accumulators (``None``: no NaN guard)."""
        return self.nan.guard if self.nan is not None else None

    def _install(self, optimizer: torch.optim.Optimizer, pl_module: Any) -> None:
        undo = self._undo
        self._orig_run, undo_route = _compat.route_step(self._loop, self.run)
        undo.callback(undo_route)
        # Lightning divides the loss by accumulate_grad_batches also when it is 1: two kernels per step, no bit changed.
        undo_divide = _compat.undivided_loss(self._loop)
        if undo_divide is not None:
            undo.callback(undo_divide)

        # Steps that accumulate across batches (accumulate_grad_batches > 1, DDP's bucket views) need
        # gradients at fixed addresses: zero them in place. Steps that do not (fresh_grads) keep
        # zero_grad's own semantics (set_to_none=True leaves unused parameters without a gradient, so
        # the optimizer skips them); their graphs are captured with the gradients set to None.
        orig_zero = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            orig_zero(set_to_none=set_to_none and self._fresh)

        optimizer.zero_grad = zero_grad  # this optimizer instance only
        undo.callback(optimizer.__dict__.pop, "zero_grad", None)
        # Replacing parameters or optimizer state (load_state_dict) invalidates captured addresses.
        undo.callback(optimizer.register_load_state_dict_post_hook(lambda *_: self._mark_dirty(reprep=True)).remove)
        undo.callback(pl_module.register_load_state_dict_post_hook(lambda *_: self._mark_dirty()).remove)
        self._install_te(optimizer, pl_module)
        if self.backend is None and pl_module.device.type == "cuda":
            undo_transfer = _compat.around_batch_transfer(self.trainer, torch.cuda.Stream(pl_module.device))
            if undo_transfer is not None:
                undo.callback(undo_transfer)
        nan = self.nan
        if nan is not None and nan.can_read_clipping_norms:
            # Lightning's own clipping (not a module's configure_gradient_clipping override) computes one norm per
            # gradient: the NaN guard reads those instead of reading every gradient again.
            hook = getattr(pl_module.configure_gradient_clipping, "__func__", None)
            nan.may_defer = hook is pl.LightningModule.configure_gradient_clipping
            undo.callback(_compat.around_clip_by_norm(self.trainer, nan.clip_by_norm))

    def _install_te(self, optimizer: torch.optim.Optimizer, pl_module: Any) -> None:
        """TransformerEngine care: the FP8 transpose refresh for FP8 primary weights, and the graph
        hazards (RNG tracker, ``is_first_microbatch``, delayed scaling) for every model with TE modules."""
        try:
            from ..fp8 import fp8_scaling_state, has_te_modules, install_fp8_refresh, iter_fp8_params
        except ImportError:  # the FP8 module itself failed to import: only fatal if FP8 was required
            if self.config.fp8_refresh is True:
                raise
            return
        try:
            handle = install_fp8_refresh(optimizer, pl_module, mode=self.config.fp8_refresh,
                                         owner=f"{self.owner}(fp8_refresh=True)")
        except ValueError as exc:  # fp8_refresh=True on a model without FP8 parameters
            raise CaptureError(str(exc), rule="configuration") from exc
        if handle is not None:
            self._undo.callback(handle.remove)
        has_fp8 = handle is not None or any(True for _ in iter_fp8_params(pl_module))
        if not (has_fp8 or has_te_modules(pl_module)):
            return
        from ..fp8.hazards import (
            FirstMicrobatchCheck,
            check_delayed_scaling_registered,
            register_rng_generators,
        )

        register_rng_generators(self.generators)
        self._contexts.append(lambda: FirstMicrobatchCheck(pl_module))
        self._checks.append(lambda: check_delayed_scaling_registered(pl_module))
        # TE updates its FP8 scaling state in its own kernels: verify_steps must snapshot it explicitly.
        self._mutable.append(lambda: fp8_scaling_state(pl_module))

    def unbind(self) -> None:
        """Undo everything :meth:`bind` changed, latest first (also after an exception; idempotent)."""
        self._undo.close()
        if self.engine is not None:
            self.engine.note_peak_memory()
            self.engine.cache.clear()  # frees the graphs; stats.graphs keeps the count at the end of fit
        self._orig_run = None

    @property
    def active(self) -> bool:
        return self.engine is not None and self._orig_run is not None

    def count_unbound_step(self) -> None:
        """A batch trained by plain Lightning because this fit was refused: count it with the reason."""
        if self.refused is not None:
            self.stats.count_eager(self.refused.label)

    # ------------------------------------------------------------------------------------------
    # the step (hot path: one replay per call once captured)
    # ------------------------------------------------------------------------------------------
    def run(self, optimizer: torch.optim.Optimizer, batch_idx: int, kwargs: OrderedDict) -> Any:
        """Replacement for ``automatic_optimization.run`` on this trainer."""
        key = _compat.step_key(self.trainer, self._loop, batch_idx)
        orig_run, logs, batch = self._orig_run, self.logs, kwargs.get("batch")
        # Nothing accumulates across steps: the step may own its gradients (not with DDP, whose
        # reducer keeps gradients as views of its buckets).
        self._fresh = fresh = key.zero_grad and key.optimizer_step and key.accumulate_grad_batches == 1 and not self._ddp
        self._key = key  # read by the module-state guard and the NaN guard's clipping check

        def fn(b: Any, quiet: bool = False) -> Any:
            kw = kwargs if b is batch else OrderedDict(kwargs, batch=b)
            return self._recorded(lambda: orig_run(optimizer, batch_idx, kw), quiet)

        out, values, token = self.engine.step(
            batch,
            key,
            fn,
            quiet_fn=lambda b: fn(b, quiet=True),
            fresh_grads=fresh,
        )
        logs.emit(token, values)
        self._steps += 1
        if self.nan is not None:
            self.nan.after_run(self._steps)
        return out

    def _recorded(self, call: Callable[[], Any], quiet: bool) -> Any:
        """Run ``call`` (an eager step or a capture) with logs recorded and counter increments measured."""
        before = _compat.progress_snapshot(self._loop)
        nan = self.nan
        if nan is not None:
            nan.begin_step()
        out, values, token = self.logs.run(call, quiet)
        # What the step's own Python set is the state a capture of it bakes in; changes after this are the user's.
        self.modules.rebase()
        self._last_delta = _compat.ProgressDelta(before, _compat.progress_snapshot(self._loop))
        if nan is not None:
            nan.end_step(out)
        return out, values, token

    def on_capture(self, entry: GraphEntry) -> None:
        """Right after a capture (the engine's adapter)."""
        if self.guard is not None:
            self.guard.after_capture()  # before the first replay
        if self.fast_adam is not None:
            self.stats.fast_adam_unused = self.fast_adam.reason or ""
        if self.prep is not None:
            self.stats.optimizer_math = self.prep.math_differs
        entry.meta["progress"] = self._last_delta
        # Every output is copied into fresh memory after each replay, in one launch: the loss (a user may keep
        # it) and the logged values, which Lightning then keeps without a copy of its own (StepLogs.emit).
        self.logs.keep_last()
        if not entry.out_leaves:
            warnings.warn("training_step returned no loss tensor; nothing is reported per step.", stacklevel=2)
        if not entry.owns_grads:
            # The gradient tensors this graph accumulates into; re-attached if Lightning drops them
            # (on_validation_model_zero_grad sets them to None).
            self._grads = [(p, p.grad) for _, p in self.engine.named_params if p.grad is not None]

    def after_replay(self, entry: GraphEntry) -> None:
        """After every replay (the engine's adapter)."""
        delta = entry.meta.get("progress")
        if delta is not None:
            delta.apply()

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

    def _module_guard(self) -> Optional[str]:
        """Before every step: a module value a graph baked in (``training``, ``Dropout.p``, ``requires_grad``)
        changed since the last step: drop the graphs (they are captured again with the new value)."""
        why = self.modules.changed()
        if why is None:
            if self._drop_grads and self._key.zero_grad:
                self._drop_frozen_grads()
            return None
        engine = self.engine
        trainable = self.modules.trainable
        if list(map(id, (p for _, p in trainable))) != list(map(id, (p for _, p in engine.named_params))):
            self._set_trainable(trainable)
        rapid = self.stats.replays - self._replays_at_change < _RAPID_REPLAYS
        self._rapid = self._rapid + 1 if rapid else 0
        self._replays_at_change = self.stats.replays
        if self._rapid > _MAX_RAPID_MODULE_CHANGES:
            msg = (
                f"module state keeps changing ({why}): a value the captured forward reads as a Python constant "
                "is changed every step or two, and every change needs a new capture. Change it less often (per "
                "epoch), make it a tensor the forward reads (a buffer), or train this model eagerly"
            )
            if self.config.on_capture_error == "raise":
                raise CaptureError(f"{self.owner}: {msg} (on_capture_error='eager').", rule="scheduled-module-state")
            engine.disable(msg)
            return msg
        return f"{why} (a replay runs no Python, so it would keep the captured value)"

    def _set_trainable(self, trainable: list[tuple[str, Tensor]]) -> None:
        """Layers were frozen or unfrozen: capture, own and check the new set of gradients."""
        keep = {id(p) for _, p in trainable}
        # Eager zero_grad(set_to_none=True) leaves a frozen parameter without a gradient, so the optimizer skips
        # it; the in-place zeroing of accumulating steps would keep one. Dropped when the next window starts.
        self._drop_grads = [p for _, p in self.engine.named_params if id(p) not in keep and p.grad is not None]
        if self._drop_grads and self._key is not None and self._key.zero_grad:
            self._drop_frozen_grads()
        self.engine.set_params(trainable)
        if self.nan is not None:
            self.check_nan()  # its slots are the old parameters'
            self.nan.guard.set_params(trainable)

    def _drop_frozen_grads(self) -> None:
        for p in self._drop_grads:
            if not p.requires_grad:
                p.grad = None
        self._drop_grads = []
        self._grads = [(p, g) for p, g in self._grads if p.requires_grad]
        self.engine.dirty = True  # graphs that accumulate into those gradients are stale

    def _mark_dirty(self, reprep: bool = False) -> None:
        if reprep and self.prep is not None:
            self.prep.apply()  # a loaded state may bring float lr / CPU step counters back
        if self.engine is not None:
            self.engine.dirty = True

    def note_loss(self, loss: Tensor) -> None:
        """The loss about to be back-propagated (``on_before_backward``, every micro-batch): what the NaN guard
        watches where nothing mixes the gradients (:class:`~nemo_cudagraph_plugin.core.nan_guard.NanPolicy`)."""
        if self.nan is not None and self.active and self._key is not None:
            self.nan.note_loss(loss, clips=bool(self._key.gradient_clip[0]))

    def observe_grads(self) -> None:
        """Called right before clipping and the optimizer step (inside the captured region): the NaN guard's check
        of this step (:meth:`NanPolicy.before_clip <nemo_cudagraph_plugin.core.nan_guard.NanPolicy.before_clip>`)."""
        if self.nan is None or not self.active:
            return
        self.nan.before_clip(_clips_by_norm(self._key), self.prep.found_inf if self.prep is not None else None)

    def reattach_grads(self) -> None:
        """Lightning frees gradients before validation; give the graphs' gradient buffers back."""
        if self.engine is None:
            return
        for p, g in self._grads:
            if p.grad is None:
                p.grad = g
        self.engine.dirty = True

    def check_nan(self) -> None:
        """Read the NaN guard now (one host sync; epoch and fit end); raise or report."""
        if self.nan is not None:
            self.nan.check()

    def portable_checkpoint(self, checkpoint: dict) -> None:
        """Write floats (not device tensors) for lr/betas into a checkpoint being saved."""
        for state in checkpoint.get("optimizer_states", []):
            self.portable_optimizer_state(state)

    def portable_optimizer_state(self, state: dict) -> dict:
        """An optimizer's ``state_dict`` with float lr/betas and the user's kernel flags, so it loads anywhere (in
        place; also returned)."""
        return self.prep.portable_state(state) if self.prep is not None else state


def check_single_owner(trainer: Any) -> None:
    """One step has one owner: a ``CudaGraphCallback`` and a ``CudaGraphStrategy`` together is an error."""
    owners = [cb for cb in trainer.callbacks if isinstance(getattr(cb, "step_runner", None), LightningStepRunner)]
    if isinstance(getattr(trainer.strategy, "step_runner", None), LightningStepRunner):
        owners.append(trainer.strategy)
    if len(owners) > 1:
        raise ValueError(
            "Both CudaGraphCallback and CudaGraphStrategy are configured; they capture the same step. "
            "Keep one: remove the callback (pass its options to CudaGraphStrategy) or use a plain strategy."
        )


def _clips_by_norm(key: Optional[_compat.StepKey]) -> bool:
    if key is None:
        return False
    val, algo = key.gradient_clip
    return bool(val) and val > 0 and (algo or "norm") == "norm"  # Lightning clips by norm when no algorithm is set


def _watched(pl_module: Any) -> list[tuple[str, Tensor]]:
    """What a graph reads besides the trainable parameters: frozen parameters and buffers."""
    out = [(n, p) for n, p in pl_module.named_parameters() if not p.requires_grad]
    out.extend((f"buffer '{n}'", b) for n, b in pl_module.named_buffers())
    return out


def _refuse_group_writes(watch: ParamGroupWatch) -> None:
    """Code inside the captured step assigned an optimizer hyperparameter: a replay would skip it."""
    if not watch.changes:
        return
    idx, key, old, new, stack = watch.changes[0]
    frame, library = locate_frames(list(stack))
    where = f"{frame.filename}:{frame.lineno}: " if frame is not None else ""
    hook = f"`{frame.name}`" if frame is not None else "code inside the training step"

    def shown(v: Any) -> str:
        return f"{float(v):g}" if isinstance(v, Tensor) and v.numel() == 1 else repr(v)

    raise CaptureError(
        f"{where}{hook} assigns optimizer.param_groups[{idx}][{key!r}] ({shown(old)} -> {shown(new)}) inside the "
        "captured training step"
        + (" (library code)" if library else "")
        + ". A CUDA graph replay runs no Python, so every replay would use the value of the capture step and "
        "training would silently differ from eager. Move this into an LR scheduler returned by "
        "configure_optimizers (e.g. torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / "
        "warmup_steps)) with interval='step'): schedulers run outside the graph and update the learning rate the "
        "graph reads. Or pass on_capture_error='eager' to train this model without graphs.",
        rule="hyperparameter-in-step",
        location=f"{frame.filename}:{frame.lineno}" if frame is not None else None,
    )
