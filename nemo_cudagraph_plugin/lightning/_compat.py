"""Every use of Lightning internals lives here, behind a version check.

The captured region is exactly Lightning's ``_AutomaticOptimization.run`` for one batch: closure
(training_step, zero_grad, backward), clipping and ``optimizer.step``. Lightning has no public
hook spanning that region, so the runner routes ``run`` on *this trainer's loop instance* (never
the class), mirrors the progress counters a replay skips, and redirects ``LightningModule.log``
on the module instance while a step is recorded. Checked against Lightning 2.4 - 2.6.6; newer
versions run with one warning. The re-emission of a replayed step's logs (:func:`fast_log`) also writes the
two fields torchmetrics' ``Metric.update`` wrapper keeps (``_computed``, ``_update_count``); a test compares the
metric's whole state with Lightning's own update on the installed versions.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.trainer.connectors.logger_connector.result import _get_default_dtype as _default_dtype
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
from packaging.version import Version

from ..core.buffers import flatten
from ..core.warn import check_tested_version

__all__ = [
    "LIGHTNING_VERSION",
    "StepKey",
    "check_lightning_version",
    "automatic_loop",
    "route_step",
    "undivided_loss",
    "around_backward",
    "after_closure",
    "step_key",
    "redirect_log",
    "ProgressDelta",
    "progress_snapshot",
    "restorer",
    "current_fx",
    "fast_log",
    "logged_copy",
    "set_current_fx",
    "rebase_strategy",
    "ddp_finds_unused_parameters",
    "callback_state_key",
]

LIGHTNING_VERSION = Version(pl.__version__.split("+")[0])
_MIN = Version("2.4.0")
_MAX_TESTED = Version("2.6.6")
_UPDATE = _ResultMetric.update  # the class's update; torchmetrics wraps each instance's `update`
_FULL = (torch.float32, torch.float64)  # dtypes _ResultMetric.update keeps as they are


def check_lightning_version() -> None:
    """Refuse Lightning older than 2.4; warn once above the newest version this adapter was tested with."""
    check_tested_version(
        "lightning", LIGHTNING_VERSION, _MIN, _MAX_TESTED,
        "_AutomaticOptimization.run, its progress counters and the logger connector's result collection",
    )


def automatic_loop(trainer: pl.Trainer) -> Any:
    """The trainer's ``_AutomaticOptimization`` loop instance (its ``run`` is the captured region)."""
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    for attr in ("run", "optim_progress", "_skip_backward"):
        if not hasattr(loop, attr):
            raise RuntimeError(
                f"lightning {LIGHTNING_VERSION}: _AutomaticOptimization has no '{attr}'; this version is not supported "
                f"by nemo_cudagraph_plugin (tested {_MIN} - {_MAX_TESTED})."
            )
    return loop


def route_step(loop: Any, run: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[[], None]]:
    """Route this loop instance's ``run`` through ``run``; return (the original run, undo)."""
    original = loop.run
    loop.run = run  # an instance attribute: this trainer only, no class is patched

    def undo() -> None:
        if loop.__dict__.get("run") is run:
            del loop.run

    return original, undo


class _UndividedClosureResult(ClosureResult):
    """Lightning's ``ClosureResult`` except that a floating-point loss is not divided by ``normalize == 1``.

    ``from_training_step_output`` divides the loss by ``accumulate_grad_batches`` also when it is 1: one kernel in the
    forward and one in the backward (``grad / 1``) of every step, two nodes of every captured graph that change no
    bit (``x / 1 == x`` in every floating dtype, NaN and -0.0 included). Any other case (k > 1, a non-floating or
    missing loss, a non-tensor output, and the errors for those) is Lightning's own code.
    """

    @classmethod
    def from_training_step_output(cls, training_step_output: Any, normalize: int = 1) -> ClosureResult:
        if normalize == 1:
            mapping = isinstance(training_step_output, Mapping)
            loss = training_step_output.get("loss") if mapping else training_step_output
            if isinstance(loss, torch.Tensor) and loss.is_floating_point():
                extra = {k: v for k, v in training_step_output.items() if k != "loss"} if mapping else {}
                return cls(loss, extra=extra)
        return super().from_training_step_output(training_step_output, normalize)


def undivided_loss(loop: Any) -> Optional[Callable[[], None]]:
    """Make this loop instance's closure skip the loss's division by ``accumulate_grad_batches == 1``
    (:class:`_UndividedClosureResult`); returns the undo, or ``None`` where the loop builds another result class
    (a subclass of Lightning's, or a Lightning whose loop has none: nothing is changed there)."""
    if getattr(loop, "output_result_cls", None) is not ClosureResult:
        return None
    loop.output_result_cls = _UndividedClosureResult  # an instance attribute: this trainer's loop only

    def undo() -> None:
        if loop.__dict__.get("output_result_cls") is _UndividedClosureResult:
            del loop.output_result_cls

    return undo


class StepKey(NamedTuple):
    """Every Python value Lightning's ``run`` reads that a graph bakes in (part of the graph key).

    ``zero_grad``/``optimizer_step`` pick the accumulation phase; the loss is divided by
    ``accumulate_grad_batches`` inside the closure; ``gradient_clip`` is the clipping value and
    algorithm; ``precision`` selects autocast. A change of any of them selects another graph.
    """

    zero_grad: bool
    optimizer_step: bool
    accumulate_grad_batches: int
    gradient_clip: tuple[Any, Any]
    precision: str


def _around_precision(trainer: pl.Trainer, name: str, around: Callable[..., Any]) -> Callable[[], None]:
    """Route this trainer's ``precision_plugin.<name>`` through ``around(original, *args, **kwargs)``, for this plugin
    instance only (an instance attribute). Returns the undo."""
    precision = trainer.strategy.precision_plugin
    original = getattr(precision, name)

    def routed(*args: Any, **kwargs: Any) -> Any:
        return around(original, *args, **kwargs)

    setattr(precision, name, routed)
    return lambda: precision.__dict__.pop(name, None)


def around_clip_by_norm(trainer: pl.Trainer, around: Callable[..., Any]) -> Callable[[], None]:
    """Route ``precision_plugin.clip_grad_by_norm`` (public; Lightning's clipping by norm) through ``around``."""
    return _around_precision(trainer, "clip_grad_by_norm", around)


def around_clip_gradients(trainer: pl.Trainer, around: Callable[..., Any]) -> Callable[[], None]:
    """Route ``precision_plugin.clip_gradients`` (public; what ``LightningModule.clip_gradients`` calls, by norm or by
    value) through ``around``."""
    return _around_precision(trainer, "clip_gradients", around)


def around_backward(trainer: pl.Trainer, before: Callable[[torch.Tensor], None]) -> Callable[[], None]:
    """Call ``before(loss)`` at the start of this trainer's ``strategy.backward`` (public; every micro-batch, before
    the ``on_before_backward`` hooks), for this strategy instance only. Returns the undo."""
    strategy = trainer.strategy
    original = strategy.backward

    def backward(closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        before(closure_loss)
        return original(closure_loss, *args, **kwargs)

    strategy.backward = backward
    return lambda: strategy.__dict__.pop("backward", None)


def after_closure(trainer: pl.Trainer, after: Callable[[], None]) -> Callable[[], None]:
    """Call ``after()`` when the closure this trainer's ``strategy.optimizer_step`` (public) hands the optimizer
    returns: after backward and DDP's all-reduce, before the ``on_before_optimizer_step`` hooks, clipping and the
    update. For this strategy instance only; returns the undo."""
    strategy = trainer.strategy
    original = strategy.optimizer_step

    def optimizer_step(optimizer: Any, closure: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        def closure_then_after() -> Any:
            out = closure()
            after()
            return out

        return original(optimizer, closure_then_after, *args, **kwargs)

    strategy.optimizer_step = optimizer_step
    return lambda: strategy.__dict__.pop("optimizer_step", None)


def around_batch_transfer(trainer: pl.Trainer, stream: Any) -> Optional[Callable[[], None]]:
    """Copy this trainer's training batches to the GPU on ``stream`` instead of the training stream.

    On the training stream each host-to-device copy of a batch waits for the queued steps and the next step waits
    for it: a few microseconds of device time per tensor, per step. On a stream of its own the copy runs while
    earlier steps still run; the training stream then waits for it (an event, already complete when reached), and
    the copied tensors are marked as used by the training stream so the allocator cannot hand their memory out
    early. Done only where the transfer is Lightning's own (``Strategy.batch_to_device`` and no
    ``transfer_batch_to_device``/``on_after_batch_transfer`` of the module or datamodule): such code may read
    device memory the training stream writes, which a copy on another stream would not wait for. Routes this
    strategy instance's ``batch_to_device`` only; returns the undo, or ``None`` where nothing was routed.
    """
    from lightning.pytorch.strategies import Strategy
    from lightning.pytorch.utilities.model_helpers import is_overridden

    strategy = trainer.strategy
    if type(strategy).batch_to_device is not Strategy.batch_to_device:
        return None
    for obj in (trainer.lightning_module, trainer.datamodule):
        if obj is not None and any(
            is_overridden(h, obj) for h in ("transfer_batch_to_device", "on_after_batch_transfer")
        ):
            return None
    from lightning.pytorch.trainer.states import RunningStage

    original = strategy.batch_to_device
    # The training stream is the one current when the fit starts: Lightning runs every step on it. Switching with
    # set_stream to these two known streams, and one event recorded again per batch, keep the host cost per batch
    # at a few microseconds (a `with torch.cuda.stream(...)` block and wait_stream, which makes an event each call,
    # cost four times that on a host-bound step).
    main = torch.cuda.current_stream(trainer.lightning_module.device)
    copied = torch.cuda.Event()
    training = RunningStage.TRAINING
    set_stream = torch.cuda.set_stream

    def batch_to_device(batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        if trainer.state.stage is not training:  # trainer.training, without its string-enum comparison
            return original(batch, device, dataloader_idx)
        set_stream(stream)
        try:
            out = original(batch, device, dataloader_idx)
        finally:
            set_stream(main)
        copied.record(stream)
        main.wait_event(copied)
        for t in flatten(out)[0]:
            if t.is_cuda:
                t.record_stream(main)
        return out

    strategy.batch_to_device = batch_to_device
    return lambda: strategy.__dict__.pop("batch_to_device", None)


def step_key(trainer: pl.Trainer, loop: Any, batch_idx: int) -> StepKey:
    """The :class:`StepKey` of this batch, decided exactly as ``run`` decides it."""
    k = trainer.accumulate_grad_batches
    zero = (not loop._skip_backward) and batch_idx % k == 0
    # At k == 1 every batch ends an accumulation window, so Lightning's _should_accumulate() is False: not asked
    # (it walks several properties, on a replayed step's host path).
    step = k == 1 or trainer.strategy.handles_gradient_accumulation or not trainer.fit_loop._should_accumulate()
    return StepKey(zero, step, k, (trainer.gradient_clip_val, trainer.gradient_clip_algorithm), str(trainer.precision))


@contextlib.contextmanager
def redirect_log(pl_module: pl.LightningModule, log: Callable[..., None]) -> Iterator[None]:
    """``self.log``/``self.log_dict`` of this module instance call ``log`` inside the block."""
    pl_module.__dict__["log"] = log  # instance attribute; log_dict calls self.log
    try:
        yield
    finally:
        pl_module.__dict__.pop("log", None)


def _int_fields(obj: Any, out: list[tuple[Any, str]]) -> None:
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            _int_fields(v, out)
        elif isinstance(v, int) and not isinstance(v, bool):
            out.append((obj, f.name))


def progress_snapshot(loop: Any) -> list[tuple[Any, str, int]]:
    """Every integer counter of the loop's optimization progress, with its current value."""
    fields: list[tuple[Any, str]] = []
    _int_fields(loop.optim_progress, fields)
    return [(o, n, getattr(o, n)) for o, n in fields]


class ProgressDelta:
    """The counter increments one run of a step made; re-applied after each replay of its graph.

    A replay runs no Python, so Lightning's ``optim_progress`` (which drives ``global_step``)
    would stand still. Computed once per graph at capture; applying it is a few ``setattr``.
    """

    __slots__ = ("incs",)

    def __init__(self, before: list[tuple[Any, str, int]], after: list[tuple[Any, str, int]]) -> None:
        self.incs = [(o, n, a - b) for (o, n, b), (_, _, a) in zip(before, after) if a != b]

    def apply(self) -> None:
        for o, n, d in self.incs:
            setattr(o, n, getattr(o, n) + d)


def restorer(loop: Any, pl_module: pl.LightningModule) -> Callable[[], None]:
    """Snapshot host-side counters; the returned function puts them back."""
    snap = progress_snapshot(loop)
    fx = pl_module._current_fx_name

    def restore() -> None:
        for o, n, v in snap:
            setattr(o, n, v)
        pl_module._current_fx_name = fx

    return restore


def fast_log(trainer: pl.Trainer, fx: str, key: str, value: Any, batch_size: Optional[int]) -> bool:
    """Re-emit a ``self.log(name, value)`` already emitted once in this epoch (``key`` is ``f"{fx}.{name}"``),
    without the checks and device moves ``LightningModule.log`` repeats on every call (about 1 ms of host time per
    call on a slow host, mostly ``_ResultMetric.to``). Does what those calls would do for a registered, unchanged
    metric: ``update_metrics`` with this step's batch size. Returns ``False`` (nothing done) when the slow path is
    needed: first emission, a new epoch's reset, several dataloaders.

    Called only inside a training step (the runner's), so the fit loop's result collection is the active one.
    ``value`` must be a single-element tensor in memory of its own that nothing writes afterwards (the runner hands
    over each replay's copy of the graph's output): a value already in the dtype Lightning keeps is kept as it is,
    without the copy ``LightningModule.log`` makes.
    """
    results = trainer.fit_loop._results  # what `trainer._results` returns while training, without its checks
    if results.dataloader_idx is not None:
        return False
    connector = trainer._logger_connector
    if connector.should_reset_tensors(fx):
        return False
    metric = results.get(key)
    if metric is None or metric.has_reset or metric.compute_on_cpu:
        return False
    batch_size = results._extract_batch_size(metric, batch_size, metric.meta)
    if value.dim():
        value = value.squeeze()  # what LightningModule.log does to a 1-element tensor
    # _ResultCollection.update_metrics -> _ResultMetric.forward -> torchmetrics' update wrapper -> update: the
    # wrapper's bookkeeping is written here and the class's own update is called (the wrapper's grad-mode context
    # is not needed: the value is detached). The same state results (tests/test_lightning_cpu.py,
    # test_fast_log_leaves_the_metric_as_lightnings_update).
    metric._computed = None
    metric._update_count += 1
    meta = metric.meta
    if meta.on_step and not meta.on_epoch and metric.is_tensor and value.is_floating_point():
        # Logged on step only: update() keeps sync(the value in the default dtype, copied) as both the value and
        # the forward cache. The value is a copy already; a bf16 one is converted (one kernel; update launches two).
        dtype = value.dtype if value.dtype in _FULL else _default_dtype()
        metric._forward_cache = metric.value = meta.sync(value.to(dtype))
    else:
        _UPDATE(metric, value, batch_size)
    metric.has_reset = False
    connector._current_fx = fx
    return True


def logged_copy(value: torch.Tensor) -> torch.Tensor:
    """A detached copy of a tensor given to ``self.log``, in the dtype Lightning keeps it in.

    ``_ResultMetric.update`` converts a floating value that is not float32/float64 to the default dtype (float32)
    before anything else reads it, so converting it here, inside the step (one kernel, as a clone is), gives the
    same values and leaves :func:`fast_log` nothing to convert after a replay. Other dtypes are cloned as they are.
    """
    value = value.detach()
    if value.is_floating_point() and value.dtype not in _FULL:
        return value.to(_default_dtype())
    return value.clone()


def current_fx(pl_module: pl.LightningModule) -> Any:
    return pl_module._current_fx_name


def set_current_fx(pl_module: pl.LightningModule, name: Any) -> None:
    pl_module._current_fx_name = name


def rebase_strategy(base: Any, cls: type) -> Any:
    """A new instance of ``cls`` (a subclass of ``type(base)``) carrying ``base``'s configuration.

    Lightning strategies have no copy constructor; their configuration is their instance state.
    """
    from lightning.pytorch.strategies import Strategy

    obj = Strategy.__new__(cls)
    obj.__dict__.update(base.__dict__)
    return obj


def ddp_finds_unused_parameters(strategy: Any) -> bool:
    """Whether a ``DDPStrategy`` was configured with ``find_unused_parameters=True``."""
    return bool(getattr(strategy, "_ddp_kwargs", {}).get("find_unused_parameters"))


def callback_state_key(callback: pl.Callback, **kwargs: Any) -> str:
    """Lightning's ``Callback._generate_state_key`` (checkpoint key of a callback's state)."""
    return callback._generate_state_key(**kwargs)
