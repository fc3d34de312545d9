"""Step time, capture cost and memory of whole-step CUDA graphs against the alternatives.

One command, one process, one GPU; every variant of a preset is measured in the same run, so the
comparisons are ratios taken side by side on a shared, noisy host::

    python benchmarks/step_time.py --presets tiny small medium --out benchmarks/results

Variants (per preset, bf16-mixed autocast, AdamW):
  lightning_eager         Lightning, no graphs (the baseline for "speedup")
  callback                CudaGraphCallback() with its defaults (NaN guard on)
  callback_noguard        CudaGraphCallback(nan_guard=False): what the guard costs
  strategy                CudaGraphStrategy()
  raw_graph               a hand-written whole-step torch.cuda.graph loop without Lightning
  compile_reduce_overhead torch.compile(mode="reduce-overhead") inside Lightning
  compile_plus_plugin     torch.compile (default mode, no compile cudagraphs) + CudaGraphCallback
  nemo_callback           NeMo's CUDAGraphCallback, when nemo-toolkit is importable (else reported absent)
Floor: summed device time of one step's kernels (profiler), which no variant beats without
changing the kernels.

Measures, does not assert: targets live in TARGETS below and are reported met/missed.
Timing: host sync only at the ends of each window; ms/step is the median of ``--repeats`` windows.
The model logs its loss without ``prog_bar`` so the host is never forced to wait each step (a
progress-bar metric costs one ``.item()`` per step in every variant).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from recipes.gpt import GPTLightningModule, get_config, gpt_loss  # noqa: E402

TARGETS = {
    "small: callback / kernel floor": ("small", "callback", "floor_ratio", "<=", 1.03),
    "small: speedup of callback over Lightning eager": ("small", "callback", "speedup", ">=", 2.0),
    "tiny: callback / kernel floor": ("tiny", "callback", "floor_ratio", "<=", 1.10),
    "small: capture time beyond the eager warm-up steps (s)": ("small", "callback", "capture_extra_s", "<", 1.0),
    "small: peak memory callback / eager": ("small", "callback", "mem_ratio", "<=", 1.10),
    "small: compile+plugin faster than plugin alone": ("small", "compile_plus_plugin", "vs_callback", "<", 1.0),
    "small: compile+plugin faster than reduce-overhead": ("small", "compile_plus_plugin", "vs_reduce_overhead", "<", 1.0),
}


class _Windows(Dataset):
    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        x = self.data[i]
        return {"input_ids": x[:-1], "labels": x[1:]}


class BenchModule(GPTLightningModule):
    """The recipe's GPT, logging without prog_bar (see module docstring)."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = gpt_loss(self(batch["input_ids"]), batch["labels"])
        self.log("train_loss", loss)
        return loss


class WindowTimer(pl.Callback):
    """Wall time of consecutive windows of steps; host sync at window edges only."""

    def __init__(self, start: int, window: int, repeats: int) -> None:
        self.edges = {start + i * window for i in range(repeats + 1)}
        self.start, self.window, self.repeats = start, window, repeats
        self.marks: list[float] = []
        self.t_fit0 = 0.0
        self.t_first_measured = 0.0
        self.losses: list[torch.Tensor] = []

    def on_train_start(self, trainer, pl_module):
        torch.cuda.synchronize()
        self.t_fit0 = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx in self.edges:
            torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx % 10 == 0 or batch_idx == trainer.max_steps - 1:
            self.losses.append(outputs["loss"].detach())

    def ms_per_step(self) -> list[float]:
        return [(b - a) * 1e3 / self.window for a, b in zip(self.marks, self.marks[1:])]


def _loader(cfg: Any, steps: int) -> DataLoader:
    return DataLoader(_Windows(steps * cfg.batch_size, cfg.seq_len, cfg.vocab_size), batch_size=cfg.batch_size,
                      shuffle=False, pin_memory=True)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run_lightning(cfg: Any, steps: int, start: int, window: int, repeats: int, *, callbacks=(), strategy="auto",
                  compile_mode: Optional[str] = None) -> dict:
    _free()
    pl.seed_everything(0, verbose=False)
    module = BenchModule(cfg, lr=3e-4)
    if compile_mode is not None:
        opts = {"mode": compile_mode} if compile_mode != "default" else {}
        module.model = torch.compile(module.model, **opts)
    timer = WindowTimer(start, window, repeats)
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=steps,
                         callbacks=[*callbacks, timer], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=_loader(cfg, steps))
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    ms = timer.ms_per_step()
    warm = (timer.marks[0] - timer.t_fit0) if timer.marks else float("nan")
    stats = None
    for cb in callbacks:
        if hasattr(cb, "stats"):
            stats = cb.stats.as_dict()
    if hasattr(strategy, "stats"):
        stats = strategy.stats.as_dict()
    out = {
        "ms_per_step": statistics.median(ms), "ms_windows": ms, "warmup_s_until_measure": warm,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "final_loss": float(timer.losses[-1]),
        "total_s": total, "stats": stats,
    }
    del trainer, module
    return out


def run_raw_graph(cfg: Any, steps: int, start: int, window: int, repeats: int) -> dict:
    """Whole-step graph without Lightning: the reference for "all launch overhead gone"."""
    _free()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    from recipes.gpt import GPT

    model = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4, device=dev), capturable=True)
    data = _Windows(steps * cfg.batch_size, cfg.seq_len, cfg.vocab_size).data.to(dev)
    static = data[: cfg.batch_size].clone()

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(static[:, :-1])
        loss = gpt_loss(logits, static[:, 1:])
        loss.backward()
        opt.step()
        return loss.detach()

    t0 = time.perf_counter()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            static.copy_(data[i * cfg.batch_size:(i + 1) * cfg.batch_size])
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_loss = step()
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    marks, losses = [], []
    edges = {start + k * window for k in range(repeats + 1)}
    for i in range(3, steps):
        if i in edges:
            torch.cuda.synchronize()
            marks.append(time.perf_counter())
        b = (i % (steps - 1)) * cfg.batch_size
        static.copy_(data[b:b + cfg.batch_size], non_blocking=True)
        g.replay()
        if i % 10 == 0:
            losses.append(static_loss.clone())
    torch.cuda.synchronize()
    ms = [(b - a) * 1e3 / window for a, b in zip(marks, marks[1:])]
    out = {"ms_per_step": statistics.median(ms), "ms_windows": ms, "capture_s": capture_s,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "final_loss": float(losses[-1])}
    return out


def kernel_floor_ms(cfg: Any, steps: int = 6) -> float:
    """Summed device time of the kernels (and copies/memsets) of one eager step, averaged."""
    from torch.profiler import ProfilerActivity, profile

    _free()
    torch.manual_seed(0)
    from recipes.gpt import GPT

    dev = torch.device("cuda")
    model = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4, device=dev), capturable=True)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), device=dev)

    def step():
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total_us = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / steps / 1e3


def nemo_callback() -> tuple[Optional[Callable[[], Any]], str]:
    try:
        from nemo.utils.callbacks.cuda_graph import CUDAGraphCallback  # type: ignore
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
        return None, f"not importable here ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
    return CUDAGraphCallback, "nemo-toolkit"


def bench_preset(name: str, args: argparse.Namespace) -> dict:
    from nemo_cudagraph_plugin import CudaGraphCallback, CudaGraphStrategy

    cfg = get_config(name)
    start, window, repeats = args.start, args.window, args.repeats
    steps = start + window * repeats + 2
    res: dict[str, Any] = {"preset": name, "config": cfg.as_dict(), "tokens_per_step": cfg.batch_size * cfg.seq_len}
    variants: dict[str, Callable[[], dict]] = {
        "lightning_eager": lambda: run_lightning(cfg, steps, start, window, repeats),
        "callback": lambda: run_lightning(cfg, steps, start, window, repeats, callbacks=[CudaGraphCallback()]),
        "callback_noguard": lambda: run_lightning(cfg, steps, start, window, repeats,
                                                  callbacks=[CudaGraphCallback(nan_guard=False)]),
        "strategy": lambda: run_lightning(cfg, steps, start, window, repeats, strategy=CudaGraphStrategy()),
        "raw_graph": lambda: run_raw_graph(cfg, steps, start, window, repeats),
    }
    if name in args.compile_presets:
        variants["compile_reduce_overhead"] = lambda: run_lightning(cfg, steps, start, window, repeats,
                                                                    compile_mode="reduce-overhead")
        variants["compile_plus_plugin"] = lambda: run_lightning(cfg, steps, start, window, repeats,
                                                                callbacks=[CudaGraphCallback()], compile_mode="default")
    nemo_cls, nemo_note = nemo_callback()
    res["nemo_callback"] = nemo_note
    if nemo_cls is not None:
        variants["nemo_callback"] = lambda: run_lightning(cfg, steps, start, window, repeats, callbacks=[nemo_cls()])
    out: dict[str, dict] = {}
    for vname, fn in variants.items():
        t = time.perf_counter()
        try:
            out[vname] = fn()
        except Exception as exc:  # noqa: BLE001 - a failing variant is a result, not a crash
            out[vname] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        out[vname]["wall_s"] = time.perf_counter() - t
        print(f"  {name:6s} {vname:24s} {out[vname].get('ms_per_step', float('nan')):8.3f} ms/step"
              f"  {out[vname].get('error', '')}", flush=True)
    floor = kernel_floor_ms(cfg)
    res["floor_ms"] = floor
    base = out["lightning_eager"].get("ms_per_step", float("nan"))
    base_mem = out["lightning_eager"].get("peak_mem_gib", float("nan"))
    for v in out.values():
        if "ms_per_step" not in v:
            continue
        v["tokens_per_s"] = res["tokens_per_step"] / (v["ms_per_step"] / 1e3)
        v["speedup"] = base / v["ms_per_step"]
        v["floor_ratio"] = v["ms_per_step"] / floor
        v["mem_ratio"] = v["peak_mem_gib"] / base_mem
        # Capture cost beyond the eager warm-up steps: the wall time spent capturing (warm-up steps
        # themselves are ordinary eager steps).
        if v.get("stats"):
            v["capture_extra_s"] = v["stats"]["capture_time_s"]
        elif "capture_s" in v:
            v["capture_extra_s"] = v["capture_s"]
    cb = out.get("callback", {}).get("ms_per_step")
    ro = out.get("compile_reduce_overhead", {}).get("ms_per_step")
    cp = out.get("compile_plus_plugin", {}).get("ms_per_step")
    if cp and cb:
        out["compile_plus_plugin"]["vs_callback"] = cp / cb
    if cp and ro:
        out["compile_plus_plugin"]["vs_reduce_overhead"] = cp / ro
    res["variants"] = out
    return res


def markdown(results: list[dict]) -> str:
    lines = ["| preset | variant | ms/step | tokens/s | speedup vs eager | / kernel floor | capture (s) "
             "| peak mem (GiB) | final loss |", "|---|---|---|---|---|---|---|---|---|"]
    # "capture (s)": wall time of the captures (the raw loop: warm-up + capture)
    for r in results:
        for name, v in r["variants"].items():
            if "error" in v:
                lines.append(f"| {r['preset']} | {name} | failed: {v['error']} | | | | | | |")
                continue
            extra = v.get("capture_extra_s", float("nan"))
            lines.append(
                f"| {r['preset']} | {name} | {v['ms_per_step']:.3f} | {v['tokens_per_s']:,.0f} | {v['speedup']:.2f}x | "
                f"{v['floor_ratio']:.3f} | {extra:.3f} | {v['peak_mem_gib']:.2f} | {v['final_loss']:.4f} |"
            )
        lines.append(f"| {r['preset']} | kernel floor | {r['floor_ms']:.3f} | | | 1.000 | | | |")
        lines.append(f"| {r['preset']} | nemo_callback | {r['nemo_callback']} | | | | | | |")
    return "\n".join(lines)


def targets(results: list[dict]) -> list[str]:
    by = {r["preset"]: r for r in results}
    rows = []
    for label, (preset, variant, key, op, want) in TARGETS.items():
        v = by.get(preset, {}).get("variants", {}).get(variant, {})
        got = v.get(key)
        if got is None or (isinstance(got, float) and math.isnan(got)):
            rows.append(f"- {label}: not measured")
            continue
        ok = {"<=": got <= want, ">=": got >= want, "<": got < want}[op]
        rows.append(f"- {label}: {got:.3f} (target {op} {want}) -> {'MET' if ok else 'MISSED'}")
    return rows


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        names = [n for n, v in r["variants"].items() if "ms_per_step" in v]
        vals = [r["variants"][n]["ms_per_step"] for n in names]
        ax.barh(names, vals, color=["#888" if n == "lightning_eager" else "#3a7" for n in names])
        ax.axvline(r["floor_ms"], color="r", ls="--", label=f"kernel floor {r['floor_ms']:.2f} ms")
        ax.set_title(f"{r['preset']}: ms/step (lower is better)")
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "small", "medium"])
    p.add_argument("--compile-presets", nargs="*", default=["small"])
    p.add_argument("--start", type=int, default=30, help="first measured step (after warm-up and capture)")
    p.add_argument("--window", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/step_time.py needs a CUDA GPU.")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"date": str(date.today()), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "lightning": pl.__version__, "cuda": torch.version.cuda}
    print(f"step_time: {env}", flush=True)
    results = [bench_preset(name, args) for name in args.presets]
    (args.out / "step_time.json").write_text(json.dumps({"env": env, "targets": TARGETS, "results": results}, indent=1,
                                                        default=str))
    md = markdown(results)
    tgt = targets(results)
    (args.out / "step_time.md").write_text(f"{env}\n\n{md}\n\nTargets:\n" + "\n".join(tgt) + "\n")
    plot(results, args.out / "step_time.png")
    print(md)
    print("Targets:\n" + "\n".join(tgt))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "8")
    raise SystemExit(main())
