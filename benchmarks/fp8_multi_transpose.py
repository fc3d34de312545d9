"""One-launch FP8 transpose refresh vs one kernel per weight, on the weight shapes of the recipe GPT presets.

What it measures that the harness cannot: the FP8 transpose refresh's kernels alone, one launch against one per
weight, replayed in a graph on the presets' weight shapes.

    python -m benchmarks.fp8_multi_transpose --out multi_transpose.json      (GPU; no TransformerEngine needed)

For each preset, the FP8 weights of its ``te.TransformerLayer`` blocks (per layer: QKV ``[3d, d]``,
projection ``[d, d]``, FC1 ``[4d, d]``, FC2 ``[d, 4d]``) as uint8 buffers; every method runs inside a CUDA
graph (as the refresh does under the plugin), replayed ``--replays`` times per sample, median of
``--samples``. Methods: ``per-tensor copy`` (one torch transpose-copy kernel per weight: the launch
pattern of TE's ``_create_transpose()`` loop) and ``fused MxK/Ww`` (``MultiTranspose`` with an M x K byte tile
and W warps per program).
Every method's bytes are checked against torch's transpose first. Reported: microseconds per refresh
and the effective bandwidth (bytes read + written).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from nemo_cudagraph_plugin.fp8._multi_transpose import MultiTranspose, triton_available
from recipes.gpt import get_config

PRESETS = ("tiny", "small", "medium")
TILES = ((32, 64, 1), (64, 64, 4), (16, 256, 4))  # (block_m, block_k, num_warps); the first is the default


def weight_shapes(preset: str) -> list[tuple[int, int]]:
    cfg = get_config(preset)
    d, f = cfg.n_embd, cfg.mlp_ratio * cfg.n_embd
    return [s for _ in range(cfg.n_layer) for s in ((3 * d, d), (d, d), (f, d), (d, f))]


def graph_of(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``fn`` run once eagerly on a side stream (warm-up, set-up), then captured into a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_replays(g: torch.cuda.CUDAGraph, replays: int, samples: int) -> float:
    """Median microseconds per replay over ``samples`` runs of ``replays`` (after one settling run)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(samples + 1):
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / replays)
    return statistics.median(out[1:])


def measure(preset: str, replays: int, samples: int) -> dict[str, Any]:
    shapes = weight_shapes(preset)
    srcs = [torch.randint(0, 256, s, dtype=torch.uint8, device="cuda") for s in shapes]
    dsts = [torch.empty(k, m, dtype=torch.uint8, device="cuda") for m, k in shapes]
    nbytes = 2 * sum(s.numel() for s in srcs)

    def per_tensor() -> None:
        for s, d in zip(srcs, dsts):
            d.copy_(s.t())

    methods: dict[str, Callable[[], None]] = {"per-tensor copy": per_tensor}
    for bm, bk, nw in TILES:
        methods[f"fused {bm}x{bk}/{nw}w"] = MultiTranspose(list(zip(srcs, dsts)), block_m=bm, block_k=bk, num_warps=nw).run
    rows = {}
    for name, fn in methods.items():
        for d in dsts:
            d.zero_()
        fn()
        torch.cuda.synchronize()
        ok = all(torch.equal(d, s.t()) for s, d in zip(srcs, dsts))
        us = time_replays(graph_of(fn), replays, samples)
        rows[name] = {"us": us, "GBps": nbytes / us / 1e3, "bytes_equal": ok}
    return {"preset": preset, "weights": len(shapes), "MiB": nbytes / 2 / 2**20, "methods": rows}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if not triton_available():
        print("needs CUDA and Triton")
        return 2
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "results": [measure(ps, a.replays, a.samples) for ps in a.presets]}
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    print(f"{'preset':<8} {'weights':>7} {'MiB':>6}  " + "  ".join(f"{m:>22}" for m in res["results"][0]["methods"]))
    for r in res["results"]:
        cells = [f"{v['us']:8.1f} us {v['GBps']:6.0f} GB/s{'' if v['bytes_equal'] else ' BAD'}" for v in r["methods"].values()]
        print(f"{r['preset']:<8} {r['weights']:>7} {r['MiB']:>6.0f}  " + "  ".join(f"{c:>22}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
