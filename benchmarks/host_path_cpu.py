"""Host time of a replayed step on a CPU-only machine: the per-step Python that no graph removes.

What it measures that the harness cannot: the host path alone, free of the GPU, per variant and in machine
instructions. On a small model the GPU finishes a replayed step before the host has issued the next one (the GPT
"tiny" workload of ``python -m benchmarks.harness``), so the step time is the host path: Lightning's loop, the runner, the
engine's key and address checks, the input copy, the output clone, the re-emitted ``self.log`` calls
and the NaN guard's bookkeeping. This script runs that path on the CPU with a stand-in backend whose
replay does nothing, so what is timed is exactly the host path (the recipe's GPT, tiny preset: its 52
parameters are scanned per replay like on the GPU; its widths are cut, which the host path does not see)::

    python -m benchmarks.host_path_cpu                      # every variant, 3 rounds, a table
    python -m benchmarks.host_path_cpu --variants callback --profile 30   # cProfile, top 30 by own time

Variants:

* ``callback``: ``CudaGraphCallback()`` (NaN guard on), the module logs ``train_loss``;
* ``noguard``: ``CudaGraphCallback(nan_guard=False)``;
* ``nolog``: ``CudaGraphCallback()`` with a module that calls no ``self.log``;
* ``floor``: Lightning's loop with ``automatic_optimization.run`` answered by a stored output (no
  plugin at all): what Lightning itself costs per step, the least any callback can reach.

A shared CPU's speed drifts by tens of percent from second to second, so wall time needs many rounds (the
least round is reported). ``--instructions`` counts instead: each variant runs under valgrind's callgrind with
counting switched on over the timed steps only (a 3-line C helper compiled here with the machine's gcc and
valgrind headers), and the table gives machine instructions per step, the same in every run::

    python -m benchmarks.host_path_cpu --instructions --steps 150 --skip 50

Measures, never asserts. The figures are this machine's; compare variants of one run as ratios. The CPU
tensors copied per replay here are host memory, so the input copy is cheaper than a real host-to-device
launch; everything else is the same Python the GPU host runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import cProfile
import ctypes
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from benchmarks.harness.models import BenchLM, token_loader
from benchmarks.harness.workloads import WORKLOADS, Workload
from nemo_cudagraph_plugin import CudaGraphCallback
from nemo_cudagraph_plugin.core.backend import GraphBackend

REPO = Path(__file__).resolve().parents[1]

VARIANTS = ("floor", "callback", "noguard", "nolog")


class _NoopGraph:
    def replay(self) -> None:  # the device work is what this script leaves out
        pass

    def register_generator_state(self, gen: Any) -> None:
        pass


class NoopReplayBackend(GraphBackend):
    """Capture runs the step once, eagerly; a replay does nothing (host path only)."""

    device_type = "cpu"

    def new_graph(self) -> _NoopGraph:
        return _NoopGraph()

    def pool(self) -> None:
        return None

    def capture(self, graph: Any, pool: Any, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def side_stream(self, device: torch.device) -> Any:
        return _NullStream()

    def current_stream(self, device: torch.device) -> Any:
        return _NullStream()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def sync_errors(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def rng_state(self, device: torch.device) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: Any, device: torch.device) -> None:
        torch.set_rng_state(state)


class _NullStream:
    def wait_stream(self, other: Any) -> None:
        pass


class _Timer(pl.Callback):
    """Wall time per step (batch start to next batch start) after ``skip`` steps; cProfile or callgrind optional."""

    def __init__(self, skip: int, prof: Optional[cProfile.Profile], counter: Any = None) -> None:
        self.skip, self.prof, self.counter = skip, prof, counter
        self.t: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx >= self.skip:
            self.t.append(time.perf_counter())
            if batch_idx == self.skip:
                if self.prof is not None:
                    self.prof.enable()
                if self.counter is not None:
                    self.counter.cg_start()

    def on_train_end(self, trainer, pl_module):
        if self.counter is not None:
            self.counter.cg_stop()
        self.t.append(time.perf_counter())
        if self.prof is not None:
            self.prof.disable()


_TOGGLE_C = """#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""


def _toggle_lib(tmp: Path) -> Path:
    """Compile the callgrind on/off helper (valgrind's client-request macros have no Python binding)."""
    src, lib = tmp / "cgtoggle.c", tmp / "libcgtoggle.so"
    src.write_text(_TOGGLE_C)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def instructions(variant: str, steps: int, skip: int, tmp: Path, lib: Path) -> float:
    """Machine instructions per replayed step of ``variant``, counted by callgrind over steps ``skip``..``steps``."""
    out = tmp / f"cg.{variant}"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
           sys.executable, "-m", "benchmarks.host_path_cpu", "--child", variant, "--steps", str(steps), "--skip",
           str(skip)]
    env = dict(os.environ, HOST_PATH_CG_LIB=str(lib))
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{variant}: valgrind exited {r.returncode}:\n{r.stderr[-3000:]}")
    return read_totals(tmp, variant) / (steps - skip)


def read_totals(folder: Path, variant: str) -> int:
    """Instructions in ``variant``'s callgrind files: the dump at ``cg_stop`` and an empty one at exit. A dump's
    ``summary:`` line comes first and is 0; its ``totals:`` line holds the count."""
    total = 0
    for f in folder.glob(f"cg.{variant}*"):
        m = re.search(r"^totals: (\d+)", f.read_text(errors="replace"), re.M)
        total += int(m.group(1)) if m else 0
    return total


def _workload(steps: int) -> Workload:
    # The tiny preset's layers and parameters (52, each scanned per replay), with small widths: the host path does
    # not depend on them, and the eager warm-up steps are then quick (under valgrind too).
    return replace(WORKLOADS["gpt-tiny"], hidden=64, heads=2, kv_heads=2, seq=32, vocab=512, steps=steps)


def _module(steps: int, log: bool) -> pl.LightningModule:
    # the harness's module on the GPT, with a fused AdamW and no schedule: nothing but the step on the host path
    return BenchLM(_workload(steps), optim="fused_adamw", schedule=False, log=log)


class StoredRun(pl.Callback):
    """``floor``: steps 0 and 1 train eagerly; from step 2 ``automatic_optimization.run`` returns step 1's output and
    advances Lightning's progress counters as that step did. What remains per step is Lightning's loop: fetch,
    collate, transfer, hooks, counters."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx != 1:
            return
        from nemo_cudagraph_plugin.lightning import _compat

        loop = _compat.automatic_loop(trainer)
        orig = loop.run

        def first(optimizer, batch_idx, kwargs):
            before = _compat.progress_snapshot(loop)
            out = orig(optimizer, batch_idx, kwargs)
            delta = _compat.ProgressDelta(before, _compat.progress_snapshot(loop))
            loss = out["loss"].detach()

            def stored(optimizer, batch_idx, kwargs):
                delta.apply()
                return OrderedDict(loss=torch.empty_like(loss))

            loop.run = stored
            return OrderedDict(loss=loss)

        loop.run = first


def run(variant: str, steps: int, skip: int, prof: Optional[cProfile.Profile] = None,
        counter: Any = None) -> dict[str, float]:
    torch.manual_seed(0)
    module = _module(steps, log=variant != "nolog")
    timer = _Timer(skip, prof, counter)
    callbacks: list[pl.Callback] = []
    if variant == "floor":
        callbacks.append(StoredRun())
    else:
        cb = CudaGraphCallback(nan_guard=variant != "noguard", warmup_steps=2)
        cb.step_runner.backend = NoopReplayBackend()
        callbacks.append(cb)
    # One epoch holds exactly `steps` batches: a loop whose global_step stood still would end there, not run on.
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=1, callbacks=[*callbacks, timer],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=token_loader(_workload(steps), steps, seed=0, pin=False))
    if trainer.global_step != steps:
        raise RuntimeError(f"{variant}: global_step {trainer.global_step} after {steps} batches")
    if variant != "floor":
        st = callbacks[0].stats
        if st.replays < steps - skip - 1:
            raise RuntimeError(f"{variant}: only {st.replays} replays in {steps} steps")
    d = [b - a for a, b in zip(timer.t, timer.t[1:])]
    return {"median_us": statistics.median(d) * 1e6, "mean_us": statistics.fmean(d) * 1e6}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--skip", type=int, default=100, help="steps before timing starts")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile the first variant, print top N")
    ap.add_argument("--instructions", action="store_true", help="count instructions per step under callgrind")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant under callgrind
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.child:
        run(args.child, args.steps, args.skip, counter=ctypes.CDLL(os.environ["HOST_PATH_CG_LIB"]))
        return 0
    if args.instructions:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            lib = _toggle_lib(tmp)
            with cf.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one valgrind process per core
                futs = {v: pool.submit(instructions, v, args.steps, args.skip, tmp, lib) for v in args.variants}
                counts = {v: f.result() for v, f in futs.items()}
        base = counts.get("floor")
        print(f"\nhost instructions per replayed step (callgrind, steps {args.skip}..{args.steps})")
        print("| variant | instructions per step | over floor's |")
        print("|---|---|---|")
        for v, n in counts.items():
            print(f"| {v} | {n / 1e3:.1f} k | {'-' if base is None else f'{(n - base) / 1e3:+.1f} k'} |")
        return 0
    if args.profile:
        prof = cProfile.Profile()
        run(args.variants[0], args.steps, args.skip, prof)
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(args.profile)
        return 0
    rows: dict[str, list[float]] = {v: [] for v in args.variants}
    for _ in range(args.rounds):
        for v in args.variants:
            rows[v].append(run(v, args.steps, args.skip)["median_us"])
    # A shared CPU's speed drifts by tens of percent between seconds: the least round of a variant is its
    # least-disturbed one, and the rounds alternate the variants so drift hits all alike.
    base = min(rows["floor"]) if "floor" in rows else None
    print(f"\nhost time per replayed step, CPU, median of steps {args.skip}..{args.steps} per round (µs), "
          f"{args.rounds} rounds")
    print("| variant | per round | least | least over floor's |")
    print("|---|---|---|---|")
    for v, xs in rows.items():
        m = min(xs)
        over = f"{m - base:+.1f}" if base is not None else "-"
        print(f"| {v} | {' / '.join(f'{x:.1f}' for x in xs)} | {m:.1f} | {over} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
