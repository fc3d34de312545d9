"""What the NaN guard's gradient check costs per step on the GPU, alone, on a real model's gradients.

What it measures that the harness cannot: the NaN guard's gradient check alone, captured 20 times in one graph on a
real model's gradients, and its kernel's block sweep (the harness sees the guard only inside whole steps).

    python -m benchmarks.nan_guard --presets tiny small --out DIR     # GPU host; prints a table last

For each preset the recipe GPT (bf16 parameters) runs one forward/backward; then, on those gradients, each
variant is captured 20 times into one CUDA graph and the graph is replayed (CUDA events; no host work is
timed):

* ``foreach`` — the guard before this change: ``torch._foreach_norm(grads, inf)``, ``stack``, ``add_`` into
  the accumulator (one multi-tensor reduction per ~100 tensors plus clean-up kernels);
* ``kernel B/I/W`` — :class:`nemo_cudagraph_plugin.core.finite.FiniteCheck` with ``block=B, iters=I,
  num_warps=W`` (a sweep; the package's default is marked ``*``);
* ``read ceiling`` — ``sum()`` of one contiguous bf16 buffer with the same number of bytes: how fast this GPU
  streams those bytes in one well-shaped reduction.

Reported: µs per check, GB/s over the gradient bytes, and the share of a step of ``--step-ms`` (the preset's
measured step time, given on the command line). Measures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from nemo_cudagraph_plugin.core import finite
from nemo_cudagraph_plugin.core._torch_compat import foreach_max_abs
from recipes.gpt import GPTLightningModule, get_config, gpt_loss

REPS = 20
SWEEP = [(1024, 8, 4), (2048, 4, 4), (2048, 8, 4), (2048, 8, 8), (4096, 4, 8), (4096, 8, 8), (2048, 16, 8),
         (8192, 2, 8), (4096, 16, 8)]


def grads_of(preset: str) -> list[torch.Tensor]:
    cfg = get_config(preset)
    torch.manual_seed(0)
    m = GPTLightningModule(cfg).to("cuda", torch.bfloat16)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), device="cuda")
    gpt_loss(m(x), x).backward()
    return [p.grad for p in m.parameters() if p.grad is not None]


def time_graph(fn, reps: int = REPS, replays: int = 20) -> float:
    """µs per call of ``fn``: ``reps`` calls captured in one graph, replayed ``replays`` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * reps)


def run_preset(preset: str, step_ms: float) -> list[dict]:
    grads = grads_of(preset)
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    acc = torch.zeros(len(grads), device="cuda")
    rows = []

    def foreach() -> None:
        acc.add_(torch.stack(foreach_max_abs(grads)))

    us = time_graph(foreach)
    rows.append({"variant": "foreach (before)", "us": us})
    default = (finite.BLOCK, finite.ITERS, finite.NUM_WARPS)
    for b, i, w in sorted(set(SWEEP) | {default}):
        check = finite.FiniteCheck(grads, list(range(len(grads))), block=b, iters=i, num_warps=w)
        assert check.uses_triton
        us = time_graph(lambda c=check: c.run(acc))
        rows.append({"variant": f"kernel {b}/{i}/{w}" + (" *" if (b, i, w) == default else ""), "us": us})
    flat = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros((), device="cuda", dtype=torch.float32)
    rows.append({"variant": "read ceiling (one sum)", "us": time_graph(lambda: out.copy_(flat.sum()))})
    # correctness of the default on these gradients: a NaN planted in the largest gradient is found there
    acc.zero_()
    big = max(range(len(grads)), key=lambda k: grads[k].numel())
    grads[big].view(-1)[-1] = float("nan")
    finite.FiniteCheck(grads, list(range(len(grads)))).run(acc)
    found = acc.nonzero().flatten().tolist()
    for r in rows:
        r.update(preset=preset, tensors=len(grads), mib=nbytes / 2**20, gbps=nbytes / (r["us"] * 1e-6) / 1e9,
                 share_of_step=r["us"] * 1e-3 / step_ms if step_ms else None, planted_nan_found=found == [big])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--step-ms", nargs="+", type=float, default=[0.708, 4.75],
                   help="step time per preset for the share column (default: NeMo's measured step)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if not finite.triton_available():
        print("nan_guard benchmark: needs CUDA and Triton", file=sys.stderr)
        return 2
    rows = []
    for preset, ms in zip(a.presets, a.step_ms + [0.0] * len(a.presets)):
        rows += run_preset(preset, ms)
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    lines = [f"{'preset':<6} {'variant':<24} {'us':>8} {'GB/s':>7} {'share':>7}  (tensors, MiB)"]
    for r in rows:
        share = f"{100 * r['share_of_step']:.2f}%" if r["share_of_step"] else "-"
        lines.append(f"{r['preset']:<6} {r['variant']:<24} {r['us']:8.1f} {r['gbps']:7.0f} {share:>7}  "
                     f"({r['tensors']}, {r['mib']:.1f}){'' if r['planted_nan_found'] else '  PLANTED NaN NOT FOUND'}")
    table = "\n".join(lines)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "nan_guard.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(env)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
