"""Device-side NaN/Inf detection that never syncs the host inside a step.

Inside the captured step the guard only *adds* into device accumulators: the loss into one
scalar, and for each parameter the number of non-finite elements of its gradient into one slot
of a vector. NaN and Inf propagate through the loss sum and any non-finite gradient element makes
its slot non-zero, so after N steps the accumulators say whether (and where) a step went bad.
Per step this is one kernel for the loss and, for the gradients, one launch of
:class:`~.finite.FiniteCheck` (one read of every gradient; a ``_foreach_norm`` fallback without
Triton). The accumulators are allocated once, outside every graph.

Reading them does not sync either: every ``check_every`` steps :meth:`NanGuard.snapshot` queues a copy
into pinned host memory and clears them, in stream order; :meth:`NanGuard.poll` reads that copy once
the GPU has written it (an event query, no wait), usually a step or two later, and only then maps a bad
slot to its parameter's name. At epoch and fit end :meth:`NanGuard.check` reads synchronously.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from .errors import NonFiniteError
from .finite import FiniteCheck, capturing, table_length

__all__ = ["NanGuard"]

# Checks kept for gradient sets seen only in eager steps (a graph's checks are never dropped).
_MAX_EAGER_CHECKS = 8


class _Buckets:
    """One capture's overlapped checks: gradients ready but not yet checked, and the checks launched."""

    __slots__ = ("ready", "ready_bytes", "checks", "done")

    def __init__(self) -> None:
        self.ready: list[int] = []
        self.ready_bytes = 0
        self.checks: list[FiniteCheck] = []
        self.done: set[int] = set()


class _Group:
    """The checks of one captured step's gradients, kept together (the graph reads their tables); run in
    order when an eager step meets the same gradients."""

    __slots__ = ("checks",)

    def __init__(self, checks: list[FiniteCheck]) -> None:
        self.checks = checks

    def run(self, acc: Tensor, step_acc: Optional[Tensor] = None) -> None:
        for check in self.checks:
            check.run(acc, step_acc)


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
        # (Room for one 16-byte alignment pad per tensor: checks of buckets take consecutive slices of it.)
        self._table_len = table_length([p.numel() for p in self.params]) + 2 * len(self.params) + 2
        self._spare: Optional[Tensor] = None
        self._spare_off = 0
        # Checks launched on a side stream while a captured backward still runs (see overlap_backward).
        self._side: Optional[Any] = None
        self._bucket_bytes = 0
        self._buckets: Optional[_Buckets] = None
        self._retired: list[Any] = []
        self._with_step = False  # skip mode: counts also go into _step_bad (a kernel variant: fixed per run)
        self.side_checks = 0  # checks the last capture ran beside backward (on the side stream)
        self._pending: list[FiniteCheck] = []
        # The queued host read (snapshot): pinned host copy of [loss_sum, skipped, grad_bad...], its event, window.
        self._read: Optional[tuple[Tensor, Any, str]] = None
        self._stage: Optional[Tensor] = None
        self._host: Optional[Tensor] = None
        self._skipped_host = 0

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
        self._with_step = found_inf is not None
        grads = [p.grad for p in self.params]
        key = tuple((i, g.data_ptr()) for i, g in enumerate(grads) if g is not None)
        if not key:
            return
        in_capture = capturing(self.device)
        if in_capture and self._buckets is not None and self._buckets.checks:
            self._join_buckets(key, grads, found_inf)
            return
        check = self._checks.get(key)
        if check is None:
            if not in_capture and len(self._checks) - len(self._in_graph) >= _MAX_EAGER_CHECKS:
                # Eager steps that re-allocate gradients (zero_grad(set_to_none=True)) may see new addresses.
                old = next(k for k in self._checks if k not in self._in_graph)
                del self._checks[old]
            check = self._checks[key] = self._new_check([i for i, _ in key], in_capture)
        if in_capture:
            self._in_graph.add(key)
        elif self._spare is None and self.device.type == "cuda":
            self._spare = torch.empty(self._table_len, dtype=torch.int64, device=self.device)
            self._spare_off = 0
        if found_inf is None:
            check.run(self.grad_bad)
            return
        self._step_bad.zero_()
        check.run(self.grad_bad, self._step_bad)
        bad = self._step_bad > 0
        found_inf.copy_(bad.to(found_inf.dtype).reshape(found_inf.shape))
        self.skipped.add_(bad)

    def _new_check(self, ids: list[int], in_capture: bool) -> FiniteCheck:
        """A check of these parameters' gradients; built during a capture, its table is the next slice of the spare."""
        table = self._spare[self._spare_off:] if in_capture and self._spare is not None else None
        check = FiniteCheck([self.params[i].grad for i in ids], ids, table=table)
        if table is not None:
            self._spare_off += check.table_used
            self._pending.append(check)
        return check

    # -- checks overlapped with a captured backward ----------------------------------------------
    def overlap_backward(self, bucket_bytes: int = 0) -> list[Any]:
        """Let captures check gradients while backward still runs; returns the hook handles (remove them to undo).

        Within :meth:`overlapped` (entered around the capture of a step that writes fresh gradients), each
        parameter's post-accumulate-grad hook collects its gradient; every ``bucket_bytes`` of gradients (default:
        an eighth of all) are checked on a side stream that forked from backward there, so the graph runs the
        check beside the rest of backward instead of after it. :meth:`observe_grads` checks what is left and joins
        the side stream (before clipping and the update read the gradients). Eager steps are unchanged.
        """
        if self.mode != "full" or self.device.type != "cuda":
            return []
        total = sum(p.numel() * p.element_size() for p in self.params)
        self._bucket_bytes = bucket_bytes or max(total // 8, 1)
        return [p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
                for i, p in enumerate(self.params)]

    @contextlib.contextmanager
    def overlapped(self, enabled: bool = True) -> Iterator[None]:
        """Around a capture whose backward writes every gradient fresh (no accumulation across steps)."""
        if not enabled or not self._bucket_bytes or self._spare is None:
            yield
            return
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._buckets = _Buckets()
        try:
            yield
        finally:
            self._buckets = None

    def _grad_ready(self, i: int, p: Tensor) -> None:
        b = self._buckets
        if b is None or p.grad is None:
            return
        b.ready.append(i)
        b.ready_bytes += p.grad.numel() * p.grad.element_size()
        if b.ready_bytes >= self._bucket_bytes:
            self._launch_bucket(b)

    def _launch_bucket(self, b: _Buckets) -> None:
        ids, b.ready, b.ready_bytes = b.ready, [], 0
        check = self._new_check(ids, in_capture=True)
        main = torch.cuda.current_stream(self.device)
        side = self._side
        side.wait_stream(main)  # fork here: these gradients are final
        with torch.cuda.stream(side):
            if not self._with_step:
                check.run(self.grad_bad)
            else:
                if not b.checks:
                    self._step_bad.zero_()  # before this step's first count
                check.run(self.grad_bad, self._step_bad)
        b.checks.append(check)
        b.done.update(ids)

    def _join_buckets(self, key: tuple, grads: list[Optional[Tensor]], found_inf: Optional[Tensor]) -> None:
        b = self._buckets
        torch.cuda.current_stream(self.device).wait_stream(self._side)  # join before clipping/update
        rest = [i for i, g in enumerate(grads) if g is not None and i not in b.done]
        checks = list(b.checks)
        if rest:
            check = self._new_check(rest, in_capture=True)
            check.run(self.grad_bad, self._step_bad if found_inf is not None else None)
            checks.append(check)
        self.side_checks = len(b.checks)
        old = self._checks.get(key)
        if old is not None and key in self._in_graph:
            self._retired.append(old)  # an older graph still launches it: keep its tables
        self._checks[key] = _Group(checks)
        self._in_graph.add(key)
        b.checks.clear()
        if found_inf is not None:
            bad = self._step_bad > 0
            found_inf.copy_(bad.to(found_inf.dtype).reshape(found_inf.shape))
            self.skipped.add_(bad)

    def after_capture(self) -> None:
        """Write the metadata of the checks built during the capture that just ended (before its first replay)."""
        for check in self._pending:
            check.fill()
        self._pending.clear()
        self._spare = None  # its slices belong to this capture's checks; the next warm-up allocates another

    def state_tensors(self) -> list[Tensor]:
        """The accumulators (a verification run restores them: the Triton kernel bypasses torch's dispatcher)."""
        return [self.loss_sum, self.grad_bad, self.skipped, self._step_bad]

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
