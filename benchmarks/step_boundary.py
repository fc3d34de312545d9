"""What the device spends at the boundary of a replayed step: the launches around the graph.

What it measures that the harness cannot: the device cost of each launch around a replayed graph (input copies,
output copies, stream waits, copy nodes inside the graph), one by one.

A replayed step is more than ``graph.replay()``: the batch is copied into the graph's input buffers before it, the
outputs into fresh memory after it, and the training stream waits for the batch's copy on the transfer stream. Each
is a launch of its own on the training stream, outside the graph. This measures what each costs the *device*, with
the host far ahead (the step device-bound), on the benchmark GPT's whole step captured as one graph with its memsets
rewritten as kernels (``benchmarks/harness/rawstep.py``, ``core._cuda_nodes``): the cheapest graph of that
step we know. Variants, timed in alternating windows (ABCD...), one process:

    graph      replay only (the batch already in the input buffer)
    in         + the batch copied into the input buffers (``_foreach_copy_``, two leaves, as the engine does)
    in_out     + the outputs copied into fresh memory after the replay (``empty_like`` x2 + ``_foreach_copy_``)
    routed     + the batch copied host-to-device on a transfer stream first, the training stream waiting on its event
    io_nodes   the batch in and the outputs out by copy kernel nodes inside the graph, their addresses set before
               each replay (``core._cuda_nodes.GraphIO``): what ``in_out`` does without a launch of its own
    extra_k    ``graph`` + k tiny kernels launched before each replay (what one more launch on the stream costs)

Before timing, the ``io_nodes`` graph (a second copy of the model, same seed) is checked against the plain one on the
same batches: bitwise equal losses, with the batch read from 16-byte aligned memory and from memory 8 bytes off.

Measures; asserts nothing.

    python -m benchmarks.step_boundary --preset tiny --out build/step_boundary
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=64, help="distinct batches (replays cycle through them)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-steps", type=int, default=300)
    p.add_argument("--extra", type=int, nargs="*", default=[1, 4])
    p.add_argument("--out", type=Path, default=REPO / "build" / "step_boundary")
    args = p.parse_args()
    why = _cuda_nodes.unavailable()
    if why or not torch.cuda.is_available():
        print(f"step_boundary: needs CUDA and the driver API ({why or 'no CUDA device'})")
        return 2
    raw = capture_raw_step(args.preset, args.steps, keep_graph=True)
    dev = raw.static.device
    res = _cuda_nodes.rewrite_memsets(raw.graph.raw_cuda_graph(), torch.cuda.get_device_properties(dev).multi_processor_count)
    raw.graph.instantiate()
    g, static, data, out = raw.graph, raw.static, raw.data, raw.out
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    raw_io = capture_raw_step(args.preset, args.steps, keep_graph=True)
    _cuda_nodes.rewrite_memsets(raw_io.graph.raw_cuda_graph(), sms)
    nbytes = static.numel() * static.element_size()
    io = _cuda_nodes.GraphIO(raw_io.graph.raw_cuda_graph(), [(raw_io.static.data_ptr(), nbytes)] * 2,
                             [(raw_io.out.data_ptr(), raw_io.out.numel() * raw_io.out.element_size())] * 2, sms)
    raw_io.graph.instantiate()
    io.instantiated(raw_io.graph.raw_cuda_graph_exec())
    # Parity: the same batches through both graphs (steps 3..12), the second half read from memory 8 bytes off.
    parity = []
    for i in range(3, 13):
        static.copy_(data[i])
        g.replay()
        if i < 8:
            src = data[i]
        else:
            buf = torch.empty(data[i].numel() + 1, dtype=data.dtype, device=dev)
            src = buf[1:].view_as(data[i])
            src.copy_(data[i])
        fresh = [torch.empty_like(raw_io.out) for _ in range(2)]
        io.bind([src.data_ptr(), src.data_ptr()], [f.data_ptr() for f in fresh])
        raw_io.graph.replay()
        torch.cuda.synchronize()
        parity.append((float(out), float(fresh[0]), float(fresh[1]), src.data_ptr() % 16))
    parity_ok = all(a == b == c for a, b, c, _ in parity)
    print(f"io_nodes parity (plain loss, io loss x2, src address % 16): ok={parity_ok} {parity}", flush=True)
    main_s = torch.cuda.current_stream()
    xfer = torch.cuda.Stream()
    copied = torch.cuda.Event()
    # Two input leaves as the Lightning batch has (input_ids, labels): the second is a same-sized stand-in buffer.
    static2 = torch.empty_like(static)
    srcs = [(data[i], data[i].clone()) for i in range(len(data))]
    host = [data[i].cpu().pin_memory() for i in range(len(data))]
    tiny = torch.zeros(1, device=dev)
    outs = [out, out.clone()]  # the loss and a logged value

    def v_graph(i: int) -> None:
        g.replay()

    def v_in(i: int) -> None:
        a, b = srcs[i % len(srcs)]
        torch._foreach_copy_([static, static2], [a, b], non_blocking=True)
        g.replay()

    def v_in_out(i: int) -> list:
        v_in(i)
        fresh = [torch.empty_like(t) for t in outs]
        torch._foreach_copy_(fresh, outs, non_blocking=True)
        return fresh

    def v_routed(i: int) -> list:
        torch.cuda.set_stream(xfer)
        try:
            a = host[i % len(host)].to(dev, non_blocking=True)
            copied.record(xfer)
        finally:
            torch.cuda.set_stream(main_s)
        main_s.wait_event(copied)
        a.record_stream(main_s)
        torch._foreach_copy_([static, static2], [a, a], non_blocking=True)
        g.replay()
        fresh = [torch.empty_like(t) for t in outs]
        torch._foreach_copy_(fresh, outs, non_blocking=True)
        return fresh

    def v_io(i: int) -> list:
        a, b = srcs[i % len(srcs)]
        fresh = [torch.empty_like(t) for t in outs]
        io.bind([a.data_ptr(), b.data_ptr()], [f.data_ptr() for f in fresh])
        raw_io.graph.replay()
        return fresh

    def extra(k: int):
        def v(i: int) -> None:
            for _ in range(k):
                tiny.add_(1.0)
            g.replay()
        return v

    variants = {"graph": v_graph, "in": v_in, "in_out": v_in_out, "routed": v_routed, "io_nodes": v_io}
    variants.update({f"extra_{k}": extra(k) for k in args.extra})
    for fn in variants.values():  # warm every path (allocator, pinned copies)
        for i in range(5):
            fn(i)
    torch.cuda.synchronize()
    dev_ms: dict[str, list[float]] = {k: [] for k in variants}
    host_us: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.windows):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(args.window_steps):
                fn(i)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            dev_ms[name].append((t2 - t0) * 1e3 / args.window_steps)
            host_us[name].append((t1 - t0) * 1e6 / args.window_steps)
    base = statistics.median(dev_ms["graph"])
    rows = []
    for name in variants:
        ms = statistics.median(dev_ms[name])
        hu = statistics.median(host_us[name])
        rows.append({"variant": name, "ms_per_step": ms, "over_graph_us": (ms - base) * 1e3, "host_us_per_step": hu,
                     "device_bound": hu < ms * 1e3 * 0.9, "windows_ms": dev_ms[name]})
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
           "preset": args.preset, "memsets_rewritten": res.replaced, "window_steps": args.window_steps,
           "windows": args.windows, "io_parity_ok": parity_ok, "io_parity": parity}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_boundary.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [f"step_boundary: {env}", "| variant | ms/step (median of windows) | over `graph` µs | host µs/step | device-bound |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['ms_per_step']:.4f} | {r['over_graph_us']:+.1f} | {r['host_us_per_step']:.0f} | "
                     f"{'yes' if r['device_bound'] else 'NO'} |")
    text = "\n".join(lines)
    (args.out / "step_boundary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
