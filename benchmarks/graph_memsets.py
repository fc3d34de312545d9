"""What the memset nodes of a captured training step cost, and what rewriting them as kernels gains.

What it measures that the harness cannot: the same hand-written whole-step graph with its memset nodes kept and
rewritten as fill kernels, side by side in one process (the harness only runs the plugin's choice).

One process, one preset at a time: two copies of the benchmark GPT (same seed, same batches), each with
its whole step (forward, backward, fused AdamW) captured as a raw ``torch.cuda.CUDAGraph`` — one kept as
captured, one with its memset nodes rewritten as fill kernels (``core._cuda_nodes``). Both replay the same
batches from the same state: their losses must be bitwise equal. Then the two graphs' replays are timed in
alternating windows (ABAB...), the host far ahead (no sync inside a window). Measures; asserts nothing.

    python -m benchmarks.graph_memsets --presets tiny small --out build/graph_memsets
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness.rawstep import capture_raw_step
from nemo_cudagraph_plugin.core import _cuda_nodes

REPO = Path(__file__).resolve().parent.parent


def build(preset: str, steps: int, rewrite: bool) -> dict:
    step = capture_raw_step(preset, steps, keep_graph=True)
    g = step.graph
    print(f"[{preset} rewrite={rewrite}] warm-up and capture ok", flush=True)
    raw = g.raw_cuda_graph()
    nodes_before = _cuda_nodes.node_types(raw)
    res = None
    t = time.perf_counter()
    if rewrite:
        res = _cuda_nodes.rewrite_memsets(raw, torch.cuda.get_device_properties(step.static.device).multi_processor_count)
    rewrite_s = time.perf_counter() - t
    nodes_after = _cuda_nodes.node_types(raw)
    g.instantiate()
    torch.cuda.synchronize()
    step.static.copy_(step.data[3])
    g.replay()
    torch.cuda.synchronize()
    print(f"[{preset} rewrite={rewrite}] capture, rewrite ({res}), replay ok", flush=True)
    # The module and optimizer stay referenced: the graph addresses their parameters and states.
    return {"model": step.model, "opt": step.opt, "params": list(step.model.parameters()), "g": g,
            "static": step.static, "out": step.out, "data": step.data, "losses": step.warmup_losses, "before": nodes_before,
            "after": nodes_after, "replaced": res.replaced if res else 0, "kept": res.kept if res else 0,
            "rewrite_ms": rewrite_s * 1e3}


def replay(x: dict, i: int) -> None:
    x["static"].copy_(x["data"][i % len(x["data"])])
    x["g"].replay()


def run(preset: str, args: argparse.Namespace) -> dict:
    a, b = build(preset, args.steps, False), build(preset, args.steps, not args.control)
    # Correctness: the same batches from the same state.
    la, lb = [], []
    for i in range(3, 3 + args.parity_steps):
        replay(a, i)
        la.append(a["out"].clone())
        if i == 3:
            torch.cuda.synchronize()  # a device assert here is the captured graph's, below the rewritten one's
        replay(b, i)
        lb.append(b["out"].clone())
        if i == 3:
            torch.cuda.synchronize()
    la_t, lb_t = torch.stack(la).float(), torch.stack(lb).float()
    max_diff = float((la_t - lb_t).abs().max())
    params_equal = all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
    # Timing: alternating windows.
    times: dict[str, list[float]] = {"memsets": [], "kernels": []}
    for _ in range(args.windows):
        for name, x in (("memsets", a), ("kernels", b)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(args.window_steps):
                replay(x, i)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) * 1e3 / args.window_steps)
    ms_a, ms_b = statistics.median(times["memsets"]), statistics.median(times["kernels"])
    return {"preset": preset, "nodes_captured": a["before"], "nodes_rewritten": b["after"],
            "replaced": b["replaced"], "kept": b["kept"], "rewrite_ms": b["rewrite_ms"],
            "parity_steps": args.parity_steps, "max_abs_loss_diff": max_diff, "params_equal": params_equal,
            "ms_memsets": ms_a, "ms_kernels": ms_b, "windows_memsets": times["memsets"],
            "windows_kernels": times["kernels"], "saved_us_per_step": (ms_a - ms_b) * 1e3,
            "ratio": ms_b / ms_a}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--steps", type=int, default=64, help="distinct batches (replays cycle through them)")
    p.add_argument("--parity-steps", type=int, default=20)
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--window-steps", type=int, default=100)
    p.add_argument("--control", action="store_true", help="rewrite neither copy (the bench's own check)")
    p.add_argument("--out", type=Path, default=REPO / "build" / "graph_memsets")
    args = p.parse_args()
    why = _cuda_nodes.unavailable()
    if why or not torch.cuda.is_available():
        print(f"graph_memsets: needs CUDA and the driver API ({why or 'no CUDA device'})")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [run(preset, args) for preset in args.presets]
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
           "driver": _cuda_nodes._get().version}
    (args.out / "graph_memsets.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [f"graph_memsets: {env}",
             "| preset | nodes (kernel/memset/other) captured | after rewrite | ms/step memsets | ms/step kernels | "
             "saved µs/step | ratio | max |Δloss| over parity steps |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, w = r["nodes_captured"], r["nodes_rewritten"]
        lines.append(f"| {r['preset']} | {c['kernel']}/{c['memset']}/{c['other']} | {w['kernel']}/{w['memset']}/{w['other']} | "
                     f"{r['ms_memsets']:.4f} | {r['ms_kernels']:.4f} | {r['saved_us_per_step']:.1f} | {r['ratio']:.4f} | "
                     f"{r['max_abs_loss_diff']:.3g} ({r['parity_steps']} steps; parameters equal: {r['params_equal']}) |")
    text = "\n".join(lines)
    (args.out / "graph_memsets.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
