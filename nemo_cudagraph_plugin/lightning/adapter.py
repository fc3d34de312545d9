"""The engine's adapter for a Lightning training step: the step's state, its guards and what a replay repeats.

:class:`LightningStepAdapter` is what :class:`~nemo_cudagraph_plugin.core.engine.CaptureEngine` calls
(:class:`~nemo_cudagraph_plugin.core.adapter.StepAdapter`). It owns the engine and everything the step reads or
writes on the model and the optimizer: the optimizer preparation and ``fast_adam``, the gradients the graphs own,
the hyperparameter and module-state guards, the NaN guard, the FP8 refresh and TransformerEngine hazard checks, the
``self.log`` records and the progress counters a replay repeats. It is built at ``on_train_start`` by the binding
(:class:`~.runner.LightningStepRunner`), which hands it the model, the optimizer and the loop once and then calls
:meth:`LightningStepAdapter.step` per batch; it touches Lightning's objects only through :mod:`._compat`. Everything
it changed on the model and the optimizer is undone by :meth:`LightningStepAdapter.close`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

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
from ..core.optim import OptimizerPrep, ParamGroupWatch, zero_grads_in_place
from ..core.partial import PartialGraphs
from ..core.rng import GeneratorRegistry
from . import _compat
from .logs import StepLogs

__all__ = ["InStepPoints", "LightningStepAdapter", "OptimizerNotPrepared"]

# A hyperparameter a graph bakes in may change a couple of times (a manual change, an LR finder);
# more than this and it is being scheduled, which graphs cannot follow.
_MAX_HP_RECAPTURES = 2
# Module state (dropout p, train/eval, requires_grad) may change now and then (fine-tuning schedules, an
# epoch-wise anneal). Changed again before the graphs captured for it replayed this often, three times in a
# row, it is changed every step or two: graphs cannot pay off.
_RAPID_REPLAYS = 2
_MAX_RAPID_MODULE_CHANGES = 2


class OptimizerNotPrepared(Exception):
    """The optimizer cannot be prepared for capture (the message says why); nothing was changed."""


class InStepPoints(NamedTuple):
    """Where the NaN guard acts inside Lightning's step; the binding routes each point here once, at bind.

    Attributes:
        before_backward: called with the loss about to be back-propagated (every micro-batch).
        after_backward: called after the closure (backward, the DDP all-reduce), before the
            ``on_before_optimizer_step`` hooks, clipping and the update.
        around_clip_by_norm: ``(clip, *args, **kwargs)`` around Lightning's own clipping by norm, whose norms stand
            in for the gradient read; ``None``: the clipping is not read.
    """

    before_backward: Callable[[Tensor], None]
    after_backward: Callable[[], None]
    around_clip_by_norm: Optional[Callable[..., Any]]


class LightningStepAdapter:
    """The engine's adapter for one bound ``fit`` (:class:`~nemo_cudagraph_plugin.core.adapter.StepAdapter`).

    Args:
        config: the options.
        stats: counters shared with the owner (``callback.stats``).
        pl_module: the LightningModule being trained.
        optimizer: its one optimizer.
        loop: this trainer's automatic-optimization loop (its progress counters are repeated after replays).
        owner: the class the user configured, used in messages.
        shares_grads: the gradients are views of a reducer's buckets (DDP): they stay at fixed addresses.
        global_step: the trainer's optimizer-step counter.
        default_clipping: the module keeps Lightning's own ``configure_gradient_clipping`` (the NaN guard may read
            its norms).
        generators: extra generators registered with every graph.
        backend: device interface of the engine (CUDA unless a test supplies a stand-in).
        nan_checked_at: ``global_step`` at the last NaN read of an earlier fit with the same owner.

    Raises:
        OptimizerNotPrepared: the optimizer cannot be prepared for capture (the binding turns it into a refusal).
    """

    def __init__(
        self,
        config: CaptureConfig,
        stats: CaptureStats,
        pl_module: Any,
        optimizer: torch.optim.Optimizer,
        loop: Any,
        *,
        owner: str,
        shares_grads: bool,
        global_step: Callable[[], int],
        default_clipping: bool,
        generators: GeneratorRegistry,
        backend: Optional[GraphBackend] = None,
        nan_checked_at: int = 0,
    ) -> None:
        self.config, self.stats, self.owner = config, stats, owner
        self.pl_module, self._loop, self._ddp = pl_module, loop, shares_grads
        self._default_clipping = default_clipping
        self.generators = generators
        # What this adapter changed on the model and the optimizer, undone in reverse by close().
        self._undo = contextlib.ExitStack()
        self._steps = 0
        self._grads: list[tuple[Tensor, Tensor]] = []
        self._last_delta: Optional[_compat.ProgressDelta] = None
        self._fresh = False
        self._hp_changes = 0
        self._key: Any = None
        self._rapid = 0
        self._replays_at_change = -_RAPID_REPLAYS
        self._drop_grads: list[Tensor] = []
        self.fast_adam: Optional[GroupScalarAdam] = None
        named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        device_type = backend.device_type if backend is not None else None
        try:
            self.prep = OptimizerPrep(optimizer, pl_module.device, skip_nonfinite=config.nan_skips,
                                      math=config.optimizer_math, step_count=global_step, device_type=device_type,
                                      before_update=self._sync_in_step)
            self.prep.apply()
        except TypeError as exc:  # only the preparation's TypeError is a refusal, not one of the code below
            raise OptimizerNotPrepared(str(exc)) from exc
        self._undo.callback(self.prep.restore)
        try:
            #: the NaN guard and its policy (None: nan_guard=False and nothing skipped)
            self.nan: Optional[NanPolicy] = NanPolicy.from_config(
                config, named, pl_module.device, stats, one_process=not shares_grads, step=global_step,
                checked_at=nan_checked_at, framework_clipping=default_clipping)
            self.logs = StepLogs(pl_module)
            names = {id(p): n for n, p in pl_module.named_parameters()}
            self._state: Callable[[], list] = lambda: self.prep.state_tensors(names)
            # verify_steps restores what the eager half wrote; module buffers (BatchNorm statistics) and the NaN
            # guard's accumulators (written by a Triton kernel) are listed because the dispatcher does not see them.
            self._mutable: list[Callable[[], list[Tensor]]] = [lambda: list(pl_module.buffers())]
            if self.guard is not None:
                self._mutable.append(self.guard.state_tensors)
            self.modules = ModuleStateWatch(pl_module)
            watch = ParamGroupWatch(optimizer)
            self._contexts: list[Callable[[], contextlib.AbstractContextManager]] = [lambda: watch]
            self._checks: list[Callable[[], None]] = [lambda: _refuse_group_writes(watch)]
            self.engine = CaptureEngine(config, pl_module.device, named, self, generators=generators, stats=stats,
                                        backend=backend)
            # Only an Adam/AdamW is concerned: for other optimizers there is nothing to say (fast_adam is on by
            # default). The user's own update captured (optimizer_math="eager"): fast_adam's capturable update is not
            # concerned.
            self.stats.optimizer_math = self.prep.math_differs
            if self.config.fast_adam and isinstance(optimizer, torch.optim.Adam) and self.prep.user is None:
                self.fast_adam = GroupScalarAdam(optimizer, self.engine.backend.device_type)
                self._contexts.append(self.fast_adam.during_capture)
                if self.fast_adam.reason is not None:  # stats.fast_adam_unused says it after each capture
                    rank_zero_info(f"{self.owner}(fast_adam=True): the optimizer's own step is captured: "
                                   f"{self.fast_adam.reason}")
            self._own_grads(optimizer, pl_module)
            # TransformerEngine modules or FP8 weights: their hazard checks cover whole steps only
            self._te = self._watch_te(optimizer, pl_module)
        except BaseException:
            self._undo.close()
            raise
        #: where the binding routes Lightning's step to the NaN guard (``None``: no NaN guard, nothing routed)
        self.in_step: Optional[InStepPoints] = None
        if self.nan is not None:
            self.in_step = InStepPoints(self._before_backward, self._after_backward,
                                        self.nan.clip_by_norm if self.nan.may_defer else None)
        #: the partial tier (scope="modules", or "auto" once the whole step did not capture); None: whole steps
        self.partial: Optional[PartialGraphs] = None
        if config.scope == "modules":
            self.start_partial(None)
        elif config.scope == "auto" and not self._ddp and not self._te:
            # under DDP and with TransformerEngine "auto" is "step" (checks.setup_refusal: not proven there)
            self.engine.fallback = self.start_partial

    def start_partial(self, err: Optional[CaptureError]) -> None:
        """From the next step on, graph the submodules that capture around eager steps (the engine hands over, and
        verifies the tier's first steps whose graphs all replay where ``verify_steps`` asks): ``scope="modules"`` from
        the start (``err`` None), ``"auto"`` when the whole step's capture failed."""
        if err is None:
            reason = "scope='modules'"
            rank_zero_info(f"{self.owner}(scope='modules'): the forward and backward of the submodules that capture "
                           "and the optimizer side of the step are graphed after the warm-up; the rest of each step "
                           "runs eagerly (stats.partial)")
        else:
            reason = f"the whole step does not capture: {str(err).splitlines()[0]}"
            warnings.warn(f"{self.owner}(scope='auto'): {reason}. Training with partial graphs from the next step: "
                          "the submodules that capture are graphed, the rest runs eagerly (stats.partial).",
                          stacklevel=2)
        # fast_adam's scalar update is a context of whole-step captures; here the prepared optimizer's own is graphed.
        self.fast_adam = None
        self._grads = []
        # After the whole-step tier's warm-up (scope="auto") one eager step is enough to find the modules.
        self.partial = PartialGraphs(self.pl_module, self.config, self.pl_module.device, backend=self.engine.backend,
                                     generators=self.generators, stats=self.stats,
                                     warmup_steps=None if err is None else 1)
        self._undo.callback(self.partial.close)
        # verify_steps: the tier's first steps whose graphs all replay are also run eagerly, with its graphs set aside
        self.engine.hand_over(reason, self.partial)
        named = self.engine.named_params
        names = {id(p): n for n, p in self.pl_module.named_parameters()}
        self.partial.graph_optimizer(
            self.prep.optimizer, list(named),
            lambda: [*named, *((f"{n}.grad", p.grad) for n, p in named if p.grad is not None),
                     *self.prep.state_tensors(names)],
            on_capture=self._keep_partial_grads, before_update=self._sync_in_step)

    def _keep_partial_grads(self) -> None:
        """The gradients the optimizer's graph reads (zeroed in place in this tier); given back after Lightning
        frees them before validation (:meth:`reattach_grads`)."""
        self._grads = [(p, p.grad) for _, p in self.engine.named_params if p.grad is not None]

    def around_clip_gradients(self, clip: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Lightning's gradient clipping (``precision_plugin.clip_gradients``), routed here at bind where partial
        graphs may run: in a graphed step of that tier, with Lightning's own ``configure_gradient_clipping`` (nothing
        of yours runs between the clipping and the update), it becomes the first part of the optimizer's graph."""
        if self.partial is not None:
            self.partial.grads.drop_untouched()  # the window's backward is done: clip what eager would clip
        opt = self.partial.optimizer if self.partial is not None else None
        if opt is not None and self._default_clipping and opt.defer(clip, *args, **kwargs):
            return None
        return clip(*args, **kwargs)

    def _own_grads(self, optimizer: torch.optim.Optimizer, pl_module: Any) -> None:
        # Steps that accumulate across batches (accumulate_grad_batches > 1, DDP's bucket views) need
        # gradients at fixed addresses: zero them in place. Steps that do not (fresh_grads) keep
        # zero_grad's own semantics (set_to_none=True leaves unused parameters without a gradient, so
        # the optimizer skips them); their graphs are captured with the gradients set to None.
        orig_zero = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            if set_to_none and self._fresh:
                orig_zero(set_to_none=True)
                return
            grads = self.partial.grads if self.partial is not None else None
            if grads is not None:
                grads.restore()  # what the last window left without a gradient is zeroed with the rest
            zeroed = zero_grads_in_place(optimizer)  # one multi-tensor zero, not a kernel per gradient
            if zeroed is None:
                orig_zero(set_to_none=False)
            elif grads is not None:
                # partial graphs: a gradient this window gives nothing is None again before the update, as here
                grads.begin_window(zeroed if set_to_none else [])

        undo = self._undo
        optimizer.zero_grad = zero_grad  # this optimizer instance only
        undo.callback(optimizer.__dict__.pop, "zero_grad", None)
        # Replacing parameters or optimizer state (load_state_dict) invalidates captured addresses.
        undo.callback(optimizer.register_load_state_dict_post_hook(lambda *_: self._mark_dirty(reprep=True)).remove)
        undo.callback(pl_module.register_load_state_dict_post_hook(lambda *_: self._mark_dirty()).remove)

    def _watch_te(self, optimizer: torch.optim.Optimizer, pl_module: Any) -> bool:
        """TransformerEngine care: the FP8 transpose refresh for FP8 primary weights, and the graph
        hazards (RNG tracker, ``is_first_microbatch``, delayed scaling) for every model with TE modules.
        Returns whether the model has TE modules or FP8 weights."""
        try:
            from ..fp8 import fp8_scaling_state, has_te_modules, install_fp8_refresh, iter_fp8_params
        except ImportError:  # the FP8 module itself failed to import: only fatal if FP8 was required
            if self.config.fp8_refresh is True:
                raise
            return False
        try:
            handle = install_fp8_refresh(optimizer, pl_module, mode=self.config.fp8_refresh,
                                         owner=f"{self.owner}(fp8_refresh=True)")
        except ValueError as exc:  # fp8_refresh=True on a model without FP8 parameters
            raise CaptureError(str(exc), rule="configuration") from exc
        if handle is not None:
            self._undo.callback(handle.remove)
        has_fp8 = handle is not None or any(True for _ in iter_fp8_params(pl_module))
        if not (has_fp8 or has_te_modules(pl_module)):
            return False
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
        return True

    def close(self) -> None:
        """Undo everything this adapter changed, latest first, and free the graphs (idempotent)."""
        self._undo.close()
        self.engine.note_peak_memory()
        self.engine.cache.clear()  # frees the graphs; stats.graphs keeps the count at the end of fit

    # ------------------------------------------------------------------------------------------
    # the step (hot path: one replay per call once captured)
    # ------------------------------------------------------------------------------------------
    def step(self, key: _compat.StepKey, batch: Any, call: Callable[[Any], Any]) -> Any:
        """One batch through the engine: ``call(batch)`` runs Lightning's original step on ``batch``."""
        # Nothing accumulates across steps: the step may own its gradients (not with DDP, whose
        # reducer keeps gradients as views of its buckets).
        # The partial tier zeroes gradients in place: the optimizer's graph reads them where they are.
        partial = self.partial
        self._fresh = fresh = (key.zero_grad and key.optimizer_step and key.accumulate_grad_batches == 1
                               and not self._ddp and partial is None)
        self._key = key  # read by the module-state guard and the NaN guard's points

        def fn(b: Any, quiet: bool = False) -> Any:
            return self._recorded(lambda: call(b), quiet)

        if partial is not None and partial.optimizer is not None:
            partial.optimizer.follow()
        with partial.step() if partial is not None else contextlib.nullcontext():
            out, values, token = self.engine.step(
                batch,
                key,
                fn,
                quiet_fn=lambda b: fn(b, quiet=True),
                fresh_grads=fresh,
            )
        self.logs.emit(token, values)
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

    def _before_backward(self, loss: Tensor) -> None:
        """The loss about to be back-propagated (every micro-batch): what the NaN guard watches where nothing mixes
        the gradients (:class:`~nemo_cudagraph_plugin.core.nan_guard.NanPolicy`)."""
        self.nan.note_loss(loss, clips=bool(self._key.gradient_clip[0]))

    def _after_backward(self) -> None:
        """Right before clipping and the optimizer step (inside the captured region): the NaN guard's check of this
        step (:meth:`NanPolicy.before_clip <nemo_cudagraph_plugin.core.nan_guard.NanPolicy.before_clip>`); before
        clipping, so a NaN is attributed to its parameter, not smeared by the clip factor."""
        self.nan.before_clip(_clips_by_norm(self._key), self.prep.found_inf)

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
        return self.prep.reference_step()

    def users_step(self) -> Optional[contextlib.AbstractContextManager]:
        """Where the graphed optimizer math is not the user's: the optimizer with their own settings, for
        ``verify_steps`` to say by how much (``None``: it is theirs)."""
        return self.prep.users_step()

    def post_capture_checks(self) -> list[Callable[[], None]]:
        return self._checks

    @property
    def guard(self) -> Optional[NanGuard]:
        """The NaN guard's accumulators (``None``: no NaN guard)."""
        return self.nan.guard if self.nan is not None else None

    def on_capture(self, entry: GraphEntry) -> None:
        """Right after a capture (the engine's adapter)."""
        if self.guard is not None:
            self.guard.after_capture()  # before the first replay
        if self.fast_adam is not None:
            self.stats.fast_adam_unused = self.fast_adam.reason or ""
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
        changed = self.prep.sync_hyperparams()
        if changed is None:
            return None
        self.prep.freeze_scalars()
        opt_graph = self.partial.optimizer if self.partial is not None else None
        if opt_graph is not None:
            opt_graph.invalidate()
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
            if opt_graph is not None:
                opt_graph.disable(msg)
                return None
            self.engine.disable(msg)
            return msg
        return f"optimizer hyperparameter changed ({changed}); it is baked into the graph as a constant"

    def _sync_in_step(self) -> None:
        """Before an update that runs eagerly or replays on its own (the partial tier's optimizer graph), after the
        step's code ran up to it: what that code assigned (an lr set in ``optimizer_step``) reaches the values the
        update reads, as in eager training. Whole-step graphs refuse such an assignment at capture
        (``_refuse_group_writes``): their replays run no Python."""
        reason = self._hyperparam_guard()
        if reason is not None:
            self.engine.invalidate(reason)

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
        # (the partial tier re-captures its modules itself; no whole-step graph replays there to count)
        rapid = self.partial is None and self.stats.replays - self._replays_at_change < _RAPID_REPLAYS
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
        if reprep and self.prep.applied:
            self.prep.apply()  # a loaded state may bring float lr / CPU step counters back
        self.engine.dirty = True
        if self.partial is not None and self.partial.optimizer is not None:
            self.partial.optimizer.dirty = True

    def reattach_grads(self) -> None:
        """Lightning frees gradients before validation; give the graphs' gradient buffers back."""
        for p, g in self._grads:
            if p.grad is None:
                p.grad = g
        self.engine.dirty = True

    def check_nan(self) -> None:
        """Read the NaN guard now (one host sync; epoch and fit end); raise or report."""
        if self.nan is not None:
            self.nan.check()

    @property
    def nan_checked_at(self) -> int:
        """``global_step`` at the last NaN read (a later fit's first report window starts there)."""
        return self.nan.checked_at if self.nan is not None else 0

    def portable_state(self, state: dict) -> dict:
        """An optimizer's ``state_dict`` with float lr/betas and the user's kernel flags, so it loads anywhere (in
        place; also returned)."""
        return self.prep.portable_state(state)


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
