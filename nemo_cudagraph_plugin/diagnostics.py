"""Diagnostics: per-microbatch timing of a pipeline stage, to see the first-microbatch imbalance.

:class:`MicrobatchTimer` records each stage's per-microbatch forward/backward time (CUDA events on
CUDA, no host sync per microbatch; a host clock on CPU) and reports the first microbatch against
the median of the others, per rank; :func:`gather_timing_reports` collects the reports on one
rank. That is how the imbalance that :func:`nemo_cudagraph_plugin.fp8.pipeline.align_fp8_transposes`
removes (and its absence) is seen.

Framework-free: only torch. Nothing here is captured into a CUDA graph (intervals recorded during a
capture are skipped and counted).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "MicrobatchTimer",
    "StageTimingReport",
    "format_timing_table",
    "gather_timing_reports",
]


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


KINDS = ("fwd", "bwd")


@dataclass


class StageTimingReport:
    """One rank's microbatch timings: the first microbatch of each step against the others.

    Times are milliseconds. ``first_ms[k]`` is the median over steps of microbatch 0's time
    (summed over this rank's chunks); ``rest_ms[k]`` the median over all later microbatches of
    those steps; ``ratio[k] = first_ms[k] / rest_ms[k]`` for ``k`` in ``fwd``, ``bwd``, ``total``
    (fwd+bwd). A ratio near 1 means the first microbatch is not slower than the others.
    """

    rank: int
    device: str
    steps: int
    microbatches: int
    chunks: int
    first_ms: dict[str, float] = field(default_factory=dict)
    rest_ms: dict[str, float] = field(default_factory=dict)
    ratio: dict[str, float] = field(default_factory=dict)
    per_step: list[dict[str, float]] = field(default_factory=list)
    skipped_captured: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageTimingReport:
        return cls(**d)

    def summary(self) -> str:
        if not self.ratio:
            return f"rank {self.rank}: no step with >= 2 timed microbatches"
        f, r = self.first_ms.get("total", float("nan")), self.rest_ms.get("total", float("nan"))
        return (
            f"rank {self.rank}: first microbatch {f:.3f} ms, median of the rest {r:.3f} ms, "
            f"ratio {self.ratio.get('total', float('nan')):.3f} (fwd {self.ratio.get('fwd', float('nan')):.3f}, "
            f"bwd {self.ratio.get('bwd', float('nan')):.3f}) over {self.steps} steps"
        )


def format_timing_table(reports: Sequence[StageTimingReport]) -> str:
    """A small fixed-width table, one row per rank."""
    head = f"{'rank':>4} {'steps':>5} {'mbs':>4} {'first ms':>10} {'rest ms':>10} {'ratio':>7} {'fwd':>7} {'bwd':>7}"
    rows = [head]
    nan = float("nan")
    for r in sorted(reports, key=lambda x: x.rank):
        rows.append(
            f"{r.rank:>4} {r.steps:>5} {r.microbatches:>4} {r.first_ms.get('total', nan):>10.3f} "
            f"{r.rest_ms.get('total', nan):>10.3f} {r.ratio.get('total', nan):>7.3f} "
            f"{r.ratio.get('fwd', nan):>7.3f} {r.ratio.get('bwd', nan):>7.3f}"
        )
    return "\n".join(rows)


class _Handle:
    def __init__(self, handles: list[Any]):
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class MicrobatchTimer:
    """Per-microbatch forward/backward timer for one pipeline rank.

    On CUDA each interval is a pair of CUDA events recorded on the current stream: nothing waits on
    the host until :meth:`report` (one synchronisation for everything pending). On CPU (or with
    ``device="cpu"``) it uses ``clock`` (default ``time.perf_counter``). Intervals that would be
    recorded during a CUDA graph capture are skipped (events in a captured graph do not time
    replays) and counted in ``skipped_captured``; time graphed runs as a whole instead.

    Usage::

        timer = MicrobatchTimer()
        for step in range(n):
            timer.start_step()
            for mb in range(m):
                with timer.record("fwd", mb):
                    loss = model(batch[mb])
                with timer.record("bwd", mb):
                    loss.backward()
            optimizer.step()
        print(timer.report().summary())

    Or :meth:`attach` it to each model chunk to time the microbatches of an existing schedule
    (Megatron-core, NeMo) without touching it.
    """

    def __init__(
        self,
        device: Optional[Union[str, torch.device]] = None,
        *,
        rank: Optional[int] = None,
        clock: Optional[Callable[[], float]] = None,
    ) -> None:
        if device is None:
            use_cuda = torch.cuda.is_available()
        else:
            use_cuda = torch.device(device).type == "cuda"
            if use_cuda and not torch.cuda.is_available():
                raise ValueError(
                    f"MicrobatchTimer(device={device!r}) but CUDA is not available; use device='cpu'."
                )
        if use_cuda and clock is not None:
            raise ValueError(
                "MicrobatchTimer: `clock` is only used on CPU; CUDA timings come from CUDA events."
            )
        self.use_cuda = use_cuda
        self.clock = clock or time.perf_counter
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.step = -1
        self.skipped_captured = 0
        self._pending: list[tuple[int, str, int, int, Any, Any]] = []
        self._open: dict[tuple[str, int, int], Any] = {}
        self._auto_mb: dict[tuple[str, int], int] = defaultdict(int)
        self._done: dict[int, dict[str, dict[int, float]]] = {}
        self._chunks: set[int] = set()
        self._pool: list[Any] = []

    # -- recording ---------------------------------------------------------------------------

    def start_step(self) -> None:
        """Begin a new training step; automatic microbatch numbering restarts at 0."""
        self.step += 1
        self._auto_mb.clear()

    def _mark(self) -> Any:
        if not self.use_cuda:
            return self.clock()
        ev = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self, kind: str, microbatch: Optional[int] = None, chunk: int = 0) -> None:
        """Open an interval; ``microbatch=None`` numbers them per (kind, chunk) within the step."""
        if kind not in KINDS:
            raise ValueError(f"MicrobatchTimer: kind must be one of {KINDS}, got {kind!r}.")
        if self.step < 0:
            self.start_step()
        if self.use_cuda and _is_capturing():
            self.skipped_captured += 1
            return
        if microbatch is None:
            microbatch = self._auto_mb[(kind, chunk)]
            self._auto_mb[(kind, chunk)] += 1
        key = (kind, microbatch, chunk)
        if key in self._open:
            raise RuntimeError(
                f"MicrobatchTimer: {kind} of microbatch {microbatch} (chunk {chunk}) started twice."
            )
        self._open[key] = self._mark()

    def stop(self, kind: str, microbatch: Optional[int] = None, chunk: int = 0) -> None:
        """Close the interval opened by :meth:`start` (the oldest open one when ``microbatch=None``)."""
        if self.use_cuda and _is_capturing():
            return
        if microbatch is None:
            opened = sorted(mb for (k, mb, c) in self._open if k == kind and c == chunk)
            if not opened:
                raise RuntimeError(
                    f"MicrobatchTimer: stop({kind!r}, chunk={chunk}) without a matching start."
                )
            microbatch = opened[0]
        key = (kind, microbatch, chunk)
        if key not in self._open:
            raise RuntimeError(
                f"MicrobatchTimer: stop({kind!r}, microbatch={microbatch}, chunk={chunk}) without a matching start."
            )
        begin = self._open.pop(key)
        self._pending.append((self.step, kind, microbatch, chunk, begin, self._mark()))
        self._chunks.add(chunk)

    @contextmanager
    def record(self, kind: str, microbatch: Optional[int] = None, chunk: int = 0) -> Iterator[None]:
        """Time the body as ``kind`` (``"fwd"``/``"bwd"``) of ``microbatch`` of ``chunk``."""
        if self.step < 0:
            self.start_step()
        if microbatch is None:
            microbatch = self._auto_mb[(kind, chunk)]
            self._auto_mb[(kind, chunk)] += 1
        self.start(kind, microbatch, chunk)
        try:
            yield
        finally:
            self.stop(kind, microbatch, chunk)

    def attach(self, module: nn.Module, chunk: int = 0) -> _Handle:
        """Time every forward and backward of ``module`` as microbatches of ``chunk``.

        The i-th forward of a step is microbatch i. Forward: module forward pre-hook -> forward
        hook. Backward of that microbatch: from the moment the gradient of its output arrives (a
        hook on the output tensor) until the gradient of its input is computed (a hook on the input
        tensor, as for a stage that sends it to the previous stage) or, when no input requires grad
        (the first stage), until all trainable parameters' gradients of that backward are computed
        (``torch.autograd.graph.register_multi_grad_hook``). Call :meth:`start_step` at each step.
        Returns a handle; ``handle.remove()`` detaches.
        """
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(
                "MicrobatchTimer.attach: the module has no trainable parameters, so the end of its backward "
                "cannot be observed; time it with timer.record('bwd', ...) around the backward call instead."
            )
        handles: list[Any] = []
        by_params: list[int] = []  # microbatches whose backward ends with the parameter gradients
        state = {"on": True}

        def pre(_mod: nn.Module, _args: Any) -> None:
            if state["on"]:
                self.start("fwd", None, chunk)

        def post(_mod: nn.Module, args: Any, out: Any) -> Any:
            if not state["on"]:
                return None
            opened = [mb for (k, mb, c) in self._open if k == "fwd" and c == chunk]
            if not opened:
                return None  # capturing: nothing was opened
            mb = min(opened)
            self.stop("fwd", mb, chunk)
            t = _first_grad_tensor(out)
            if t is None:
                return None  # no backward will follow (eval / no_grad)
            t.register_hook(
                lambda _g, mb=mb: self._start_if_closed("bwd", mb, chunk) if state["on"] else None
            )
            ins = _grad_tensors(args)
            if ins:
                ins[0].register_hook(lambda _g, mb=mb: self._stop_if_open("bwd", mb, chunk))
            else:
                by_params.append(mb)
            return None

        def params_done(_grads: Any) -> None:
            if by_params:
                self._stop_if_open("bwd", by_params.pop(0), chunk)

        class _Detach:
            def remove(self) -> None:
                state["on"] = False

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
        handles.append(torch.autograd.graph.register_multi_grad_hook(params, params_done, mode="all"))
        handles.append(_Detach())
        return _Handle(handles)

    def _start_if_closed(self, kind: str, microbatch: int, chunk: int) -> None:
        if (kind, microbatch, chunk) not in self._open:
            self.start(kind, microbatch, chunk)

    def _stop_if_open(self, kind: str, microbatch: int, chunk: int) -> None:
        if (kind, microbatch, chunk) in self._open:
            self.stop(kind, microbatch, chunk)

    # -- reporting ---------------------------------------------------------------------------

    def _collect(self) -> None:
        if not self._pending:
            return
        if self.use_cuda:
            self._pending[-1][5].synchronize()  # the one host sync: everything before it is done too
        for step, kind, mb, _chunk, begin, end in self._pending:
            if self.use_cuda:
                ms = begin.elapsed_time(end)
                self._pool.extend((begin, end))
            else:
                ms = (end - begin) * 1000.0
            per_kind = self._done.setdefault(step, {k: defaultdict(float) for k in KINDS})
            per_kind[kind][mb] += ms  # several chunks in one microbatch add up
        self._pending.clear()

    def durations(self) -> dict[int, dict[str, dict[int, float]]]:
        """``{step: {"fwd"|"bwd": {microbatch: ms}}}`` (summed over chunks); synchronises once."""
        self._collect()
        return {s: {k: dict(v) for k, v in d.items()} for s, d in self._done.items()}

    def report(self, skip_steps: int = 0) -> StageTimingReport:
        """First microbatch vs the median of the others, over the steps after the first ``skip_steps``.

        Steps with fewer than two microbatches of a kind are left out of that kind.
        """
        done = self.durations()
        firsts: dict[str, list[float]] = defaultdict(list)
        rests: dict[str, list[float]] = defaultdict(list)
        per_step: list[dict[str, float]] = []
        max_mb = 0
        used = 0
        for step in sorted(done):
            if step < skip_steps:
                continue
            d = dict(done[step])
            both = sorted(set(d["fwd"]) & set(d["bwd"]))
            d["total"] = {mb: d["fwd"][mb] + d["bwd"][mb] for mb in both}
            row: dict[str, float] = {"step": float(step)}
            counted = False
            for kind in (*KINDS, "total"):
                mbs = sorted(d[kind])
                max_mb = max(max_mb, len(mbs))
                if len(mbs) < 2:
                    continue
                first, rest = d[kind][mbs[0]], [d[kind][m] for m in mbs[1:]]
                firsts[kind].append(first)
                rests[kind].extend(rest)
                med = statistics.median(rest)
                row[f"first_{kind}_ms"] = first
                row[f"rest_{kind}_ms"] = med
                counted = True
            if counted:
                used += 1
                per_step.append(row)
        first_ms = {k: statistics.median(v) for k, v in firsts.items()}
        rest_ms = {k: statistics.median(v) for k, v in rests.items()}
        ratio = {k: (first_ms[k] / rest_ms[k]) if rest_ms[k] > 0 else float("inf") for k in first_ms}
        return StageTimingReport(
            rank=self.rank,
            device="cuda" if self.use_cuda else "cpu",
            steps=used,
            microbatches=max_mb,
            chunks=max(1, len(self._chunks)),
            first_ms=first_ms,
            rest_ms=rest_ms,
            ratio=ratio,
            per_step=per_step,
            skipped_captured=self.skipped_captured,
        )

    def reset(self) -> None:
        """Drop everything recorded (open intervals included)."""
        self._collect()
        self._open.clear()
        self._done.clear()
        self._chunks.clear()
        self._auto_mb.clear()
        self.step = -1
        self.skipped_captured = 0


def _first_grad_tensor(out: Any) -> Optional[Tensor]:
    if isinstance(out, Tensor):
        return out if out.requires_grad else None
    if isinstance(out, (list, tuple)):
        for o in out:
            t = _first_grad_tensor(o)
            if t is not None:
                return t
    if isinstance(out, dict):
        for o in out.values():
            t = _first_grad_tensor(o)
            if t is not None:
                return t
    return None


def _grad_tensors(args: Any) -> list[Tensor]:
    out: list[Tensor] = []
    for a in args if isinstance(args, (list, tuple)) else (args,):
        if isinstance(a, Tensor) and a.requires_grad:
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(_grad_tensors(a))
    return out


def gather_timing_reports(
    report: StageTimingReport, group: Optional[Any] = None, dst: int = 0
) -> Optional[list[StageTimingReport]]:
    """Collect every rank's report on rank ``dst`` of ``group`` (default world), sorted by rank.

    Returns the list on ``dst`` and ``None`` elsewhere; ``[report]`` without ``torch.distributed``.
    Every rank of the group must call it (it is a collective). With NCCL, set the CUDA device first.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return [report]
    global_dst = dist.get_global_rank(group, dst) if group is not None else dst
    me = dist.get_rank()
    size = dist.get_world_size(group)
    out: Optional[list[Any]] = [None] * size if me == global_dst else None
    dist.gather_object(report.as_dict(), out, dst=global_dst, group=group)
    if out is None:
        return None
    return sorted((StageTimingReport.from_dict(d) for d in out), key=lambda r: r.rank)
