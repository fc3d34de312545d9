"""Step time and correctness of whole-step CUDA graphs against Lightning eager and NeMo's CUDAGraphCallback.

One command on one GPU; every variant runs in a process of its own (NeMo's callback patches classes
globally) and the rounds alternate the variants (ABCD ABCD ...), so drift of a shared host hits all alike::

    PYTHONUNBUFFERED=1 python benchmarks/step_time.py --presets tiny small --rounds 2 --out benchmarks/results

Setup (defaults; flags change them): the recipe's GPT presets, bf16 parameters (``precision="bf16-true"``),
``torch.optim.AdamW(..., fused=True)``, 80 steps, timed over steps 40–79 with a host sync at the window edges
only. Every variant keeps its per-step losses on the device (read once, after training) and reports
max |loss − eager| against the Lightning eager run of the same preset, seed and data: speed and correctness side
by side. Host syncs are counted over steps 20–39 with ``torch.cuda.set_sync_debug_mode("warn")``.

Variants: see ``VARIANTS``. ``nemo_callback`` is NeMo 3.0.0's own ``CUDAGraphCallback`` loaded from the wheel
in ``.bench/`` (``benchmarks/nemo_reference.py``; never vendored). The kernel floor is the summed device time of
one eager step's kernels (profiler), which no variant beats without changing the kernels.

Outputs in ``--out``: ``step_time.md`` (table), ``step_time.json`` (everything, per-step losses included),
``step_time.png`` (when matplotlib is installed), ``step_time.log`` (the children's output), and with
``--profile VARIANT ...`` also ``profile.json`` / ``profile.txt`` (per-kernel name, count, total µs of ~5
replayed steps, and the diff of the first two profiled variants of each preset).

Child (what the parent runs per variant, preset and round)::

    python benchmarks/step_time.py --one callback --preset tiny --json run.json

CPU check of the plumbing (3 eager steps per variant, the NeMo module loaded from the wheel; no GPU)::

    python benchmarks/step_time.py --dry-run --rounds 1

Measures, never asserts: goals live in ``TARGETS`` and are reported met / missed.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections import OrderedDict  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from datetime import date  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _step_report as report  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import nemo_reference  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from recipes.gpt import GPTLightningModule, get_config, gpt_loss  # noqa: E402

NEMO_CAPTURE_ITERATION = 12

VARIANTS: dict[str, str] = {
    "lightning_eager": "Lightning, no graphs: the reference for speed and for the losses",
    "nemo_callback": f"NeMo {nemo_reference.NEMO_VERSION} `CUDAGraphCallback(capture_iteration={NEMO_CAPTURE_ITERATION})` "
                     "from the wheel; optimizer built with `capturable=True` (NeMo needs it and does not set it)",
    "callback": "`CudaGraphCallback()` (NaN guard on, `nan_check_every=50`)",
    "callback_noguard": "`CudaGraphCallback(nan_guard=False)`: what the guard costs",
    "nemo_callback_hostread": "`nemo_callback` + `float(outputs['loss'])` in on_train_batch_end every step (what a "
                              "progress bar costs)",
    "callback_hostread": "`callback` + the same per-step host read of the loss",
    "nemo_callback_nolog": "`nemo_callback` with a module that calls no `self.log` (NeMo's replays skip "
                           "`training_step`, so they never log): the like-for-like comparison",
    "callback_nolog": "`callback` with the same module that calls no `self.log`",
    "lightning_loop": "Lightning's own loop with `automatic_optimization.run` answered by step 1's stored output (no "
                      "training, no graph; losses not compared): the host time per step that every Lightning callback "
                      "pays, the least one can reach where the host is the bound",
    "strategy": "`CudaGraphStrategy()`",
    "raw_graph": "hand-written whole-step `torch.cuda.graph` loop without Lightning: gradients owned by the graph (set "
                 "to None before capture), batches pre-staged on the GPU; its process also measures the kernel floor",
    "compile_reduce_overhead": "`torch.compile(model, mode='reduce-overhead')` inside Lightning (with `--compile`)",
    "compile_plus_plugin": "`torch.compile(model)` (default mode) + `CudaGraphCallback()` (with `--compile`)",
}
DEFAULT_VARIANTS = ["lightning_eager", "nemo_callback", "callback", "callback_noguard", "nemo_callback_hostread",
                    "callback_hostread", "strategy", "raw_graph"]
COMPILE_VARIANTS = ["compile_reduce_overhead", "compile_plus_plugin"]
CHILD_ONLY = ["floor"]  # the kernel floor alone (used when raw_graph is not among the variants)

# label -> (preset, variant, key, op, want): the step-time goals, reported MET / MISSED, never asserted.
TARGETS: dict[str, tuple[str, str, str, str, float]] = {
    "tiny: ours / NeMo (ms per step)": ("tiny", "callback", "vs_nemo", "<=", 1.0),
    "small: ours / NeMo (ms per step)": ("small", "callback", "vs_nemo", "<=", 1.0),
    "tiny: ours / NeMo, module without self.log": ("tiny", "callback_nolog", "vs_nemo", "<=", 1.0),
    "small: ours / NeMo, module without self.log": ("small", "callback_nolog", "vs_nemo", "<=", 1.0),
    "small: ours / kernel floor": ("small", "callback", "floor_ratio", "<=", 1.03),
    "tiny: ours / kernel floor": ("tiny", "callback", "floor_ratio", "<=", 1.10),
    "small: NaN guard share of our step ((callback - callback_noguard) / callback)":
        ("small", "callback", "guard_share", "<=", 0.01),
    "tiny: ours max |loss - eager| beyond eager-vs-eager": ("tiny", "callback", "dloss_excess", "<=", 0.0),
    "small: ours max |loss - eager| beyond eager-vs-eager": ("small", "callback", "dloss_excess", "<=", 0.0),
    "tiny: host syncs per replayed step (ours, outside the NaN-check interval)":
        ("tiny", "callback", "syncs_per_step", "<=", 0.0),
    "small: host syncs per replayed step (ours, outside the NaN-check interval)":
        ("small", "callback", "syncs_per_step", "<=", 0.0),
}


# ================================================================================================ child side


@dataclass
class Spec:
    """One child's job: a variant of a preset under the common setup."""

    variant: str
    preset: str
    round: int = 0
    steps: int = 80
    measure_from: int = 40
    sync_from: int = 20
    precision: str = "bf16-true"
    optim: str = "fused_adamw"
    seed: int = 0
    device: str = "cuda"
    profile_from: int = 60
    profile_steps: int = 0
    host_profile: bool = False
    nemo_wheel: str = ""
    pin_cpu: int = -1
    clip: float = 0.0

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


class _Windows(Dataset):
    """Fixed random token windows: every variant of a preset sees the same batches in the same order."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        x = self.data[i]
        return {"input_ids": x[:-1], "labels": x[1:]}


def make_optimizer(module: GPTLightningModule, kind: str, capturable: bool) -> torch.optim.Optimizer:
    """The recipe's AdamW param groups (decay on >= 2-D weights), fused or torch's default implementation."""
    decay = [p for p in module.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": module.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw: dict[str, Any] = {"fused": True} if kind == "fused_adamw" else {}
    return torch.optim.AdamW(groups, lr=module.lr, betas=module.betas, capturable=capturable, **kw)


class BenchModule(GPTLightningModule):
    """The recipe's GPT; logs without ``prog_bar`` (a progress-bar metric costs one ``.item()`` per step, which
    the ``*_hostread`` variants measure on purpose); ``batch_idx`` optional because NeMo's callback calls
    ``training_step(batch)``."""

    def __init__(self, cfg: Any, *, optim: str, capturable: bool, log: bool = True) -> None:
        super().__init__(cfg, lr=3e-4)
        self.optim_kind, self.capturable, self.log_loss = optim, capturable, log

    def training_step(self, batch: dict, batch_idx: Optional[int] = None) -> torch.Tensor:
        loss = gpt_loss(self(batch["input_ids"]), batch["labels"])
        if self.log_loss:
            self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self, self.optim_kind, self.capturable)


class SyncCounter:
    """Counts host syncs between :meth:`arm` and :meth:`disarm` (``set_sync_debug_mode("warn")`` warnings)."""

    def __init__(self) -> None:
        self.count: Optional[int] = None
        self.other: list[str] = []
        self._cm: Any = None
        self._rec: list = []

    def arm(self) -> None:
        self._cm = warnings.catch_warnings(record=True)
        self._rec = self._cm.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def disarm(self) -> None:
        if self._cm is None:
            return
        torch.cuda.set_sync_debug_mode(0)
        self._cm.__exit__(None, None, None)
        self._cm = None
        msgs = [str(w.message) for w in self._rec]
        self.count = sum("synchroniz" in m for m in msgs)
        self.other = sorted({m.splitlines()[0][:160] for m in msgs if "synchroniz" not in m})


def device_gaps(intervals: list[tuple[float, float]], steps: int, threshold_us: float = 5.0,
                names: Optional[list[str]] = None, detail_from_us: float = 2.0) -> dict:
    """Where device time goes between kernels: (start, end) µs intervals of the window's device events merged
    into busy intervals (one sort, one pass); idle gaps between consecutive busy intervals split at
    ``threshold_us`` into small (device-side launch latency between dependent kernels, e.g. inside one graph)
    and large (mostly the device waiting for the host). Totals and counts per step. With ``names`` (one per
    interval), ``gap_pairs`` lists the gaps over ``detail_from_us`` by the event that ended before them and the one
    that began after them: which boundary of a step costs the time."""
    busy = small_us = large_us = 0.0
    n_small = n_large = 0
    span = 0.0
    pairs: dict[tuple[str, str], list[float]] = {}
    order = sorted(range(len(intervals)), key=lambda i: intervals[i])
    if order:
        first = intervals[order[0]][0]
        cur_s, cur_e = intervals[order[0]]
        last = order[0]  # the event of the current busy interval that ends last
        for i in order[1:]:
            s, e = intervals[i]
            if s > cur_e:
                busy += cur_e - cur_s
                gap = s - cur_e
                if gap <= threshold_us:
                    small_us += gap
                    n_small += 1
                else:
                    large_us += gap
                    n_large += 1
                if names is not None and gap > detail_from_us:
                    a = pairs.setdefault((names[last], names[i]), [0, 0.0])
                    a[0] += 1
                    a[1] += gap
                cur_s, cur_e, last = s, e, i
            elif e > cur_e:
                cur_e, last = e, i
        busy += cur_e - cur_s
        span = cur_e - first  # the last busy interval's end is the latest end of all
    out = {"span_us_per_step": span / steps, "busy_us_per_step": busy / steps,
           "small_gaps_us_per_step": small_us / steps, "small_gaps_per_step": n_small / steps,
           "large_gaps_us_per_step": large_us / steps, "large_gaps_per_step": n_large / steps,
           "gap_threshold_us": float(threshold_us)}
    if names is not None:
        out["gap_detail_from_us"] = float(detail_from_us)
        out["gap_pairs"] = [{"before": b, "after": a, "per_step": c / steps, "us_per_step": t / steps,
                             "mean_us": t / c}
                            for (b, a), (c, t) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:12]]
    return out


class Profiler:
    """torch.profiler over a few steps: per-kernel name, count, total µs (CPU ops on a machine without CUDA)."""

    def __init__(self, cuda: bool, first_step: int, steps: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.cuda, self.first_step, self.steps = cuda, first_step, steps
        self.prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
        self.t0 = 0.0
        self.result: Optional[dict] = None

    def start(self) -> None:
        _sync(self.cuda)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        _sync(self.cuda)
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        agg: dict[str, list[float]] = {}
        spans: list[tuple[float, float]] = []  # device events' (start, end) µs, for device_gaps
        span_names: list[str] = []
        span_streams: list[int] = []
        for e in self.prof.events():
            if self.cuda:
                if e.device_type != torch.autograd.DeviceType.CUDA:
                    continue
                us = e.time_range.elapsed_us()
                spans.append((e.time_range.start, e.time_range.end))
                span_names.append(e.name)
                span_streams.append(int(getattr(e, "thread", -1) or -1))
            else:
                us = e.self_cpu_time_total
            a = agg.setdefault(e.name, [0, 0.0])
            a[0] += 1
            a[1] += us
        kernels = [{"name": n, "count": int(c), "total_us": t} for n, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])]
        self.result = {"first_step": self.first_step, "steps": self.steps, "activity": "CUDA" if self.cuda else "CPU",
                       "device_us_per_step": sum(k["total_us"] for k in kernels) / self.steps,
                       "wall_ms_per_step": wall * 1e3 / self.steps, "kernels": kernels}
        if self.cuda:
            self.result.update(device_gaps(spans, self.steps, names=span_names))
            # The first ~2 steps' device events in start order, (start µs from the first, µs, stream, name): the
            # order of copies, fills and graph kernels at a step boundary, for reading by hand.
            order = sorted(range(len(spans)), key=lambda i: spans[i])
            t0 = spans[order[0]][0] if order else 0.0
            n = 2 * len(spans) // max(self.steps, 1) + 8
            self.result["timeline"] = [(round(spans[i][0] - t0, 2), round(spans[i][1] - spans[i][0], 2),
                                        span_streams[i], span_names[i][:90]) for i in order[:n]]


def gpu_local_core() -> int:
    """A core this process may use that sysfs lists as local to GPU 0 (the middle one); any allowed core otherwise."""
    allowed = sorted(os.sched_getaffinity(0))
    local: set[int] = set()
    try:
        bus = subprocess.check_output(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
                                      text=True).strip().lower()
        text = Path(f"/sys/bus/pci/devices/{bus[-12:]}/local_cpulist").read_text()
        for part in text.strip().split(","):
            a, _, b = part.partition("-")
            local.update(range(int(a), int(b or a) + 1))
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    cores = [c for c in allowed if c in local] or allowed
    return cores[len(cores) // 2]


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class StepProbe(pl.Callback):
    """Times steps ``measure_from``..last (sync at the two edges only), keeps every step's loss on the device,
    counts host syncs over ``sync_from``..``measure_from - 1``, and optionally profiles a few steps."""

    def __init__(self, spec: Spec) -> None:
        self.spec, self.cuda = spec, spec.cuda
        self.sync = SyncCounter()
        self.losses: list[Optional[torch.Tensor]] = []
        self._ptrs: set[int] = set()
        self._raw: list[torch.Tensor] = []
        self.aliased = False
        self.t0: Optional[float] = None
        self.t1: Optional[float] = None
        self.starts: list[float] = []
        self.ends: list[float] = []
        # A host profile runs without the kernel profiler: its per-launch bookkeeping would be most of the host time.
        self.prof = (Profiler(spec.cuda, spec.profile_from, spec.profile_steps)
                     if spec.profile_steps and not spec.host_profile else None)
        # cProfile of the host over the same steps, whole loop iterations (batch start to the next batch start); it
        # slows the host, so a profile run's wall time is not a timing.
        self.hprof = cProfile.Profile() if spec.host_profile and spec.profile_steps else None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        s = self.spec
        if self.cuda and batch_idx == s.sync_from and s.sync_from < s.measure_from:
            _sync(True)
            self.sync.arm()
        if batch_idx == s.measure_from:
            self.sync.disarm()
            _sync(self.cuda)
            self.t0 = time.perf_counter()
        if self.prof is not None and batch_idx == s.profile_from:
            self.prof.start()
        if self.hprof is not None and batch_idx == s.profile_from:
            self.hprof.enable()  # whole iterations: the loop's own work between steps (fetch, transfer) included
        if self.hprof is not None and batch_idx == s.profile_from + s.profile_steps:
            self.hprof.disable()
        if batch_idx >= s.measure_from:
            self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        s = self.spec
        if batch_idx >= s.measure_from:
            self.ends.append(time.perf_counter())
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            raw = loss.detach()
            # The raw outputs stay referenced, so a data pointer seen twice means the step returned a static
            # buffer (aliasing), never a reused allocation. Before the timed window every loss is copied (free
            # there), so an aliasing variant is caught with its values intact; inside the window references are
            # kept (no extra kernel) unless aliasing was seen.
            if raw.data_ptr() in self._ptrs:
                self.aliased = True
            self._ptrs.add(raw.data_ptr())
            self._raw.append(raw)
            loss = raw.clone() if (batch_idx < s.measure_from or self.aliased) else raw
        self.losses.append(loss if isinstance(loss, torch.Tensor) else None)
        if self.prof is not None and batch_idx == s.profile_from + s.profile_steps - 1:
            self.prof.stop()
        if batch_idx == s.steps - 1:
            _sync(self.cuda)
            self.t1 = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        self.sync.disarm()
        if self.hprof is not None:
            self.hprof.disable()

    def on_exception(self, trainer, pl_module, exception):
        self.sync.disarm()  # before Lightning's teardown syncs

    def summary(self) -> dict:
        s = self.spec
        out: dict[str, Any] = {
            "losses": [None if t is None else float(v) for t, v in zip(self.losses, _read_once(self.losses))],
            "loss_aliased": self.aliased,
            "syncs_in_sync_window": self.sync.count,
            "sync_window_steps": s.measure_from - s.sync_from if s.sync_from >= 0 else None,
            "other_warnings_in_sync_window": self.sync.other,
        }
        if self.t0 is not None and self.t1 is not None:
            out["window_s"] = self.t1 - self.t0
            out["ms_per_step"] = (self.t1 - self.t0) * 1e3 / (s.steps - s.measure_from)
        out.update(_host_times(self.starts, self.ends))
        if self.prof is not None:
            out["profile"] = self.prof.result
        if self.hprof is not None:
            out["host_profile"] = host_profile_rows(self.hprof, s.profile_steps)
        return out


def host_profile_rows(prof: cProfile.Profile, steps: int, top: int = 40) -> list[dict]:
    """The ``top`` functions by own time: calls, own and inclusive µs, per profiled step."""
    st = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, calls, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        where = file.split("site-packages/")[-1].replace(str(REPO) + "/", "")
        rows.append({"fn": f"{where}:{line}({name})", "calls": calls / steps, "own_us": tt * 1e6 / steps,
                     "incl_us": ct * 1e6 / steps})
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


class StoredRun(pl.Callback):
    """``lightning_loop``: steps 0 and 1 train eagerly; from step 2 ``automatic_optimization.run`` returns step 1's
    output and advances Lightning's progress counters as that step did. What remains per step is Lightning's loop:
    fetch, collate, pinning, transfer, hooks, counters. Each returned loss is a fresh allocation (no kernel), so the
    probe's aliasing check adds no copy."""

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


class HostRead(pl.Callback):
    """``float(outputs["loss"])`` every step: the host waits for each step, as a progress bar makes it."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.last = float(outputs["loss"])


class NemoPreflight(pl.Callback):
    """Records whether the Lightning internals NeMo's callback swaps exist (read in on_train_start)."""

    def on_train_start(self, trainer, pl_module):
        self.checks = nemo_reference.preflight(trainer)


def _read_once(losses: list[Optional[torch.Tensor]]) -> list[float]:
    ts = [t.float().reshape(()) for t in losses if t is not None]
    vals = iter(torch.stack(ts).cpu().tolist() if ts else [])  # one device-to-host read, after training
    return [next(vals) if t is not None else float("nan") for t in losses]


def _host_times(starts: list[float], ends: list[float]) -> dict:
    n = min(len(starts), len(ends))
    if n == 0:
        return {}
    inside = [(ends[i] - starts[i]) * 1e6 for i in range(n)]
    between = [(starts[i + 1] - ends[i]) * 1e6 for i in range(min(n, len(starts) - 1))]
    return {"host_in_step_us": statistics.median(inside),
            "host_between_us": statistics.median(between) if between else None}


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _loader(spec: Spec, cfg: Any) -> DataLoader:
    return DataLoader(_Windows(spec.steps * cfg.batch_size, cfg.seq_len, cfg.vocab_size, spec.seed),
                      batch_size=cfg.batch_size, shuffle=False, drop_last=True, pin_memory=spec.cuda)


def run_lightning(spec: Spec) -> dict:
    """A Lightning variant: the module, the variant's callbacks/strategy, and the probe."""
    from nemo_cudagraph_plugin import CudaGraphCallback, CudaGraphStrategy

    cfg = get_config(spec.preset)
    v = spec.variant
    out: dict[str, Any] = {"notes": []}
    callbacks: list[pl.Callback] = []
    strategy: Any = "auto"
    capturable = False
    compile_mode: Optional[str] = None
    nemo_cb = None
    if v.startswith("nemo_callback"):
        mod = nemo_reference.load_cuda_graph_module(Path(spec.nemo_wheel))
        out["nemo"] = mod.__nemo_provenance__
        # On a machine without CUDA NeMo's callback can only be loaded and attached switched off (-1): it
        # creates CUDA streams in on_fit_start.
        nemo_cb = mod.CUDAGraphCallback(capture_iteration=NEMO_CAPTURE_ITERATION if spec.cuda else -1)
        if not spec.cuda:
            out["notes"].append("CPU: NeMo's callback loaded from the wheel and attached with capture_iteration=-1")
        callbacks += [nemo_cb, NemoPreflight()]
        capturable = spec.cuda
    elif v.startswith("callback"):
        callbacks.append(CudaGraphCallback(nan_guard=False) if v == "callback_noguard" else CudaGraphCallback())
        if v not in ("callback", "callback_noguard", "callback_hostread", "callback_nolog"):
            raise ValueError(f"unknown variant {v!r}; choose one of {sorted(VARIANTS)}")
        if not spec.cuda:
            out["notes"].append("CPU: the callback trains eagerly (no CUDA)")
    elif v == "lightning_loop":
        callbacks.append(StoredRun())
    elif v == "strategy":
        strategy = CudaGraphStrategy()
    elif v == "compile_reduce_overhead":
        compile_mode = "reduce-overhead"
    elif v == "compile_plus_plugin":
        compile_mode = "default"
        callbacks.append(CudaGraphCallback())
    elif v != "lightning_eager":
        raise ValueError(f"unknown variant {v!r}; choose one of {sorted(VARIANTS)}")
    if v.endswith("_hostread"):
        callbacks.append(HostRead())

    _free(spec.cuda)
    pl.seed_everything(spec.seed, verbose=False)
    module = BenchModule(cfg, optim=spec.optim, capturable=capturable, log=not v.endswith("_nolog"))
    if compile_mode is not None:
        module.model = torch.compile(module.model, **({} if compile_mode == "default" else {"mode": compile_mode}))
    probe = StepProbe(spec)
    trainer = pl.Trainer(accelerator="gpu" if spec.cuda else "cpu", devices=1, strategy=strategy,
                         precision=spec.precision, max_steps=spec.steps, callbacks=[*callbacks, probe], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, gradient_clip_val=spec.clip or None)
    t = time.perf_counter()
    trainer.fit(module, train_dataloaders=_loader(spec, cfg))
    _sync(spec.cuda)
    out["fit_s"] = time.perf_counter() - t
    out.update(probe.summary())
    if v == "lightning_loop":
        out["losses"] = None  # stored, not trained: nothing to compare
        out["notes"].append("lightning_loop: steps from 2 return step 1's stored output (no training)")
    if spec.cuda:
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    for cb in [*callbacks, strategy]:
        if hasattr(cb, "stats"):
            st = cb.stats
            out["stats"] = st.as_dict() if hasattr(st, "as_dict") else dict(vars(st))
            out["capture_s"] = out["stats"].get("capture_time_s")
        if isinstance(cb, NemoPreflight):
            out["nemo_preflight"] = cb.checks
            missing = [k for k, ok in cb.checks.items() if not ok]
            if missing:
                out["notes"].append(f"Lightning lacks what NeMo's callback patches: {missing}")
    if nemo_cb is not None:
        st = nemo_cb.state
        out["nemo_iterations"] = st.current_iteration
        if spec.cuda:
            out["notes"].append(f"NeMo: {st.current_iteration} optimizer steps, capture at {st.capture_iteration}")
    if nemo_cb is not None and not spec.cuda:
        # NeMo calls training_step(batch) with one argument (on a GPU the run itself shows it): check it here.
        batch = next(iter(_loader(spec, cfg)))
        batch = {k: x.to(module.device) for k, x in batch.items()}
        with torch.no_grad(), torch.autocast(module.device.type, dtype=torch.bfloat16, enabled="mixed" in spec.precision):
            module.log = lambda *a, **k: None  # outside a loop: nothing to log into
            out["one_arg_training_step_loss"] = float(module.training_step(batch))
    if spec.profile_steps and not spec.host_profile and out.get("profile") is None:
        out["notes"].append("profile window not reached")
    return out


def _prepare(spec: Spec) -> tuple[Any, GPTLightningModule, torch.optim.Optimizer, Any, torch.Tensor, torch.device]:
    """Model, optimizer, precision context and batches outside Lightning, initialised as the Lightning runs are."""
    cfg = get_config(spec.preset)
    dev = torch.device(spec.device)
    pl.seed_everything(spec.seed, verbose=False)
    module = BenchModule(cfg, optim=spec.optim, capturable=spec.cuda)
    if spec.precision == "bf16-true":
        module.to(torch.bfloat16)
    module.to(dev)
    opt = make_optimizer(module, spec.optim, capturable=spec.cuda)

    def ctx() -> Any:
        if spec.precision == "bf16-mixed":
            return torch.autocast(dev.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    data = _Windows(spec.steps * cfg.batch_size, cfg.seq_len, cfg.vocab_size, spec.seed).data
    data = data.reshape(spec.steps, cfg.batch_size, cfg.seq_len + 1).to(dev)
    return cfg, module, opt, ctx, data, dev


@dataclass
class RawStep:
    """The benchmark GPT's whole step (forward, backward, fused AdamW) captured as one ``torch.cuda.CUDAGraph``
    without Lightning, gradients owned by the graph (set to None before capture); ``static`` is its input buffer."""

    module: Any
    opt: torch.optim.Optimizer
    data: torch.Tensor
    static: torch.Tensor
    graph: Any
    out: torch.Tensor
    warmup_losses: list[torch.Tensor]


def raw_step_fn(module: Any, opt: torch.optim.Optimizer, ctx: Any, x: torch.Tensor) -> Any:
    """One step on the batch in ``x`` without Lightning (no zero-grad): forward, backward, optimizer step."""
    model = module.model

    def step() -> torch.Tensor:
        with ctx():
            loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def capture_raw_step(spec: Spec, warmup: int = 3, keep_graph: bool = False) -> RawStep:
    """Three eager steps on a side stream (batches 0-2), then the capture. ``keep_graph``: the graph is not
    instantiated yet (its nodes can be rewritten first; ``graph.instantiate()`` or the first replay does it)."""
    cfg, module, opt, ctx, data, dev = _prepare(spec)
    static = data[0].clone()
    step = raw_step_fn(module, opt, ctx, static)
    losses = []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with warnings.catch_warnings(), torch.cuda.stream(s):
        warnings.simplefilter("ignore")  # "capturable=True but step() runs without graph capture"
        for i in range(warmup):
            static.copy_(data[i])
            opt.zero_grad(set_to_none=True)
            losses.append(step().clone())
    torch.cuda.current_stream().wait_stream(s)
    opt.zero_grad(set_to_none=True)  # backward inside the graph allocates the gradients from its pool
    g = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    torch.cuda.synchronize()
    return RawStep(module, opt, data, static, g, out, losses)


def run_raw_graph(spec: Spec) -> dict:
    """Whole-step graph without Lightning (:func:`capture_raw_step`), replayed for every batch after the warm-up."""
    _free(spec.cuda)
    out: dict[str, Any] = {"notes": []}
    losses: list[torch.Tensor] = []
    sync, starts, ends = SyncCounter(), [], []
    prof = Profiler(spec.cuda, spec.profile_from, spec.profile_steps) if spec.profile_steps else None
    t_cap = time.perf_counter()
    first_replay = 0
    g = None
    if spec.cuda:
        raw = capture_raw_step(spec)
        data, static, g, static_loss = raw.data, raw.static, raw.graph, raw.out
        losses.extend(raw.warmup_losses)
        first_replay = len(raw.warmup_losses)
        out["capture_s"] = time.perf_counter() - t_cap
    else:
        cfg, module, opt, ctx, data, dev = _prepare(spec)
        static = data[0].clone()
        step = raw_step_fn(module, opt, ctx, static)
        out["notes"].append("CPU: eager loop (a CUDA graph needs CUDA)")
    t0 = t1 = None
    for i in range(first_replay, spec.steps):
        if spec.cuda and i == spec.sync_from and spec.sync_from < spec.measure_from:
            _sync(True)
            sync.arm()
        if i == spec.measure_from:
            sync.disarm()
            _sync(spec.cuda)
            t0 = time.perf_counter()
        if prof is not None and i == spec.profile_from:
            prof.start()
        if i >= spec.measure_from:
            starts.append(time.perf_counter())
        static.copy_(data[i])
        if g is not None:
            g.replay()
            losses.append(static_loss.clone())
        else:
            opt.zero_grad(set_to_none=True)
            losses.append(step())
        if i >= spec.measure_from:
            ends.append(time.perf_counter())
        if prof is not None and i == spec.profile_from + spec.profile_steps - 1:
            prof.stop()
    _sync(spec.cuda)
    t1 = time.perf_counter()
    sync.disarm()
    out["losses"] = _read_once(losses)
    out["loss_aliased"] = False
    if t0 is not None:
        out["window_s"] = t1 - t0
        out["ms_per_step"] = (t1 - t0) * 1e3 / (spec.steps - spec.measure_from)
    out["syncs_in_sync_window"] = sync.count
    out["sync_window_steps"] = spec.measure_from - spec.sync_from if spec.sync_from >= 0 else None
    out.update(_host_times(starts, ends))
    if spec.cuda:
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if prof is not None:
        out["profile"] = prof.result
    return out


def kernel_floor_ms(spec: Spec, set_to_none: bool, steps: int = 6) -> float:
    """Summed device time of the kernels (and copies/memsets) of one eager step, averaged over ``steps``."""
    from torch.profiler import ProfilerActivity, profile

    _free(True)
    cfg, module, opt, ctx, data, dev = _prepare(spec)
    forward_backward_update = raw_step_fn(module, opt, ctx, data[0])

    def step() -> None:
        opt.zero_grad(set_to_none=set_to_none)
        forward_backward_update()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "capturable=True but step() runs without graph capture"
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    total_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / steps / 1e3


def env_info(spec: Spec) -> dict:
    info = {"date": str(date.today()), "torch": torch.__version__, "lightning": pl.__version__,
            "python": sys.version.split()[0], "device": spec.device}
    if spec.cuda:
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return info


def child_main(spec: Spec, json_path: Path) -> int:
    """Run one variant, write its record to ``json_path``; a failure is a result (recorded), not a crash."""
    cfg = get_config(spec.preset)
    rec: dict[str, Any] = {"variant": spec.variant, "preset": spec.preset, "round": spec.round, "setup": asdict(spec),
                           "config": cfg.as_dict(), "tokens_per_step": cfg.batch_size * cfg.seq_len,
                           "profile_only": spec.profile_steps > 0, "ok": False, "error": None, "notes": []}
    try:
        if spec.cuda and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device in this process")
        if spec.pin_cpu >= 0:
            os.sched_setaffinity(0, {spec.pin_cpu})  # every variant on the same core: less process-to-process noise
        rec["env"] = env_info(spec)
        if spec.variant in ("raw_graph", "floor"):
            if spec.variant == "raw_graph":
                rec.update(run_raw_graph(spec))
            if spec.cuda and not spec.profile_steps:
                rec["floor_ms"] = kernel_floor_ms(spec, set_to_none=True)
                rec["floor_inplace_ms"] = kernel_floor_ms(spec, set_to_none=False)
        else:
            rec.update(run_lightning(spec))
        rec["ok"] = True
    except Exception as exc:  # noqa: BLE001 - recorded for the report
        traceback.print_exc()
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    rec["child_s"] = time.perf_counter() - _T0
    json_path.write_text(json.dumps(rec, default=str))
    ms = rec.get("ms_per_step")
    timing = f"{ms:.3f} ms/step" if ms is not None else "no timing"
    print(f"[child] {spec.preset} {spec.variant} round {spec.round}: {timing} {rec['error'] or ''} ({rec['child_s']:.1f} s)")
    return 0


# =============================================================================================== parent side


def _child_cmd(args: argparse.Namespace, variant: str, preset: str, rnd: int, json_path: Path, profile: bool) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", variant, "--preset", preset, "--round", str(rnd),
           "--json", str(json_path), "--steps", str(args.steps), "--measure-from", str(args.measure_from),
           "--sync-from", str(args.sync_from), "--precision", args.precision, "--optim", args.optim,
           "--seed", str(args.seed), "--device", args.device, "--profile-from", str(args.profile_from),
           "--nemo-wheel", str(args.nemo_wheel), "--pin-cpu", str(args.pin_cpu), "--clip", str(args.clip)]
    if profile:
        cmd += ["--profile-run", "--profile-steps", str(args.profile_steps)]
        if args.host_profile:
            cmd.append("--host-profile")
    return cmd


def plan_runs(args: argparse.Namespace) -> list[tuple[str, int, str, str]]:
    """(kind, round, preset, variant) in launch order: round 0, the profiles, then the other rounds (``--rounds 0``:
    the profiles only); within a round every preset's variants in the same order (ABCD ABCD ...)."""
    plan: list[tuple[str, int, str, str]] = []
    for rnd in range(args.rounds):
        for preset in args.presets:
            vs = list(args.variants)
            if args.compile and preset in args.compile_presets:
                vs += [v for v in COMPILE_VARIANTS if v not in vs]
            if "raw_graph" not in vs:
                vs.append("floor")
            plan += [("time", rnd, preset, v) for v in vs]
        if rnd == 0:
            plan += [("profile", 0, p, v) for p in (args.profile_presets or args.presets) for v in args.profile]
    if args.rounds == 0:  # profiles only
        plan += [("profile", 0, p, v) for p in (args.profile_presets or args.presets) for v in args.profile]
    return plan


def parent_main(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    plan = plan_runs(args)
    log_path = args.out / "step_time.log"
    runs: list[dict] = []
    profiles: list[dict] = []
    durations: dict[str, list[float]] = {}
    t_start = time.perf_counter()
    core = args.pin_cpu if args.pin_cpu >= 0 else "any"
    print(f"step_time: {len(plan)} processes; setup {args.precision}, children on core {core}, {args.optim}, "
          f"clip {args.clip or 'off'}, "
          f"{args.steps} steps, window {args.measure_from}-{args.steps - 1}; budget {args.budget_s or 'none'} s",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="step_time_") as tmp, log_path.open("w") as log:
        for k, (kind, rnd, preset, variant) in enumerate(plan):
            elapsed = time.perf_counter() - t_start
            seen = durations.get(variant) or [x for d in durations.values() for x in d]
            estimate = statistics.mean(seen) if seen else 15.0
            base = {"variant": variant, "preset": preset, "round": rnd, "profile_only": kind == "profile", "ok": False}
            if args.budget_s and elapsed + estimate > args.budget_s:
                rec = {**base, "error": f"skipped: --budget-s {args.budget_s} would be exceeded"}
                (profiles if kind == "profile" else runs).append(rec)
                print(f"[{k + 1:2d}/{len(plan)} {elapsed:5.0f} s] skip {kind} r{rnd} {preset} {variant} (budget)", flush=True)
                continue
            jp = Path(tmp) / f"{kind}_{preset}_{variant}_{rnd}.json"
            cmd = _child_cmd(args, variant, preset, rnd, jp, kind == "profile")
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            t = time.perf_counter()
            try:
                p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.child_timeout_s)
                rc, text = p.returncode, (p.stdout or "") + (p.stderr or "")
            except subprocess.TimeoutExpired as exc:
                rc = 124
                text = ((exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")) + \
                       ((exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or ""))
            wall = time.perf_counter() - t
            durations.setdefault(variant, []).append(wall)
            rec = json.loads(jp.read_text()) if jp.exists() else {**base, "error": f"child exited {rc} without a record"}
            rec.update(rc=rc, wall_s=wall)
            lines = text.splitlines()
            keep = lines if (rc != 0 or not rec.get("ok")) else lines[-args.log_lines:]
            log.write(f"===== {kind} round {rnd} {preset} {variant}: rc {rc}, {wall:.1f} s\n$ {' '.join(cmd)}\n")
            log.write("\n".join(keep[-400:]) + "\n")
            log.flush()
            (profiles if kind == "profile" else runs).append(rec)
            ms = rec.get("ms_per_step")
            what = f"{ms:.3f} ms/step" if ms is not None and kind == "time" else ("ok" if rec.get("ok") else "")
            print(f"[{k + 1:2d}/{len(plan)} {time.perf_counter() - t_start:5.0f} s] {kind} r{rnd} {preset:6s} "
                  f"{variant:24s} {what} {rec.get('error') or ''} ({wall:.1f} s)", flush=True)
            write_reports(args, runs, profiles, t_start, final=False)
    results, tgt, env, setup = write_reports(args, runs, profiles, t_start, final=True)
    print(f"\nstep_time: {env}; total {setup['total_s']:.0f} s; files in {args.out}")
    print(report.short_table(results, args.dry_run))
    print("Targets:\n" + "\n".join(tgt))
    return 0


def write_reports(args: argparse.Namespace, runs: list[dict], profiles: list[dict], t_start: float,
                  final: bool) -> tuple[list[dict], list[str], dict, dict]:
    """step_time.json / .md (and profile.*) from the runs so far; the PNG only at the end. Written after every
    process, so a run stopped from outside still leaves its results."""
    order = [*args.variants, *COMPILE_VARIANTS]
    results = report.aggregate(runs, order)
    env = next((r["env"] for r in runs + profiles if r.get("env")), {})
    setup = {"precision": args.precision, "optim": args.optim, "clip": args.clip, "steps": args.steps,
             "measure_from": args.measure_from,
             "sync_from": args.sync_from, "rounds": args.rounds, "seed": args.seed, "device": args.device,
             "nemo_capture_iteration": NEMO_CAPTURE_ITERATION, "dry_run": args.dry_run, "complete": final,
             "total_s": time.perf_counter() - t_start}
    descriptions = {v: VARIANTS[v] for v in order if any(r["variant"] == v for r in runs)}
    tgt = report.targets(results, TARGETS)
    (args.out / "step_time.json").write_text(json.dumps(
        {"env": env, "setup": setup, "targets": TARGETS, "target_report": tgt, "variants": descriptions,
         "results": results, "runs": runs}, indent=1, default=str))
    (args.out / "step_time.md").write_text(report.markdown(results, setup, env, descriptions, tgt))
    if args.profile:
        (args.out / "profile.json").write_text(json.dumps(profiles, indent=1, default=str))
        (args.out / "profile.txt").write_text(report.profile_text(profiles))
    if final:
        why = report.plot(results, args.out / "step_time.png")
        if why:
            print(why)
    return results, tgt, env, setup


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=[*VARIANTS, *CHILD_ONLY])
    p.add_argument("--rounds", type=int, default=2, help="each round runs every variant once, in the same order")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--measure-from", type=int, default=40, help="first timed step; the window ends at the last step")
    p.add_argument("--sync-from", type=int, default=20,
                   help="host syncs are counted from this step to the one before --measure-from (-1: not counted)")
    p.add_argument("--precision", default=None, choices=["bf16-true", "bf16-mixed", "32-true"],
                   help="default bf16-true (dry run: 32-true, since bf16 matmuls are very slow on most CPUs)")
    p.add_argument("--optim", default="fused_adamw", choices=["fused_adamw", "adamw"],
                   help="fused_adamw: AdamW(fused=True); adamw: torch's default (foreach) implementation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="add the torch.compile variants on --compile-presets")
    p.add_argument("--compile-presets", nargs="*", default=["small"])
    p.add_argument("--profile", nargs="*", default=[], choices=[*VARIANTS],
                   help="variants to profile (one extra process each per profiled preset)")
    p.add_argument("--profile-presets", nargs="*", default=None, help="default: --presets")
    p.add_argument("--profile-from", type=int, default=60)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--host-profile", action="store_true",
                   help="profile runs record a cProfile of the host over the same steps instead of the kernels (top "
                        "functions by own time per step, in profile.txt): where a host-bound step's time goes")
    p.add_argument("--pin-cpu", default="-1", metavar="CORE",
                   help="run every child on this CPU core only (sched_setaffinity); 'gpu': one of the cores the GPU's "
                        "PCI device lists as local (sysfs); -1: wherever the OS puts it")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/results (dry run: build/step_time_dry_run)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="launch no process that would end past this many seconds (estimated); 0: no limit")
    p.add_argument("--child-timeout-s", type=float, default=240.0)
    p.add_argument("--clip", type=float, default=0.0,
                   help="Trainer(gradient_clip_val=...) for every Lightning variant (norm); raw_graph and the kernel "
                        "floor do not clip")
    p.add_argument("--log-lines", type=int, default=30, help="lines of each successful child's output kept in the log")
    p.add_argument("--nemo-wheel", type=Path, default=nemo_reference.default_wheel(REPO))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: 3 eager steps per variant through the same parent/child plumbing (no timing claims)")
    # child mode
    p.add_argument("--one", default=None, help="child: run this variant only and write --json")
    p.add_argument("--preset", default=None)
    p.add_argument("--round", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--profile-run", action="store_true", help="child: profile --profile-steps steps from --profile-from")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.precision is None:
        args.precision = "32-true" if args.dry_run else "bf16-true"
    if args.one is not None:
        if args.preset is None or args.json is None:
            raise SystemExit("--one needs --preset and --json")
        spec = Spec(variant=args.one, preset=args.preset, round=args.round, steps=args.steps,
                    measure_from=args.measure_from, sync_from=args.sync_from, precision=args.precision,
                    optim=args.optim, seed=args.seed, device=args.device, profile_from=args.profile_from,
                    profile_steps=args.profile_steps if args.profile_run else 0,
                    host_profile=args.host_profile, nemo_wheel=str(args.nemo_wheel), pin_cpu=int(args.pin_cpu),
                    clip=float(args.clip))
        return child_main(spec, args.json)
    if args.dry_run:
        args.device = "cpu"
        args.steps, args.measure_from, args.sync_from = 3, 1, -1
        args.profile_from, args.profile_steps = 1, 1
        args.out = args.out or REPO / "build" / "step_time_dry_run"
    elif not torch.cuda.is_available():
        print("benchmarks/step_time.py needs a CUDA GPU (or --dry-run for the CPU check of the plumbing).")
        return 2
    args.out = args.out or REPO / "benchmarks" / "results"
    args.pin_cpu = gpu_local_core() if args.pin_cpu == "gpu" else int(args.pin_cpu)
    if not 0 <= args.measure_from < args.steps or args.sync_from >= args.measure_from:
        raise SystemExit("need 0 <= --sync-from < --measure-from < --steps (or --sync-from -1)")
    return parent_main(args)


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "8")
    raise SystemExit(main())
