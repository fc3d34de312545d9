"""Device-side NaN/Inf detection that never syncs the host inside a step.

Inside the captured step the guard only *adds* into device accumulators: the loss into one
scalar, and for each parameter the number of non-finite elements of its gradient into one slot
of a vector. NaN and Inf propagate through the loss sum and any non-finite gradient element makes
its slot non-zero, so after N steps the accumulators say whether (and where) a step went bad.
Per step this is one kernel for the loss and, for the gradients, one launch of
:class:`~.finite.FiniteCheck` (one read of every gradient; a ``_foreach_norm`` fallback without
Triton). The accumulators are allocated once, outside every graph.

**Reusing the clipping norms.** Gradient clipping by norm already reads every gradient and computes one norm per
gradient, and a norm is finite exactly when its gradient is (an overflow of the sum of squares also counts as
non-finite). Inside the clipping call :meth:`NanGuard.norm_tap` collects those per-parameter norms and adds one
mark per non-finite gradient into its slot: four small kernels on a vector of norms instead of a second read of
every gradient. The norms are taken before the clip factor multiplies the gradients, so a NaN is still attributed
to its own parameter; and only the first step of a read window with a non-finite norm marks, because that step's
NaN clip factor spoils every parameter and every later step's norms are non-finite too.

**Watching the loss instead of reading the gradients.** Where nothing mixes the gradients (no clipping, no
accumulation across processes), a non-finite gradient leaves a non-finite value in its own parameter after the update
(``p - lr * NaN``; Adam's ``inf / sqrt(inf)``), and the next forward that uses it gives a non-finite loss, after which
every gradient and parameter goes bad. So such a step reads no gradient: :meth:`NanGuard.watch_loss`, before the
step's backward, adds the loss into its accumulator and, at the *first* non-finite loss of a read window only, counts
the non-finite values of every parameter into its slot (one kernel per step, whose programs return at once while the
loss is finite). That names the parameters the bad gradient spoiled, not the ones spoiled after them. A parameter
whose bad value never reaches a loss is found by the read: a read in a window without a non-finite loss scans the
parameters. A loss that goes non-finite first (an overflow in the forward, a bad term of the loss) finds every
parameter finite; the parameters are then counted once more at the next step, which names what that step's update
spoiled (every parameter after an overflow; one after a term on one parameter). Training is not changed: no update
is skipped.

Reading them does not sync either: every ``check_every`` steps :meth:`NanGuard.snapshot` queues a copy
into pinned host memory and clears them, in stream order; :meth:`NanGuard.poll` reads that copy once
the GPU has written it (an event query, no wait), usually a step or two later, and only then maps a bad
slot to its parameter's name. At epoch and fit end :meth:`NanGuard.check` reads synchronously.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from ._torch_compat import FOREACH_NORM, ObservingMode
from .errors import NonFiniteError
from .finite import FiniteCheck, arm, capturing, table_length

if TYPE_CHECKING:
    from .config import CaptureConfig

__all__ = ["NanGuard", "NanPolicy"]

# Checks kept for gradient sets seen only in eager steps (a graph's checks are never dropped).
_MAX_EAGER_CHECKS = 8


def _copied(device: torch.device) -> Any:
    """An event marking the queued host copy as written (``None`` on a CPU device: written already)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class NanGuard:
    """Accumulate on the device; report on demand.

    Args:
        named_params: ``(name, parameter)`` pairs whose gradients are checked, in report order.
        device: where the accumulators live.
        mode: ``"loss"`` (loss only) or ``"full"`` (also every gradient, before clipping).
    """

    def __init__(self, named_params: Sequence[tuple[str, Tensor]], device: torch.device, mode: str = "full") -> None:
        if mode not in ("loss", "full"):
            raise ValueError("NanGuard mode must be 'loss' or 'full'")
        self.mode = mode
        self.names = [n for n, p in named_params if p.requires_grad]
        self.params = [p for _, p in named_params if p.requires_grad]
        self.device = device
        # Allocated here, outside any graph pool, so every graph and eager step writes the same memory.
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.grad_bad = torch.zeros(len(self.params), dtype=torch.float32, device=device)
        self.skipped = torch.zeros((), dtype=torch.float32, device=device)
        self._step_bad = torch.zeros((), dtype=torch.float32, device=device)
        # One check per set of gradient tensors (their addresses): graphs that own their gradients have
        # their own. Checks a graph launched stay (the graph reads their tables); eager-only ones are bounded.
        self._checks: dict[tuple[tuple[int, int], ...], FiniteCheck] = {}
        self._in_graph: set[tuple[tuple[int, int], ...]] = set()
        # Metadata memory for the next check built during a capture, allocated in an eager step (outside any graph
        # pool; every capture follows an eager warm-up of its key) and written after that capture.
        self._table_len = table_length([p.numel() for p in self.params])
        self._spare: Optional[Tensor] = None
        self._pending: list[FiniteCheck] = []
        # The queued host read (snapshot): pinned host copy of [loss_sum, skipped, grad_bad...], its event, window.
        self._read: Optional[tuple[Tensor, Any, str]] = None
        self._stage: Optional[Tensor] = None
        self._host: Optional[Tensor] = None
        self._skipped_host = 0
        # Set once a step read no gradient (watch_loss()): every read scans the parameters first.
        self.scan_params = False
        self._param_check: Optional[tuple[Any, FiniteCheck, Tensor]] = None
        self._nan: Optional[Tensor] = None  # what a read hands the watch kernel: "scan if still armed"
        self._scratch: Optional[Tensor] = None

    def set_params(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        """Check these parameters from now on (the trainable set changed; graphs using the old checks are
        gone). Read the accumulators first (:meth:`check`): their slots are of the old parameters."""
        if self._read is not None:
            raise RuntimeError("NanGuard.set_params: read the queued snapshot first (check())")
        self.names = [n for n, p in named_params if p.requires_grad]
        self.params = [p for _, p in named_params if p.requires_grad]
        self.grad_bad = torch.zeros(len(self.params), dtype=torch.float32, device=self.device)
        self._checks.clear()
        self._in_graph.clear()
        self._pending.clear()
        self._table_len = table_length([p.numel() for p in self.params])
        self._spare = self._stage = self._host = None
        self._param_check = None

    def norm_tap(self) -> _NormTap:
        """A context around gradient clipping: the per-parameter norms it computes mark the non-finite gradients.

        After the block, ``tap.covered`` says whether every gradient got a norm (and the marks were added); if not,
        nothing was added and :meth:`observe_grads` must check the gradients.
        """
        return _NormTap(self)

    def observe_loss(self, loss: Tensor) -> None:
        """Add the loss into the accumulator (one kernel; safe inside capture)."""
        self.loss_sum.add_(loss.detach().reshape(()))

    def observe_grads(self, found_inf: Optional[Tensor] = None) -> None:
        """Add each gradient's number of NaN/Inf elements into its slot (``mode="full"``; device ops only).

        If ``found_inf`` is given (``nan_action="skip"``) it is set to 1.0 when any gradient is
        non-finite, so that a fused optimizer skips this update on the device.
        """
        if self.mode != "full" and found_inf is None:
            return
        grads = [p.grad for p in self.params]
        key = tuple((i, g.data_ptr()) for i, g in enumerate(grads) if g is not None)
        if not key:
            return
        check = self._checks.get(key)
        in_capture = capturing(self.device)
        if check is None:
            if not in_capture and len(self._checks) - len(self._in_graph) >= _MAX_EAGER_CHECKS:
                # Eager steps that re-allocate gradients (zero_grad(set_to_none=True)) may see new addresses.
                old = next(k for k in self._checks if k not in self._in_graph)
                del self._checks[old]
            table = self._spare if in_capture else None
            check = self._checks[key] = FiniteCheck([grads[i] for i, _ in key], [i for i, _ in key], table=table)
            if table is not None:
                self._spare = None
                self._pending.append(check)
        if in_capture:
            self._in_graph.add(key)
        elif self._spare is None and self.device.type == "cuda":
            self._spare = torch.empty(self._table_len, dtype=torch.int64, device=self.device)
        if found_inf is None:
            check.run(self.grad_bad)
            return
        self._step_bad.zero_()
        check.run(self.grad_bad, self._step_bad)
        bad = self._step_bad > 0
        found_inf.copy_(bad.to(found_inf.dtype).reshape(found_inf.shape))
        self.skipped.add_(bad)

    def watch_loss(self, loss: Tensor) -> None:
        """Before the step's backward (so before its optimizer update): add ``loss`` into the accumulator (in place of
        :meth:`observe_loss` for this step) and, at the first non-finite loss of the read window, count the
        non-finite values of every parameter into its slot (module docstring). One kernel; device work only.
        A step watched this way may read no gradient: set :attr:`scan_params` (reads then scan the parameters)."""
        loss = loss.detach()
        check, state = self._param_watch(loss)
        check.watch(self.grad_bad, loss, self.loss_sum, state)

    def _param_watch(self, loss: Optional[Tensor] = None) -> tuple[FiniteCheck, Tensor]:
        """The check over the parameters (rebuilt when one was re-allocated) and its watch state. Built in an eager
        step (every capture follows one), so its memory is outside every graph pool."""
        ptrs = tuple(p.data_ptr() for p in self.params)
        cur = self._param_check
        # A read (no loss) uses the watch the steps use, whichever kind: its stage says whether it fired.
        triton = (cur[0][1] if cur is not None and cur[0][0] == ptrs else True) if loss is None else FiniteCheck.can_watch(loss)
        if cur is None or cur[0] != (ptrs, triton):
            check = FiniteCheck(self.params, list(range(len(self.params))), use_triton=None if triton else False)
            cur = self._param_check = ((ptrs, triton), check, check.watch_state())
        return cur[1], cur[2]

    def _scan(self) -> None:
        """At a read: if no non-finite loss was watched in this window (or its second count is due), add each
        parameter's number of non-finite elements into its slot (a bad value that never reached a loss). After one
        was, the watch's count stands: by now the bad value has spread to every parameter. Decided on the device
        (the watch kernel handed a NaN loss), no sync."""
        check, state = self._param_watch()
        if self._nan is None:
            self._nan = torch.full((), float("nan"), dtype=torch.float32, device=self.device)
            self._scratch = torch.zeros((), dtype=torch.float32, device=self.device)
        check.watch(self.grad_bad, self._nan, self._scratch, state)

    def after_capture(self) -> None:
        """Write the metadata of the checks built during the capture that just ended (before its first replay)."""
        for check in self._pending:
            check.fill()
        self._pending.clear()

    def state_tensors(self) -> list[Tensor]:
        """The accumulators (a verification run restores them: the Triton kernel bypasses torch's dispatcher)."""
        watch = [self._param_check[2]] if self._param_check is not None else []
        return [self.loss_sum, self.grad_bad, self.skipped, self._step_bad, *watch]

    # -- host side ---------------------------------------------------------------------------
    @property
    def read_pending(self) -> bool:
        """A snapshot was queued and not yet read (call :meth:`poll`)."""
        return self._read is not None

    def snapshot(self, window: str = "") -> None:
        """Queue a read of the accumulators for ``window`` and clear them (device work and an event: no host sync).

        The previous snapshot, if still unread, is read first (its steps ended long ago: no wait in practice).
        On a CPU device the copy is complete at once: :meth:`poll` reports it immediately.
        """
        if self._read is not None:
            self._wait_and_take()
        if self.scan_params:
            self._scan()
        n = 2 + len(self.params)
        if self._stage is None:
            self._stage = torch.empty(n, dtype=torch.float32, device=self.device)
            cuda = self.device.type == "cuda"
            self._host = torch.empty(n, dtype=torch.float32, pin_memory=cuda)
        stage, host = self._stage, self._host
        stage[0].copy_(self.loss_sum)
        stage[1].copy_(self.skipped)
        stage[2:].copy_(self.grad_bad)
        host.copy_(stage, non_blocking=True)  # pinned: queued, no sync
        event = _copied(self.device)
        self.reset()  # in stream order after the copy: the next window starts from zero
        self._read = (host, event, window)

    def poll(self, raise_on_bad: bool = True) -> Optional[str]:
        """Read the queued snapshot if the GPU has written it (no wait); like :meth:`check` otherwise.

        Returns ``None`` when nothing is ready or everything was finite.
        """
        if self._read is None or (self._read[1] is not None and not self._read[1].query()):
            return None
        return self._wait_and_take(raise_on_bad, written=True)

    def _wait_and_take(self, raise_on_bad: bool = True, written: bool = False) -> Optional[str]:
        host, event, window = self._read
        self._read = None
        if event is not None and not written:
            event.synchronize()
        vals = host.tolist()
        self._skipped_host = int(vals[1])
        return self._report(vals[0], vals[2:], raise_on_bad, window)

    def check(self, raise_on_bad: bool = True, window: str = "") -> Optional[str]:
        """Read the accumulators now (one host sync); raise :class:`NonFiniteError` or return a report.

        A queued snapshot is read first. Returns ``None`` when everything was finite. With
        ``raise_on_bad=False`` (skip mode) the report is returned and the accumulators are cleared.
        """
        first = self._wait_and_take(raise_on_bad) if self._read is not None else None
        if self.scan_params:
            self._scan()
        vals = torch.cat([self.loss_sum.reshape(1), self.skipped.reshape(1), self.grad_bad]).tolist()
        self.reset()
        self._skipped_host = int(vals[1])
        report = self._report(vals[0], vals[2:], raise_on_bad, window)
        return " ".join(r for r in (first, report) if r) or None

    def _report(self, loss_sum: float, grad_bad: list[float], raise_on_bad: bool, window: str) -> Optional[str]:
        loss_bad = not math.isfinite(loss_sum)
        bad_params = [self.names[i] for i, v in enumerate(grad_bad) if v != 0]
        if not loss_bad and not bad_params:
            return None
        if bad_params:
            extra = f" (and {len(bad_params) - 1} more)" if len(bad_params) > 1 else ""
            what = f"non-finite gradient in parameter '{bad_params[0]}'{extra}"
            if self.scan_params:  # a slot counts the parameter's own values too
                what = f"non-finite gradient or update of parameter '{bad_params[0]}'{extra}"
            if loss_bad:
                what = "non-finite loss and " + what
        else:
            what = "non-finite loss" + (
                "" if self.mode == "full" else " (nan_guard='loss' does not check gradients; nan_guard=True names the parameter)"
            )
        report = f"NaN guard: {what}{(' ' + window) if window else ''}."
        if raise_on_bad:
            raise NonFiniteError(
                report + " Lower the learning rate, check the data of those steps, or enable gradient clipping; "
                "nan_action='skip' skips such updates instead.",
                parameter=bad_params[0] if bad_params else None,
            )
        return report

    def skipped_steps(self) -> int:
        """Updates skipped so far (``nan_action="skip"``; one host sync). :attr:`skipped_read`: without a sync."""
        return int(self.skipped.item())

    @property
    def skipped_read(self) -> int:
        """Updates skipped up to the last read (a snapshot read by :meth:`poll`, or :meth:`check`)."""
        return self._skipped_host

    def reset(self) -> None:
        self.loss_sum.zero_()
        self.grad_bad.zero_()
        if self._param_check is not None:
            arm(self._param_check[2])  # the next window's first non-finite loss reads the parameters again


class NanPolicy:
    """The NaN guard's decisions for a training loop, in one place: which check each step gets, when the
    accumulators are read, and how a bad read is reported. The framework adapter tells it what it knows (the step
    clips, clips by norm; its own clipping can be tapped) and calls it at the points of the step.

    Each step gets one of three checks, all device work captured with the step:

    * **the loss is watched** instead of any gradient being read (:meth:`NanGuard.watch_loss`, from
      :meth:`note_loss`, before backward) where nothing mixes the gradients: ``may_watch`` (one process, plain
      tensors, ``nan_action="raise"``), the framework's own clipping (``may_defer``) and a step that does not clip;
    * **the clipping norms** are read (:meth:`clip_by_norm`, around the framework's clipping by norm) where the step
      clips by norm with the framework's own clipping (``may_defer``) and the gradients share one dtype; a step whose
      clipping did not run after all is checked at its end;
    * otherwise **every gradient** is read before clipping (:meth:`NanGuard.observe_grads`, which also writes the
      fused optimizer's ``found_inf`` where updates are skipped).

    Reads: every ``check_every`` steps a queued read (no host sync), reported by the first later step that finds it
    written (:meth:`after_run`); :meth:`check` reads now (epoch and fit end, a changed trainable set).

    Args:
        guard: the accumulators.
        action: ``"raise"`` (a bad read raises :class:`NonFiniteError`) or ``"skip"`` (it warns; the skipped updates
            are counted into ``stats.skipped_steps``).
        check_every: steps between queued reads.
        stats: the counters (``skipped_steps``).
        may_watch: the loss may be watched instead of reading the gradients (see above).
        step: the training loop's step counter, for the window a report names.
        checked_at: that counter at the last read (the window of the first report starts there).
    """

    def __init__(self, guard: NanGuard, action: str, check_every: int, stats: Any, *, may_watch: bool,
                 step: Callable[[], int], checked_at: int = 0) -> None:
        self.guard = guard
        self.raise_on_bad = action == "raise"
        self.check_every = check_every
        self.stats = stats
        self.may_watch = may_watch
        #: the framework's own clipping by norm runs (not a user override): its norms may stand in for a read
        self.may_defer = False
        self._step = step
        #: the loop's step counter at the last read
        self.checked_at = checked_at
        self._defer = False  # this step's gradient check is left to the clipping norms
        self._watched = False  # this step's loss was watched (no gradient is read)

    @classmethod
    def from_config(cls, config: CaptureConfig, named_params: Sequence[tuple[str, Tensor]], device: torch.device,
                    stats: Any, *, one_process: bool, step: Callable[[], int], checked_at: int = 0,
                    framework_clipping: bool = False) -> Optional[NanPolicy]:
        """The guard and policy ``config`` asks for (``nan_guard``, ``nan_action``, ``nan_check_every``); ``None``
        for ``nan_guard=False``. The loss may be watched where its reads can then scan the parameters: plain tensors
        (not FP8 or distributed tensor subclasses), a bad gradient kept in its own parameter (``one_process``: no
        all-reduce mixing them), and nothing skipped (``nan_action="raise"``). ``framework_clipping``: the framework's
        own clipping by norm runs (not a user override), so its norms may stand in for a read (``may_defer``) where
        :attr:`can_read_clipping_norms`; the framework then routes that clipping through :meth:`clip_by_norm`."""
        mode = config.nan_mode
        if mode == "off":
            return None
        may_watch = (mode == "full" and not config.nan_skips and one_process
                     and all(type(p.data) is Tensor for _, p in named_params))
        policy = cls(NanGuard(named_params, device, mode), config.nan_action, config.nan_check_every, stats,
                     may_watch=may_watch, step=step, checked_at=checked_at)
        policy.may_defer = framework_clipping and policy.can_read_clipping_norms
        return policy

    @property
    def can_read_clipping_norms(self) -> bool:
        """The framework's clipping by norm may stand in for this step's gradient read (:meth:`clip_by_norm`): the
        guard names parameters and nothing is skipped."""
        return self.guard.mode == "full" and self.raise_on_bad

    # -- the step (inside the captured region) ------------------------------------------------
    def begin_step(self) -> None:
        self._watched = False

    def note_loss(self, loss: Any, clips: bool) -> None:
        """The loss about to be back-propagated (every micro-batch); ``clips``: this step clips gradients."""
        if (self.may_watch and self.may_defer
                and not clips and isinstance(loss, Tensor)):
            self.guard.watch_loss(loss)
            self._watched = True

    def before_clip(self, clips_by_norm: bool, found_inf: Optional[Tensor]) -> None:
        """Right before clipping and the optimizer step; ``found_inf``: the fused optimizer's skip flag (skip mode)."""
        guard = self.guard
        if self._watched:
            guard.scan_params = True  # a bad gradient stays in its own parameter: the reads scan them
            return
        if self.may_defer and clips_by_norm and len({p.grad.dtype for p in guard.params if p.grad is not None}) == 1:
            self._defer = True
            return
        guard.observe_grads(found_inf)

    def clip_by_norm(self, clip: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Around the framework's clipping by norm: the check of a deferred step reads the norms it computes."""
        if not self._defer:
            return clip(*args, **kwargs)
        self._defer = False
        with self.guard.norm_tap() as tap:
            out = clip(*args, **kwargs)
        if not tap.covered:  # not every gradient got a norm: read them (after the clip factor, still non-finite)
            self.guard.observe_grads()
        return out

    def end_step(self, out: Any) -> None:
        """After the step's Python (``out``: what the step returned; its ``"loss"`` goes into the accumulator)."""
        if self._defer:  # the step clipped nothing after all: check its (unchanged) gradients now
            self._defer = False
            self.guard.observe_grads()
        if self._watched:
            self._watched = False  # its loss went into the accumulator with the watch
        elif isinstance(out, dict) and isinstance(out.get("loss"), Tensor):
            self.guard.observe_loss(out["loss"])

    # -- reads (host side) ----------------------------------------------------------------------
    def after_run(self, runs: int) -> None:
        """After every step (eager or replayed; ``runs`` so far): report a queued read once written; queue one
        every ``check_every`` steps."""
        guard = self.guard
        if guard.read_pending:
            self._report(guard.poll(raise_on_bad=self.raise_on_bad))
        if runs % self.check_every == 0:
            self.snapshot()

    def snapshot(self) -> None:
        """Queue a read (no host sync); a later step's :meth:`after_run` reports it once written."""
        self.guard.snapshot(self._window())
        self._report(self.guard.poll(raise_on_bad=self.raise_on_bad))  # a CPU device: ready now

    def check(self) -> None:
        """Read now (one host sync); raise or report."""
        self._report(self.guard.check(raise_on_bad=self.raise_on_bad, window=self._window()))

    def _window(self) -> str:
        gs = self._step()
        window = f"in the optimizer steps after global step {self.checked_at} up to {gs}"
        self.checked_at = gs
        return window

    def _report(self, report: Optional[str]) -> None:
        # Skip mode: the guard's reads carry the count of skipped updates (no extra sync for it).
        self.stats.skipped_steps = self.guard.skipped_read if not self.raise_on_bad else 0
        if report is not None:
            warnings.warn(f"{report} The optimizer update of those steps was skipped.", stacklevel=4)


_VECTOR_NORM = torch.ops.aten.linalg_vector_norm.default


class _NormTap(ObservingMode):
    """Collects the norm of each checked gradient computed inside the block (``torch._foreach_norm`` on CUDA,
    ``torch.linalg.vector_norm`` per tensor elsewhere) and, on a clean exit, marks the non-finite ones.

    Python runs only while the block runs (at capture); the marking kernels are part of the step, and a replay
    repeats them with that replay's norms.
    """

    def __init__(self, guard: NanGuard) -> None:
        super().__init__()
        self.guard = guard
        self.covered = False
        self._norms: dict[int, Tensor] = {}
        self._slots: dict[tuple[int, int], int] = {}

    def __enter__(self) -> _NormTap:
        grads = [p.grad for p in self.guard.params]
        self._slots = {(g.data_ptr(), g.numel()): i for i, g in enumerate(grads) if g is not None}
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is FOREACH_NORM:
            tensors, norms = args[0], out
            order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        elif func is _VECTOR_NORM and (args[2] if len(args) > 2 else kwargs.get("dim")) is None:
            tensors, norms = (args[0],), (out,)
            order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        else:
            return out
        if order != 0:  # the 0-"norm" counts non-zeros: a NaN counts as one, it does not propagate
            for t, n in zip(tensors, norms):
                slot = self._slots.get((t.data_ptr(), t.numel()))
                if slot is not None:
                    self._norms.setdefault(slot, n)
        return out

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        super().__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.covered = self._mark()

    def _mark(self) -> bool:
        norms = self._norms
        if not self._slots or len(norms) != len(self._slots) or len({n.dtype for n in norms.values()}) != 1:
            return False
        guard = self.guard
        if len(norms) == len(guard.params):
            stacked = torch.stack([norms[i] for i in range(len(norms))])
        else:  # parameters without a gradient this step: a zero norm in their slot
            zero = torch.zeros((), dtype=next(iter(norms.values())).dtype, device=guard.device)
            stacked = torch.stack([norms.get(i, zero) for i in range(len(guard.params))])
        # x - x is 0 for a finite norm and NaN for an infinite or NaN one: the report reads a slot != 0 as bad. Only
        # the first step of a read window with a bad norm marks: its NaN clip factor spoils every parameter, so every
        # later step's norms are non-finite and would name all of them. One kernel more than marking every step.
        bad = guard.grad_bad
        torch.where(bad.any(), bad, stacked.sub(stacked), out=bad)
        return True
