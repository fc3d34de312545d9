"""Where a host-bound replayed step's host time goes, section by section, on the GPU host.

What it measures that the harness cannot: the host time of a replayed step split into its sections. The harness
times whole steps; cProfile adds a per-call cost that inflates Python-heavy sections. This script times the
sections themselves with ``time.perf_counter_ns`` around them (about 0.1 µs per timer), in one process, on the GPT
tiny workload where the step is host-bound (``CudaGraphCallback()``, bf16 parameters, fused AdamW, no schedule):

* the runner's step (``loop.run``) and inside it: the step key, ``engine.step`` (its guards, batch flatten and
  signature, cache lookup, input copy, replay, progress counters, output copy or, with ``io_in_graph``, the binding
  of the graph's copy nodes, the rest), the re-emitted logs
  (``fast_log``), the rest (NaN guard bookkeeping);
* between steps (Lightning's loop) and inside it: the routed batch transfer;
* then primitives alone, each timed over many calls: the launches a step makes (``copy_`` and ``_foreach_copy_``
  of the batch, ``empty_like``, a bf16 -> fp32 conversion, stream switches and waits, an event record), so a
  section's cost can be read as launches plus Python.

Only this diagnostic process wraps anything (instance attributes, and two module functions of the engine); the
product is not changed. Measures, never asserts::

    python -m benchmarks.host_sections --steps 300 --from 100 --out /tmp/hs
    python -m benchmarks.host_sections --io-in-graph 1 0 1 0 --n 500   # both ways, alternating, one process
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.harness.models import BenchLM, token_loader
from benchmarks.harness.workloads import WORKLOADS
from nemo_cudagraph_plugin import CudaGraphCallback
from nemo_cudagraph_plugin.core import engine as engine_mod
from nemo_cudagraph_plugin.lightning import _compat

_ns = time.perf_counter_ns


class Sections:
    """Per-step sums of named sections, kept for the steps of the window."""

    def __init__(self) -> None:
        self.on = False
        self.cur: dict[str, int] = {}
        self.steps: list[dict[str, int]] = []

    def add(self, name: str, ns: int) -> None:
        if self.on:
            self.cur[name] = self.cur.get(name, 0) + ns

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t = _ns()
            try:
                return fn(*a, **k)
            finally:
                self.add(name, _ns() - t)

        return timed

    def end_step(self) -> None:
        if self.on and self.cur:
            self.steps.append(self.cur)
        self.cur = {}

    def medians(self) -> dict[str, float]:
        names = sorted({n for s in self.steps for n in s})
        return {n: statistics.median(s.get(n, 0) for s in self.steps) / 1e3 for n in names}


class Instrument(pl.Callback):
    """Wraps the runner's pieces once it is bound (after CudaGraphCallback.on_train_start)."""

    def __init__(self, cb: CudaGraphCallback, sec: Sections, first: int, last: int) -> None:
        self.cb, self.sec, self.first, self.last = cb, sec, first, last
        self.step = 0
        self._end = 0
        # Each window step's start: host clock, and an event on the training stream (the device's clock).
        self.host_starts: list[int] = []
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(last - first + 1)]
        self.transfer: dict[str, float] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx == self.first - 10:  # the batch transfer alone, routed and Lightning's own, in the loop
            self.transfer = transfer_costs(trainer, batch)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sec, runner = self.sec, self.cb.step_runner
        adapter, loop = runner.adapter, runner._loop
        engine = adapter.engine
        engine.guards[:] = [sec.wrap(f"engine: guard {i} ({g.__name__})", g) for i, g in enumerate(engine.guards)]
        engine.cache.get = sec.wrap("engine: cache lookup", engine.cache.get)
        engine_mod.flatten = sec.wrap("engine: batch flatten", engine_mod.flatten)
        engine_mod.signature_of = sec.wrap("engine: signature", engine_mod.signature_of)
        engine.step = sec.wrap("engine.step (all)", engine.step)
        # The engine asks its adapter for these when it needs them: wrapped on the adapter.
        if adapter.after_replay is not None:
            adapter.after_replay = sec.wrap("engine: progress counters", adapter.after_replay)
        on_capture = adapter.on_capture

        def captured(entry: Any) -> None:
            on_capture(entry)
            entry.inputs.copy_from = sec.wrap("engine: input copy", entry.inputs.copy_from)
            entry.graph.replay = sec.wrap("engine: graph.replay", entry.graph.replay)
            entry.outputs = sec.wrap("engine: output copy", entry.outputs)
            if entry.io is not None:  # io_in_graph: the graph copies; the host points its nodes at the tensors
                entry.io.bind = sec.wrap("engine: io bind (batch in, outputs out)", entry.io.bind)

        adapter.on_capture = captured
        adapter.logs.emit = sec.wrap("run: logs.emit (all)", adapter.logs.emit)
        _compat.fast_log = sec.wrap("run: fast_log", _compat.fast_log)
        _compat.step_key = sec.wrap("run: step key", _compat.step_key)
        strategy = trainer.strategy
        strategy.batch_to_device = sec.wrap("between: batch transfer (routed)", strategy.batch_to_device)
        run = loop.run

        def timed_run(*a: Any, **k: Any) -> Any:
            t = _ns()
            if self._end:
                sec.add("between steps (all)", t - self._end)
            sec.end_step()
            self.step += 1
            sec.on = self.first <= self.step < self.last
            if sec.on or self.step == self.last:
                self.host_starts.append(t)
                self.events[len(self.host_starts) - 1].record()
            out = run(*a, **k)
            self._end = _ns()
            sec.add("run (all)", self._end - t)
            return out

        loop.run = timed_run


def transfer_costs(trainer: pl.Trainer, batch: Any, n: int = 300) -> dict[str, float]:
    """Host µs per ``strategy.batch_to_device`` of a pinned copy of this batch: as routed now, and Lightning's own."""
    strategy = trainer.strategy
    cpu = {k: v.cpu().pin_memory() for k, v in batch.items()}
    routed = strategy.batch_to_device
    own = type(strategy).batch_to_device.__get__(strategy)
    out = {}
    for name, fn in (("routed", routed), ("lightning", own), ("routed ", routed), ("lightning ", own)):
        torch.cuda.synchronize()
        t = _ns()
        for _ in range(n):
            fn(cpu)
        out[name.strip()] = (_ns() - t) / n / 1e3  # the second pass of each is kept
        torch.cuda.synchronize()
    return out


def primitives(n: int) -> dict[str, float]:
    """Host µs per call of the launches a replayed tiny step makes, each alone (the device is idle or nearly)."""
    dev = torch.device("cuda")
    ids = torch.randint(0, 100, (2, 256), device=dev)
    lab = torch.randint(0, 100, (2, 256), device=dev)
    sids, slab = torch.empty_like(ids), torch.empty_like(lab)
    cpu = [torch.randint(0, 100, (2, 256)).pin_memory() for _ in range(2)]
    loss = torch.tensor(1.5, device=dev, dtype=torch.bfloat16)
    f32 = torch.tensor(1.5, device=dev)
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    ev = torch.cuda.Event()
    cases: dict[str, Callable[[], Any]] = {
        "copy_ x2 (batch into static buffers)": lambda: (sids.copy_(ids, non_blocking=True),
                                                         slab.copy_(lab, non_blocking=True)),
        "_foreach_copy_ of 2": lambda: torch._foreach_copy_([sids, slab], [ids, lab], non_blocking=True),
        "empty_like x2 (scalar)": lambda: (torch.empty_like(f32), torch.empty_like(f32)),
        "_foreach_copy_ of 2 scalars": lambda: torch._foreach_copy_([f32, f32], [loss.float(), f32]),
        "bf16 scalar .to(float32)": lambda: loss.to(torch.float32),
        "pinned H2D .to(cuda, non_blocking) x2": lambda: [c.to(dev, non_blocking=True) for c in cpu],
        "with torch.cuda.stream(side): pass": lambda: _enter_exit(side),
        "main.wait_stream(side)": lambda: main.wait_stream(side),
        "ev.record(side); main.wait_event(ev)": lambda: (ev.record(side), main.wait_event(ev)),
        "t.record_stream(main) x2": lambda: (ids.record_stream(main), lab.record_stream(main)),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
    }
    out = {}
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t = _ns()
            for _ in range(n):
                fn()
            best = min(best, (_ns() - t) / n / 1e3)
            torch.cuda.synchronize()
        out[name] = best
    return out


def _enter_exit(s: Any) -> None:
    with torch.cuda.stream(s):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--from", dest="first", type=int, default=100)
    ap.add_argument("--n", type=int, default=2000, help="calls per primitive")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--io-in-graph", type=int, nargs="+", default=[1], choices=[0, 1],
                    help="one fit per value, in this order, in this process (CudaGraphCallback(io_in_graph=...)): "
                         "sections of different fits compare within one process (the host's speed differs between "
                         "processes)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/host_sections.py needs a CUDA GPU")
        return 2
    fits = [_fit(args, bool(io)) for io in args.io_in_graph]
    prim = primitives(args.n)
    names = sorted({k for f in fits for k in f["sections_us"]})
    head = [f"io_in_graph={int(f['io_in_graph'])}" for f in fits]
    lines = [f"host sections, {args.preset}, steps {args.first}-{args.steps - 2}, median µs per step, one column per "
             f"fit in this process ({', '.join(head)})"]

    def row(field: str, key: str, label: str = "") -> str:
        vals = "  ".join(f"{f[field].get(key, float('nan')):8.1f}" for f in fits)
        return f"  {vals}  {label or key}"

    lines += [row("sections_us", k) for k in names]
    for f in fits:
        f["sections_us"]["run + between (one step)"] = (f["sections_us"].get("run (all)", 0)
                                                        + f["sections_us"].get("between steps (all)", 0))
    lines.append(row("sections_us", "run + between (one step)"))
    lines.append("step period, µs (host: run start to run start; device: an event at each run start):")
    lines += [row("periods_us", k) for k in fits[0]["periods_us"]]
    lines.append("batch transfer alone, host µs per call (pinned batch, inside the fit):")
    lines += [row("transfer_us", k) for k in fits[0]["transfer_us"]]
    lines += [f"  fit {i}: {f['summary']}" for i, f in enumerate(fits)]
    lines.append(f"primitives, host µs per call (best of 5 x {args.n}):")
    lines += [f"  {v:8.2f}  {k}" for k, v in prim.items()]
    text = "\n".join(lines)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_sections.json").write_text(json.dumps(
            {"preset": args.preset, "fits": fits, "primitives_us": prim,
             "torch": torch.__version__, "lightning": pl.__version__, "gpu": torch.cuda.get_device_name()},
            indent=1))
        (args.out / "host_sections.txt").write_text(text + "\n")
    print(text)
    return 0


def _fit(args: argparse.Namespace, io_in_graph: bool) -> dict:
    """One instrumented fit of the preset; its section medians, step periods and transfer costs."""
    w = replace(WORKLOADS[f"gpt-{args.preset}"], steps=args.steps)
    pl.seed_everything(0, verbose=False)
    module = BenchLM(w, optim="fused_adamw", schedule=False)
    sec = Sections()
    cb = CudaGraphCallback(io_in_graph=io_in_graph)
    inst = Instrument(cb, sec, args.first, args.steps - 1)
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-true", max_steps=args.steps,
                         callbacks=[cb, inst], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    t = _ns()
    trainer.fit(module, train_dataloaders=token_loader(w, args.steps, seed=0, pin=True))
    torch.cuda.synchronize()
    wall = (_ns() - t) / 1e9
    hp = [(b - a) / 1e3 for a, b in zip(inst.host_starts, inst.host_starts[1:])]
    ev = inst.events[:len(inst.host_starts)]
    dp = [a.elapsed_time(b) * 1e3 for a, b in zip(ev, ev[1:])]
    periods = {"host period, median": statistics.median(hp), "host period, mean": statistics.fmean(hp),
               "device period (events), median": statistics.median(dp),
               "device period (events), mean": statistics.fmean(dp)}
    return {"io_in_graph": io_in_graph, "steps": len(sec.steps), "wall_s": wall, "sections_us": sec.medians(),
            "periods_us": periods, "transfer_us": inst.transfer, "summary": cb.stats.summary(),
            "io_graphs": cb.stats.graphs_with_io_nodes}


if __name__ == "__main__":
    raise SystemExit(main())
