"""Pipeline alignment of FP8 transposes, on CPU with gloo (2 and 4 ranks, 1F1B and interleaved 1F1B).

A small test schedule driver runs Megatron-core's 1F1B orders (warm-up / steady / cool-down;
interleaved over virtual chunks with Megatron's schedule table) across real processes. Activations
and gradients travel between ranks with gloo point-to-point messages. Each chunk holds FP8 test
doubles; forward reads their data, backward needs their transpose and computes it lazily when it
is invalid -- exactly where TransformerEngine does. Every transpose computation is logged with the
schedule point it happened at. After each optimizer step (which writes new FP8 bytes in place and
invalidates the transposes, as distributed optimizers do) the alignment under test runs.

Assertions: with alignment every rank refreshes every chunk once, after the step and before
microbatch 0, and nothing is computed inside any microbatch; the optional group sync happens
exactly once per step, after the refresh. Without alignment the same check finds the transposes
computed inside microbatch 0 of each chunk (so the check can fail).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8_doubles  # noqa: E402  (the FP8 helper's CPU doubles of Float8Tensor)

from nemo_cudagraph_plugin.diagnostics import (  # noqa: E402
    MicrobatchTimer,
    StageTimingReport,
    format_timing_table,
    gather_timing_reports,
)
from nemo_cudagraph_plugin.fp8 import Fp8RefreshHandle  # noqa: E402
from nemo_cudagraph_plugin.fp8.pipeline import (  # noqa: E402
    TransposeAligner,
    align_fp8_transposes,
    chunk_parameters,
    sync_pipeline_group,
)
from nemo_cudagraph_plugin.integrations.megatron import install_param_sync_hook, make_param_sync_hook  # noqa: E402

D = 8  # activation width
STEPS = 3  # optimizer steps per phase (checked: the schedules after steps 1..STEPS)


# ============================================================================================
# FP8 doubles (tests/fp8_doubles.py) and a log that knows the schedule point
# ============================================================================================


class PointLog(fp8_doubles.TransposeLog):
    """The doubles' event log, also copying every transpose computation (and the driver's
    markers) into ``events`` as ``[what, schedule point, tensor]``."""

    def __init__(self, events: list, point: dict) -> None:
        super().__init__()
        self.out = events
        self.point = point

    def record(self, tensor, kind, ptr=None):
        ev = super().record(tensor, kind, ptr)
        if kind in ("compute", "compute-uncached"):
            self.out.append(["transpose", list(self.point["p"]), tensor])
        return ev

    def note(self, what: str, name: str = "") -> None:
        self.out.append([what, list(self.point["p"]), name])


def make_fp8_param(log, name: str, seed: int, gen: str = "te2", shape=(D, D)) -> nn.Parameter:
    return fp8_doubles.make_fp8_param(gen, shape, fp8_name=name, log=log, seed=seed, requires_grad=False)


def as_float(fp8_bytes: torch.Tensor) -> torch.Tensor:
    return fp8_bytes.view(torch.uint8).float() / 255.0 - 0.5


def weight(p) -> torch.Tensor:
    """What a forward GEMM reads: the row-wise FP8 bytes."""
    return as_float(p._data)


def weight_t(p, log: PointLog) -> torch.Tensor:
    """What a backward GEMM reads: the transpose, computed first if invalid (eager TE of p's generation)."""
    t = fp8_doubles.eager_read(p)
    if not fp8_doubles.transpose_is_current(p):
        log.note("stale", p.fp8_name)  # a transpose of old bytes would give a wrong gradient
    return as_float(t)


# ============================================================================================
# Schedules (Megatron-core's orders)
# ============================================================================================


def schedule_1f1b(pp: int, rank: int, m: int) -> list[tuple[str, int, int]]:
    """Non-interleaved 1F1B: ``pp - rank - 1`` warm-up forwards, 1F1B steady state, cool-down backwards."""
    warmup = min(pp - rank - 1, m)
    ops = [("F", 0, i) for i in range(warmup)]
    f, b = warmup, 0
    for _ in range(m - warmup):
        ops.append(("F", 0, f))
        f += 1
        ops.append(("B", 0, b))
        b += 1
    ops += [("B", 0, i) for i in range(b, m)]
    return ops


def schedule_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """Megatron's (microbatch, chunk) order of virtual microbatches, groups of ``group`` per chunk."""
    table = []
    for start in range(0, m, group):
        end = m if start + group >= m else start + group
        table += [(mb, c) for c in range(v) for mb in range(start, end)]
    return table


def schedule_interleaved(pp: int, rank: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B over ``v`` virtual chunks (microbatch group size = ``pp``, Megatron's default)."""
    total = m * v
    table = schedule_table(m, v, pp)
    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)

    def fwd(k: int) -> tuple[str, int, int]:
        mb, c = table[k]
        return ("F", c, mb)

    def bwd(k: int) -> tuple[str, int, int]:
        mb, c = table[k]
        return ("B", v - 1 - c, mb)

    ops = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops.append(fwd(k + warmup))
        ops.append(bwd(k))
    ops += [bwd(k) for k in range(total - warmup, total)]
    return ops


def schedule(pp: int, rank: int, m: int, v: int) -> list[tuple[str, int, int]]:
    return schedule_1f1b(pp, rank, m) if v == 1 else schedule_interleaved(pp, rank, m, v)


def simulate(pp: int, m: int, v: int, orders=None) -> list[tuple[int, tuple[str, int, int]]]:
    """Run all ranks' orders against each other (sends buffered, receives blocking); return the
    global order or raise on a deadlock. Stage ``s = chunk * pp + rank``."""
    orders = orders or [schedule(pp, r, m, v) for r in range(pp)]
    pos = [0] * pp
    done: set[tuple[str, int, int]] = set()
    last = pp * v - 1
    trace = []
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            kind, c, mb = orders[r][pos[r]]
            s = c * pp + r
            need = (
                ("F", s - 1, mb)
                if kind == "F" and s > 0
                else ("B", s + 1, mb)
                if kind == "B" and s < last
                else None
            )
            if kind == "B" and ("F", s, mb) not in done:
                raise AssertionError(f"rank {r}: backward of {(s, mb)} before its forward")
            if need is None or need in done:
                done.add((kind, s, mb))
                trace.append((r, (kind, c, mb)))
                pos[r] += 1
                progressed = True
        if not progressed:
            raise AssertionError(
                f"deadlock: {[orders[r][pos[r]] if pos[r] < len(orders[r]) else None for r in range(pp)]}"
            )
    return trace


# ============================================================================================
# Multi-process worker
# ============================================================================================


class Chunk(nn.Module):
    """One virtual stage: y = tanh(W x); backward needs W^T, read from the FP8 transpose."""

    def __init__(self, stage: int, log: PointLog, name: str, gen: str = "te2") -> None:
        super().__init__()
        self.w = make_fp8_param(log, name, seed=stage, gen=gen)
        self.log = log
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.steps = 0

    def forward_mb(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(weight(self.w) @ x)
        self.saved[mb] = (x, y)
        return y

    def backward_mb(self, mb: int, g: torch.Tensor) -> torch.Tensor:
        _x, y = self.saved.pop(mb)
        return weight_t(self.w, self.log) @ (g * (1 - y * y))

    def optimizer_step(self) -> None:
        """New FP8 bytes in place + transposes marked invalid, as a distributed optimizer writes them."""
        self.steps += 1
        fp8_doubles.write_fp8_bytes(self.w, seed=self.steps * 31 + self.w.fp8_log.count("write"))


class MegatronLikeConfig:
    def __init__(self) -> None:
        self.param_sync_func = None


def _run_phase(rank: int, pp: int, v: int, m: int, mode: str, events: list, timer: MicrobatchTimer) -> None:
    """One training run of STEPS+1 schedules; ``mode``: lazy / aligned / aligned_sync / megatron_sync,
    or aligned_te1.8 (TE 1.8-1.14 doubles)."""
    point = {"p": ("setup",)}
    plog = PointLog(events, point)
    log = plog.note
    gen = "te1.8" if mode.endswith("te1.8") else "te2"
    chunks = [Chunk(c * pp + rank, plog, f"v{c}", gen) for c in range(v)]
    sync = mode.endswith("_sync")
    config = MegatronLikeConfig()
    if mode == "megatron_sync":
        if v > 1:  # the interleaved schedule calls param_sync_func (Megatron-core)
            install_param_sync_hook(config, chunks, sync_group=True)
            align_after_step = None
        else:  # the non-interleaved one does not: call the hook after optimizer.step()
            align_after_step = make_param_sync_hook(chunks, sync_group=True)
    elif mode.startswith("aligned"):
        aligner = TransposeAligner(chunks, sync_group=sync)
        align_after_step = aligner
    else:
        align_after_step = None

    # Initial transposes (as after te.quantized_model_init): valid before the first schedule.
    point["p"] = ("init",)
    align_fp8_transposes(chunks)

    real_barrier = dist.barrier

    def spy_barrier(*a, **k):
        log("barrier_enter")
        out = real_barrier(*a, **k)
        log("barrier_exit")
        return out

    dist.barrier = spy_barrier
    try:
        last = pp * v - 1
        for step in range(STEPS + 1):
            point["p"] = ("before", step)
            log("schedule_start")
            if config.param_sync_func is not None:  # Megatron: chunks 0 and 1 before the first microbatch
                funcs = config.param_sync_func
                funcs = funcs if isinstance(funcs, list) else [funcs] * v
                funcs[0](chunks[0].parameters())
                funcs[1](chunks[1].parameters())
            timer.start_step()
            pending = []
            losses_grad: dict[tuple[int, int], torch.Tensor] = {}
            ops = schedule(pp, rank, m, v)
            for kind, c, mb in ops:
                s = c * pp + rank
                tag = lambda d, stage, mb=mb, step=step: ((step * 2 + d) * (pp * v) + stage) * m + mb  # noqa: E731
                if kind == "F":
                    if s == 0:
                        x = torch.full((D,), 0.1 * (mb + 1)) + torch.arange(D) * 0.01
                    else:
                        x = torch.empty(D)
                        dist.recv(x, src=(s - 1) % pp, tag=tag(0, s))
                    point["p"] = ("F", step, c, mb)
                    log("op")
                    with timer.record("fwd", mb, chunk=c):
                        y = chunks[c].forward_mb(mb, x)
                    point["p"] = ("between", step)
                    if s == last:
                        losses_grad[(c, mb)] = 2 * y  # d/dy of sum(y^2)
                    else:
                        pending.append(dist.isend(y.contiguous(), dst=(s + 1) % pp, tag=tag(0, s + 1)))
                else:
                    if s == last:
                        g = losses_grad.pop((c, mb))
                    else:
                        g = torch.empty(D)
                        dist.recv(g, src=(s + 1) % pp, tag=tag(1, s))
                    point["p"] = ("B", step, c, mb)
                    log("op")
                    with timer.record("bwd", mb, chunk=c):
                        gx = chunks[c].backward_mb(mb, g)
                    point["p"] = ("between", step)
                    if s > 0:
                        pending.append(dist.isend(gx.contiguous(), dst=(s - 1) % pp, tag=tag(1, s - 1)))
            for w in pending:
                w.wait()
            if step == STEPS:
                break
            point["p"] = ("optimizer", step)
            for ch in chunks:
                ch.optimizer_step()
            log("optimizer_step")
            point["p"] = ("after_step", step)
            if align_after_step is not None:
                align_after_step()
    finally:
        dist.barrier = real_barrier


def _worker(rank: int, pp: int, init_file: str, out_dir: str, phases: list) -> None:
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=pp, timeout=timedelta(seconds=40)
        )
        result = {}
        for v, m, mode in phases:
            events: list = []
            timer = MicrobatchTimer("cpu")
            dist.barrier()
            _run_phase(rank, pp, v, m, mode, events, timer)
            report = timer.report()
            gathered = gather_timing_reports(report)
            result[f"{v}/{m}/{mode}"] = {
                "events": events,
                "report": report.as_dict(),
                "gathered": None if gathered is None else [r.as_dict() for r in gathered],
            }
        # The group sync really synchronises: ranks arriving late still leave together.
        time.sleep(0.05 * rank)
        t_in = time.monotonic()
        align_fp8_transposes([Chunk(rank, PointLog([], {"p": ()}), "x")], sync_group=True)
        result["barrier"] = {"in": t_in, "out": time.monotonic()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_pipeline(pp: int, phases: list, tmp_path, timeout: float = 90.0) -> list[dict]:
    # forkserver: a fresh interpreter (like spawn, no fork of this process) that imports torch and the
    # package once, then forks each rank from it, so the ranks do not each pay that import (~5 s per
    # process on a 2-core machine). Preloading needs the package importable from the working directory
    # (the repo root) or installed; otherwise each rank imports it itself, which is only slower.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed", "nemo_cudagraph_plugin.fp8.pipeline", "nemo_cudagraph_plugin.diagnostics",
         "nemo_cudagraph_plugin.integrations.megatron"]
    )
    init_file = str(tmp_path / "init")
    procs = [ctx.Process(target=_worker, args=(r, pp, init_file, str(tmp_path), phases)) for r in range(pp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
    errors = {
        r: (tmp_path / f"rank{r}.err").read_text() for r in range(pp) if (tmp_path / f"rank{r}.err").exists()
    }
    if errors:
        pytest.fail("worker failed:\n" + "\n".join(f"--- rank {r}\n{e}" for r, e in errors.items()))
    if hung:
        pytest.fail(f"ranks {hung} did not finish within {timeout}s (hang in the schedule or a collective)")
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
    assert not bad, f"ranks {bad} exited with {[procs[r].exitcode for r in bad]}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(pp)]


# ============================================================================================
# The check (pure function over one rank's event log)
# ============================================================================================


def check_alignment(events: list, chunk_names: list[str], steps: int = STEPS) -> list[str]:
    """Violations of "every chunk refreshed once after step k, before microbatch 0; nothing inside
    a microbatch; no stale transpose". Empty list = aligned."""
    problems = []
    for what, point, name in events:
        if what == "transpose" and point[0] in ("F", "B"):
            problems.append(
                f"transpose of {name} computed inside {point[0]} of microbatch {point[3]} "
                f"(chunk {point[2]}, step {point[1]})"
            )
        if what == "stale":
            problems.append(f"stale transpose of {name} used at {point}")
    for k in range(steps):
        opt = [i for i, e in enumerate(events) if e[0] == "optimizer_step" and e[1] == ["optimizer", k]]
        start = [i for i, e in enumerate(events) if e[0] == "schedule_start" and e[1] == ["before", k + 1]]
        first_mb = [
            i for i, e in enumerate(events) if e[0] == "op" and e[1][:2] in (["F", k + 1], ["B", k + 1])
        ]
        if not opt or not start:
            problems.append(f"step {k}: optimizer step or next schedule missing")
            continue
        end = first_mb[0] if first_mb else len(events)
        window = events[opt[0] + 1 : end]
        refreshed = Counter(n for w, p, n in window if w == "transpose")
        for n in chunk_names:
            if refreshed[n] != 1:
                problems.append(
                    f"step {k}: {n} refreshed {refreshed[n]} times between the step and microbatch 0"
                )
    return problems


def barrier_counts(events: list, steps: int = STEPS) -> list[int]:
    """Barriers per step window (after optimizer step k, before the first microbatch of step k+1);
    also checks each barrier comes after the window's refreshes."""
    out = []
    for k in range(steps):
        lo = next(i for i, e in enumerate(events) if e[0] == "optimizer_step" and e[1] == ["optimizer", k])
        hi = next(
            i for i, e in enumerate(events) if e[0] == "op" and e[1][:2] in (["F", k + 1], ["B", k + 1])
        )
        window = events[lo:hi]
        enters = [i for i, e in enumerate(window) if e[0] == "barrier_enter"]
        last_refresh = max((i for i, e in enumerate(window) if e[0] == "transpose"), default=-1)
        assert all(i > last_refresh for i in enters), f"step {k}: group sync before the refresh finished"
        out.append(len(enters))
    return out


# ============================================================================================
# Tests: schedules (pure)
# ============================================================================================


@pytest.mark.parametrize("pp,m,v", [(2, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2), (4, 4, 2), (2, 6, 3)])
def test_schedules_are_complete_and_deadlock_free(pp, m, v):
    trace = simulate(pp, m, v)
    for r in range(pp):
        ops = schedule(pp, r, m, v)
        assert Counter(ops) == Counter([(k, c, mb) for k in "FB" for c in range(v) for mb in range(m)])
        for c in range(v):  # each chunk sees its microbatches in order, forward before backward
            assert [mb for k, cc, mb in ops if k == "F" and cc == c] == list(range(m))
            assert [mb for k, cc, mb in ops if k == "B" and cc == c] == list(range(m))
    assert len(trace) == 2 * pp * m * v


def test_schedule_shapes_match_megatron():
    # 1F1B: last stage has no warm-up, first stage pp-1 forwards ahead.
    assert schedule_1f1b(4, 3, 4)[:2] == [("F", 0, 0), ("B", 0, 0)]
    assert [k for k, _, _ in schedule_1f1b(4, 0, 4)] == list("FFFFBBBB")
    assert [k for k, _, _ in schedule_1f1b(4, 1, 8)][:5] == list("FFFBF")
    # Interleaved: warm-up = (pp - rank - 1) * 2 + (v - 1) * pp; table groups pp microbatches per chunk.
    assert schedule_table(4, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    ops = schedule_interleaved(2, 0, 4, 2)
    assert ops[:4] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1)]
    assert ops[4:6] == [("F", 0, 2), ("B", 1, 0)]  # steady state starts: backward of the last chunk first
    # The simulator finds a deadlock: rank 1 runs microbatch 1 before 0, so each rank waits on the other.
    bad = [
        [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)],
        [("F", 0, 1), ("B", 0, 1), ("F", 0, 0), ("B", 0, 0)],
    ]
    with pytest.raises(AssertionError, match="deadlock"):
        simulate(2, 2, 1, orders=bad)


# ============================================================================================
# Tests: multi-process schedules
# ============================================================================================

MODES = ("lazy", "aligned", "aligned_sync", "megatron_sync", "aligned_te1.8")
PHASES = [(v, m, mode) for v, m in ((1, 4), (2, 4)) for mode in MODES]


@pytest.fixture(scope="module", params=[2, 4], ids=["pp2", "pp4"])
def pipeline_run(request, tmp_path_factory):
    pp = request.param
    phases = [(v, m if pp == 2 else 2 * m, mode) for v, m, mode in PHASES]
    t0 = time.monotonic()
    results = run_pipeline(pp, phases, tmp_path_factory.mktemp(f"pp{pp}"))
    return pp, phases, results, time.monotonic() - t0


def _phases(run, mode):
    pp, phases, results, _ = run
    for v, m, md in phases:
        if md == mode:
            yield v, m, [res[f"{v}/{m}/{md}"] for res in results]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["aligned", "aligned_sync", "megatron_sync", "aligned_te1.8"])
def test_aligned_refreshes_every_chunk_before_microbatch_0(pipeline_run, mode):
    pp = pipeline_run[0]
    for v, _m, per_rank in _phases(pipeline_run, mode):
        names = [f"v{c}" for c in range(v)]
        for rank, res in enumerate(per_rank):
            problems = check_alignment(res["events"], names)
            assert problems == [], f"pp={pp} v={v} rank {rank} ({mode}): {problems[:4]}"
            # The refresh ran and the schedule then used every transpose (no lazy work left to do).
            assert any(e[0] == "transpose" and e[1][0] in ("after_step", "before") for e in res["events"])


@pytest.mark.slow
def test_without_alignment_the_check_finds_microbatch_0(pipeline_run):
    pp = pipeline_run[0]
    for v, _m, per_rank in _phases(pipeline_run, "lazy"):
        names = [f"v{c}" for c in range(v)]
        for rank, res in enumerate(per_rank):
            problems = check_alignment(res["events"], names)
            assert problems, f"pp={pp} v={v} rank {rank}: lazy run passed the alignment check"
            inside = [e for e in res["events"] if e[0] == "transpose" and e[1][0] in ("F", "B")]
            # One lazy computation per chunk per step, each inside that chunk's first microbatch (mb 0).
            assert len(inside) == v * STEPS
            assert {(e[1][2], e[1][3]) for e in inside} == {(c, 0) for c in range(v)}
            assert not any(e[0] == "stale" for e in res["events"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,expected",
    [("aligned", 0), ("aligned_sync", 1), ("megatron_sync", 1), ("lazy", 0), ("aligned_te1.8", 0)],
)
def test_group_sync_exactly_once_per_step(pipeline_run, mode, expected):
    for v, _m, per_rank in _phases(pipeline_run, mode):
        for rank, res in enumerate(per_rank):
            counts = barrier_counts(res["events"])
            assert counts == [expected] * STEPS, f"v={v} rank {rank} {mode}: barriers per step {counts}"
            total = sum(1 for e in res["events"] if e[0] == "barrier_enter")
            # None inside the schedules either. As config.param_sync_func (interleaved), Megatron calls the
            # hook at every schedule start, so the very first schedule (before any step) has one too.
            first = int(mode == "megatron_sync" and v > 1)
            assert total == expected * STEPS + first


@pytest.mark.slow
def test_group_sync_really_waits_for_the_last_rank(pipeline_run):
    _, _, results, _ = pipeline_run
    last_in = max(r["barrier"]["in"] for r in results)
    assert all(r["barrier"]["out"] >= last_in for r in results)


@pytest.mark.slow
def test_timer_reports_per_rank_and_gathers(pipeline_run):
    pp, phases, results, elapsed = pipeline_run
    for v, m, mode in phases:
        key = f"{v}/{m}/{mode}"
        reps = [StageTimingReport.from_dict(r[key]["report"]) for r in results]
        assert [r.rank for r in reps] == list(range(pp))
        for r in reps:
            assert r.steps == STEPS + 1 and r.microbatches == m and r.chunks == v
            assert set(r.ratio) == {"fwd", "bwd", "total"}
        gathered = results[0][key]["gathered"]
        assert [g["rank"] for g in gathered] == list(range(pp))
        assert all(r[key]["gathered"] is None for r in results[1:])
    assert elapsed < 60, f"multi-process run took {elapsed:.1f}s"


# ============================================================================================
# Tests: single-process pieces
# ============================================================================================


def test_align_refreshes_shared_params_once_and_counts():
    events: list = []
    log = PointLog(events, {"p": ("align",)})
    a, b, shared = (make_fp8_param(log, n, seed=i) for i, n in enumerate(("a", "b", "shared")))
    for p in (a, b, shared):
        fp8_doubles.write_fp8_bytes(p)
    chunks = [[a, shared], [b, shared], [torch.zeros(3)]]  # tied tensor in two chunks + a plain tensor
    assert len(chunk_parameters(chunks)) == 4
    assert align_fp8_transposes(chunks) == 3
    assert Counter(e[2] for e in events if e[0] == "transpose") == Counter({"a": 1, "b": 1, "shared": 1})
    for p in (a, b, shared):
        weight_t(p, log)  # what the next backward reads: nothing left to compute, nothing stale
    assert Counter(e[2] for e in events if e[0] == "transpose") == Counter({"a": 1, "b": 1, "shared": 1})
    assert not any(e[0] == "stale" for e in events)
    # The aligner (plan built once) does the same on every call.
    aligner = TransposeAligner(chunks)
    for p in (a, b, shared):
        fp8_doubles.write_fp8_bytes(p)
    assert aligner() == 3 and aligner.calls == 1 and all(fp8_doubles.transpose_is_current(p) for p in (a, b))


def test_aligner_refresh_is_installed_by_the_one_installer_and_removed_with_it():
    """The aligner's refresh is an ``install_fp8_refresh`` handle (its event: the aligner's call): the handle counts
    the refreshes, and once removed the aligner refreshes nothing."""
    events: list = []
    log = PointLog(events, {"p": ("align",)})
    a, b = (make_fp8_param(log, n, seed=i) for i, n in enumerate(("a", "b")))
    aligner = TransposeAligner([[a], [b]])
    assert isinstance(aligner.handle, Fp8RefreshHandle) and aligner.handle.optimizer is None
    assert len(aligner) == 2 and aligner.plan is aligner.handle.plan
    for p in (a, b):
        fp8_doubles.write_fp8_bytes(p)
    assert aligner() == 2 and aligner.handle.calls == 1 and aligner.handle.last_refreshed == 2
    aligner.remove()
    assert not aligner.handle.active
    for p in (a, b):
        fp8_doubles.write_fp8_bytes(p)
    assert aligner() == 0 and not fp8_doubles.transpose_is_current(a)
    # No FP8 parameter: nothing installed, nothing refreshed.
    plain = TransposeAligner([nn.Linear(2, 2)])
    assert plain.handle is None and plain.plan is None and len(plain) == 0 and plain() == 0


def test_align_rejects_bad_input_clearly():
    with pytest.raises(ValueError, match="model_chunks is None"):
        align_fp8_transposes(None)
    with pytest.raises(ValueError, match="empty"):
        align_fp8_transposes([])
    with pytest.raises(TypeError, match="model_chunks\\[1\\]"):
        align_fp8_transposes([nn.Linear(2, 2), 3])
    with pytest.raises(TypeError, match="yielded a str"):
        align_fp8_transposes([["x"]])


def test_group_barrier_is_refused_inside_a_capture(monkeypatch):
    """A barrier blocks the host: inside a capture it would be recorded as nothing (or hang a replay). Asking the
    alignment for it there is refused, naming the call, even where torch.distributed is not initialised; the refresh
    alone (sync_group=False) stays capturable."""
    import nemo_cudagraph_plugin.fp8.pipeline as pipeline

    monkeypatch.setattr(pipeline, "_is_capturing", lambda: True)
    chunks = [nn.Linear(2, 2)]
    with pytest.raises(RuntimeError, match=r"align_fp8_transposes\(sync_group=True\) cannot run inside a CUDA graph"):
        align_fp8_transposes(chunks, sync_group=True)
    with pytest.raises(RuntimeError, match=r"align_fp8_transposes\(sync_group=True\) cannot run inside a CUDA graph"):
        pipeline.TransposeAligner(chunks, sync_group=True)()
    assert align_fp8_transposes(chunks) == 0 and pipeline.TransposeAligner(chunks)() == 0


def test_sync_without_distributed_is_a_noop():
    assert not dist.is_initialized()
    assert sync_pipeline_group() is False
    aligner = TransposeAligner([nn.Linear(2, 2)], sync_group=True)
    assert aligner() == 0 and aligner.syncs == 0 and aligner.calls == 1


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_timer_first_vs_rest_with_a_clock():
    clock = FakeClock()
    timer = MicrobatchTimer("cpu", clock=clock, rank=3)
    for _step in range(3):
        timer.start_step()
        for mb in range(4):
            for kind, ms in (("fwd", 10.0 if mb else 25.0), ("bwd", 20.0)):
                with timer.record(kind, chunk=0):
                    clock.t += ms / 1000
                with timer.record(kind, mb, chunk=1):  # a second chunk adds to the same microbatch
                    clock.t += 1 / 1000
    rep = timer.report()
    assert rep.rank == 3 and rep.steps == 3 and rep.microbatches == 4 and rep.chunks == 2
    assert rep.first_ms["fwd"] == pytest.approx(26.0) and rep.rest_ms["fwd"] == pytest.approx(11.0)
    assert rep.ratio["bwd"] == pytest.approx(1.0)
    assert rep.ratio["total"] == pytest.approx((26 + 21) / (11 + 21))
    assert "rank 3" in rep.summary() and "ratio" in format_timing_table([rep])
    assert timer.report(skip_steps=2).steps == 1
    assert StageTimingReport.from_dict(json.loads(json.dumps(rep.as_dict()))) == rep
    assert gather_timing_reports(rep) == [rep]


def test_timer_misuse_is_reported():
    timer = MicrobatchTimer("cpu")
    with pytest.raises(ValueError, match="kind"):
        timer.start("forward", 0)
    with pytest.raises(RuntimeError, match="without a matching start"):
        timer.stop("fwd", 0)
    timer.start("fwd", 0)
    with pytest.raises(RuntimeError, match="started twice"):
        timer.start("fwd", 0)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="clock"):
            MicrobatchTimer("cuda", clock=time.perf_counter)
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            MicrobatchTimer("cuda")
    assert MicrobatchTimer("cpu").report().summary().endswith("microbatches")


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.03)
        return g * 2


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(_SlowBackward.apply(x))


def test_timer_attach_times_an_unmodified_schedule():
    stage = _Stage()
    timer = MicrobatchTimer("cpu")
    handle = timer.attach(stage, chunk=0)
    for _step in range(2):
        timer.start_step()
        # A middle stage: its input (received activation) requires grad; warm-up forwards first.
        outs = [stage(torch.randn(2, 4, requires_grad=True)) for _ in range(3)]
        for o in outs:
            o.sum().backward()
    d = timer.durations()
    assert sorted(d) == [0, 1]
    for step in d.values():
        assert sorted(step["fwd"]) == [0, 1, 2] and sorted(step["bwd"]) == [0, 1, 2]
        assert min(step["bwd"].values()) >= 25.0  # the bracket ends when the input gradient is ready
    # A first stage: no input gradient; the backward ends with the parameter gradients.
    timer.start_step()
    outs = [stage(torch.randn(2, 4)) for _ in range(2)]
    for o in outs:
        o.sum().backward()
    assert sorted(timer.durations()[2]["bwd"]) == [0, 1]
    assert timer._open == {}
    handle.remove()
    timer.start_step()
    stage(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert 3 not in timer.durations()
    with pytest.raises(ValueError, match="no trainable parameters"):
        timer.attach(nn.ReLU())


# -- Megatron hooks ------------------------------------------------------------------------------


class _DDPConfig:
    def __init__(self, overlap):
        self.overlap_param_gather = overlap


class FakeMegatronChunk(nn.Module):
    """A Megatron DDP chunk whose parameter all-gather lands new FP8 bytes when it finishes."""

    def __init__(self, overlap: bool, log: list, seed: int = 0):
        super().__init__()
        self.log = log
        plog = PointLog(log, {"p": ()})
        self.w = make_fp8_param(plog, f"c{seed}", seed=seed)
        self.ddp_config = _DDPConfig(overlap)

    def start_param_sync(self, *unused, force_sync=False):
        self.log.append(["param_sync", [], self.w.fp8_name, force_sync])
        fp8_doubles.write_fp8_bytes(self.w)  # the gathered bytes land (Megatron reset the caches before)


def test_megatron_hook_finishes_overlapped_param_gather_before_refresh():
    log: list = []
    chunks = [FakeMegatronChunk(True, log, 0), FakeMegatronChunk(False, log, 1)]
    hook = make_param_sync_hook(chunks)
    assert hook() == 2
    assert log[0] == ["param_sync", [], "c0", True]  # the overlapped all-gather finished first ...
    assert [e[0] for e in log[1:]] == ["transpose", "transpose"]  # ... then every chunk refreshed
    assert all(fp8_doubles.transpose_is_current(c.w) for c in chunks)
    assert hook.alignments == 1 and hook.param_syncs_forced == 1
    with pytest.raises(ValueError, match="overlap_param_gather=True"):
        make_param_sync_hook(chunks, finish_param_sync=False)


def test_megatron_hook_as_param_sync_func():
    log: list = []
    chunks = [FakeMegatronChunk(False, log, i) for i in range(3)]
    config = MegatronLikeConfig()
    previous = config.param_sync_func = object()
    hook = install_param_sync_hook(config, chunks)
    assert config.param_sync_func is hook
    funcs = [config.param_sync_func] * 3  # Megatron broadcasts a single callable to every chunk
    assert funcs[0](chunks[0].parameters()) == 3  # chunk 0's call does all the work
    assert funcs[1](chunks[1].parameters()) == 0 and funcs[2](chunks[2].parameters()) == 0
    assert hook.alignments == 1
    with pytest.raises(ValueError, match="not one of the model chunks"):
        hook(nn.Linear(2, 2).parameters())
    hook.uninstall()
    assert config.param_sync_func is previous
    with pytest.raises(ValueError, match="interleaved"):
        install_param_sync_hook(config, chunks[:1])
    with pytest.raises(TypeError, match="param_sync_func"):
        install_param_sync_hook(object(), chunks)


# -- Lightning callback ----------------------------------------------------------------------------


def _lightning_run(opt_cls, accumulate=1, steps=3, sync_group=False):
    import lightning.pytorch as pl

    from nemo_cudagraph_plugin.integrations.megatron.callbacks import AlignPipelineTransposes

    events: list = []
    point = {"p": ("init",)}
    log = PointLog(events, point)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.chunk = Chunk(0, log, "v0")  # an FP8 double parameter (starts with a valid transpose)
            self.head = nn.Linear(D, 1)

        def training_step(self, batch, batch_idx):
            point["p"] = ("step", batch_idx)
            y = self.chunk.forward_mb(0, batch[0][0])
            self.chunk.backward_mb(0, torch.ones(D))  # needs the transpose (computed here if invalid)
            point["p"] = ("after_training_step", batch_idx)
            return self.head(y).sum()

        def configure_optimizers(self):
            return opt_cls(self.parameters(), lr=0.01)

    module = Module()
    cb = AlignPipelineTransposes(sync_group=sync_group)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, D)), batch_size=1)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        callbacks=[cb],
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    return module, cb, events, log


def test_lightning_callback_refreshes_in_the_optimizer_step():
    # WritingOptimizer (the FP8 helper's double) writes new FP8 bytes + _reset_caches() in its step.
    module, cb, events, log = _lightning_run(fp8_doubles.WritingOptimizer, accumulate=2, steps=3)
    inside = [e for e in events if e[0] == "transpose" and e[1][0] == "step"]
    assert inside == [], f"transposes computed inside training_step: {inside}"
    assert log.count("write", "v0") == 3
    # Every write is followed by exactly one compute before the next training_step: the post-hook refresh.
    kinds = [k for k in log.kinds("v0") if k in ("write", "compute")]
    assert kinds == ["write", "compute"] * 3
    assert cb.refreshes == 3  # once per optimizer step, not once per (accumulated) batch
    assert not cb.fallback and cb._handles == []  # hooks removed at fit end
    assert not any(e[0] == "stale" for e in events)


def test_lightning_callback_check_fails_without_it():
    # The same run without the callback: the check above would catch the lazy transposes.
    import lightning.pytorch as pl

    events: list = []
    point = {"p": ("init",)}
    log = PointLog(events, point)
    chunk = Chunk(0, log, "v0")
    opt = fp8_doubles.WritingOptimizer(chunk.parameters(), lr=0.01)
    for step in range(3):
        point["p"] = ("step", step)
        chunk.forward_mb(0, torch.ones(D))
        chunk.backward_mb(0, torch.ones(D))
        opt.step()
    assert len([e for e in events if e[0] == "transpose" and e[1][0] == "step"]) == 2
    assert pl is not None


class _NoHooks(fp8_doubles.WritingOptimizer):
    def register_step_post_hook(self, hook):  # accepted but never called, like a wrapper that bypasses them
        class H:
            def remove(self):
                pass

        return H()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_callback_falls_back_when_step_hooks_do_not_run(accumulate):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        module, cb, events, log = _lightning_run(_NoHooks, accumulate=accumulate, steps=3)
    assert cb.fallback and any("post-hook never ran" in str(x.message) for x in w)
    # Detected at the end of the first stepping batch, which then refreshes: still before the next one.
    assert [e for e in events if e[0] == "transpose" and e[1][0] == "step"] == []
    assert cb.refreshes == 3  # once per optimizer step, also when batches accumulate


def test_lightning_callback_falls_back_without_register_step_post_hook():
    from types import SimpleNamespace

    from nemo_cudagraph_plugin.integrations.megatron.callbacks import AlignPipelineTransposes

    log = PointLog([], {"p": ()})
    chunks = nn.ModuleList([Chunk(0, log, "v0"), Chunk(1, log, "v1")])  # like NeMo's MegatronParallel
    module = nn.Linear(2, 2)
    trainer = SimpleNamespace(optimizers=[object()], strategy=SimpleNamespace(model=chunks), global_step=0)
    cb = AlignPipelineTransposes()
    with pytest.warns(UserWarning, match="does not support torch step hooks"):
        cb.on_fit_start(trainer, module)
    assert cb.fallback
    # The strategy's chunks (all virtual stages), not the LightningModule.
    assert cb.hook.chunks == list(chunks) and len(cb.aligner.plan) == 2


def test_lightning_callback_warns_without_fp8_and_sync_is_noop():
    import lightning.pytorch as pl

    from nemo_cudagraph_plugin.integrations.megatron.callbacks import AlignPipelineTransposes

    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.lin(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = AlignPipelineTransposes(sync_group=True)
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2)
    with pytest.warns(UserWarning, match="no FP8"):
        trainer.fit(Plain(), data)
    assert cb.refreshes == 2 and cb.syncs == 0  # no process group: nothing to wait for
    assert cb.aligner.last_refreshed == 0


def test_lightning_callback_finishes_overlapped_param_gather_first():
    import lightning.pytorch as pl

    from nemo_cudagraph_plugin.integrations.megatron.callbacks import AlignPipelineTransposes

    log: list = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.chunk = FakeMegatronChunk(True, log, 0)  # a Megatron DDP chunk with overlap_param_gather
            self.head = nn.Linear(D, 1)

        def training_step(self, batch, batch_idx):
            log.append(["training_step", [], ""])
            return self.head(batch[0]).sum()

        def configure_optimizers(self):
            return fp8_doubles.WritingOptimizer(self.parameters(), lr=0.01)

    module = Module()
    cb = AlignPipelineTransposes(model_chunks=[module.chunk])  # NeMo: the MegatronParallel's DDP chunks
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, D)), batch_size=2)
    trainer.fit(module, data)
    seq = [e[0] for e in log]
    # Per step: training_step (inside the optimizer's closure), then the post-hook: the all-gather is
    # finished (new bytes land) and only then the transpose is refreshed.
    assert seq == ["training_step", "param_sync", "transpose"] * 2
    assert fp8_doubles.transpose_is_current(module.chunk.w) and cb.hook.param_syncs_forced == 2
