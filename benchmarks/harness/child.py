"""One variant of one workload in this process: train, time, profile, write one record.

The parent (:mod:`benchmarks.harness.runner`) starts one process per job, so NeMo's callback (it patches classes
globally), torch.compile's caches and the allocator of one variant never touch another's. A failure is a result:
the record says what raised, the process exits 0.

The step: Lightning ``Trainer(precision=..., gradient_clip_val=...)`` on :class:`~benchmarks.harness.models.BenchLM`.
Timed window: steps ``measure_from`` to ``steps - profile_steps - 1``, a host sync at its two edges only. Every step's
loss stays on the device and is read once after training. The last ``profile_steps`` steps run under
``torch.profiler`` (CUDA activity): the kernel floor is the summed device time of the kernels, copies and memsets of
one of this variant's own steps. Inside the window an event recorded at the end of each step is polled (never waited
on) when the next one begins: the share of steps at whose start the GPU had already finished the previous one is
the share in which the GPU waited for the host (host-bound steps; about 2 µs of host time per step).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Optional

_T0 = time.perf_counter()


def _sync(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.synchronize()


def make_probe(job: dict) -> Any:
    """The Lightning callback that times the window, keeps the losses and profiles the last steps."""
    import lightning.pytorch as pl
    import torch

    w = job["workload"]
    steps, first, prof_steps = w["steps"], w["measure_from"], w["profile_steps"]
    last_timed = steps - prof_steps - 1
    cuda = job["device"] == "cuda"

    class StepProbe(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[Optional[torch.Tensor]] = []
            self._ptrs: set[int] = set()
            self._raw: list[torch.Tensor] = []
            self.aliased = False
            self.t0: Optional[float] = None
            self.t1: Optional[float] = None
            self.prof: Any = None
            self.profile: Optional[dict] = None
            # Polled, not waited on: True when the GPU finished the previous step before the host began this one.
            self.done_ev = torch.cuda.Event() if cuda else None
            self.idle = self.polled = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.done_ev is not None and first < batch_idx <= last_timed:
                self.polled += 1
                self.idle += self.done_ev.query()
            if batch_idx == first:
                _sync(cuda)
                self.t0 = time.perf_counter()
            if batch_idx == last_timed + 1 and prof_steps:
                from torch.profiler import ProfilerActivity, profile

                _sync(cuda)
                self.prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
                self.prof.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.done_ev is not None and first <= batch_idx < last_timed:
                self.done_ev.record()
            if batch_idx == last_timed:
                _sync(cuda)
                self.t1 = time.perf_counter()
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor):
                raw = loss.detach()
                # References are kept, so a pointer seen twice means a static buffer was returned (aliasing), never
                # a reused allocation; before the window every loss is copied (free there), inside it only once
                # aliasing was seen: no extra kernel in the timed steps of a variant that returns fresh tensors.
                if raw.data_ptr() in self._ptrs:
                    self.aliased = True
                self._ptrs.add(raw.data_ptr())
                self._raw.append(raw)
                loss = raw.clone() if (batch_idx < first or self.aliased) else raw
            self.losses.append(loss if isinstance(loss, torch.Tensor) else None)
            if self.prof is not None and batch_idx == steps - 1:
                _sync(cuda)
                self.prof.__exit__(None, None, None)
                self.profile = kernel_profile(self.prof, prof_steps, cuda)
                self.prof = None

        def summary(self) -> dict:
            ts = [t.float().reshape(()) for t in self.losses if t is not None]
            vals = iter(torch.stack(ts).cpu().tolist() if ts else [])  # one device-to-host read, after training
            out: dict[str, Any] = {"losses": [next(vals) if t is not None else None for t in self.losses],
                                   "loss_aliased": self.aliased}
            if self.t0 is not None and self.t1 is not None:
                out["window_steps"] = last_timed - first + 1
                out["ms_per_step"] = (self.t1 - self.t0) * 1e3 / out["window_steps"]
            if self.polled:
                out["gpu_idle_at_step_start"] = self.idle / self.polled
            if self.profile is not None:
                out.update(self.profile)
            return out

    return StepProbe()


def kernel_profile(prof: Any, steps: int, cuda: bool) -> dict:
    """Summed device time per step of the profiled steps' device events (kernels, copies, memsets), their count,
    the ten largest kernels by name, and every name's time per step (``kernels_us_per_step``, largest first; names
    cut to 120 characters, the times of names that then coincide added up): the report's floor differences."""
    import torch

    total, count = 0.0, 0
    by_name: dict[str, float] = {}
    for e in prof.events():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us() if cuda else e.self_cpu_time_total
        total += us
        count += 1
        by_name[e.name] = by_name.get(e.name, 0.0) + us
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    every: dict[str, float] = {}
    for n, us in by_name.items():
        every[n[:120]] = every.get(n[:120], 0.0) + us / steps
    return {"floor_ms": total / steps / 1e3, "device_events_per_step": count / steps, "profile_steps": steps,
            "profile_activity": "CUDA" if cuda else "CPU",
            "top_kernels": [{"name": n[:120], "us_per_step": us / steps} for n, us in top],
            "kernels_us_per_step": {n: round(us, 4) for n, us in sorted(every.items(), key=lambda kv: -kv[1])}}


def fresh_start(seed: int, cuda: bool) -> None:
    """Before a run's model is built: the memory of earlier objects freed, the peak counter reset, the seed set."""
    import lightning.pytorch as pl
    import torch

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    pl.seed_everything(seed, verbose=False)


def make_prepared_eager(notes: list[str]) -> Any:
    """The Lightning callback of the ``prepared`` variants: at train start the optimizer prepared as
    ``CudaGraphCallback()`` prepares it (``OptimizerPrep``: capturable AdamW, the learning rate a device tensor) and
    Hugging Face models switched to the graph-safe SDPA mask as it switches them (the harness's batches carry no
    attention mask: the same kernels either way); the hyperparameters synced before every step as before a replay;
    both undone at the end; no graphs. The step then runs the kernels a replay of ours runs, so their losses must
    agree bitwise.

    Without CUDA it leaves the optimizer as built (a note says so): capturable AdamW refuses CPU parameters
    (``OptimizerPrep.apply`` accepts them, the first ``step`` raises)."""
    import lightning.pytorch as pl

    from nemo_cudagraph_plugin.core.config import CaptureConfig
    from nemo_cudagraph_plugin.core.optim import OptimizerPrep
    from nemo_cudagraph_plugin.hf import (
        graph_safe_attention,
        graph_safe_experts,
        restore_attention,
        restore_experts,
    )

    class PreparedEager(pl.Callback):
        def __init__(self) -> None:
            self.prep: Optional[OptimizerPrep] = None
            self.switched: list[str] = []
            self.experts: list[tuple[str, str]] = []

        def on_train_start(self, trainer, pl_module):
            if pl_module.device.type != "cuda":
                notes.append("CPU: the optimizer trains unprepared (capturable AdamW needs CUDA parameters)")
                return
            self.switched = graph_safe_attention(pl_module)
            self.experts = graph_safe_experts(pl_module)  # the experts ours switches to, for the same kernels
            # the callback's default optimizer math: the user's own update where it covers the optimizer
            self.prep = OptimizerPrep(trainer.optimizers[0], pl_module.device, math=CaptureConfig().optimizer_math,
                                      step_count=lambda: trainer.global_step)
            self.prep.apply()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.prep is not None:
                self.prep.sync_hyperparams()  # what ours does before each replay

        def on_train_end(self, trainer, pl_module):
            if self.prep is not None:
                self.prep.restore()
                self.prep = None
            if self.switched:
                restore_attention(pl_module, self.switched)
                self.switched = []
            if self.experts:
                restore_experts(pl_module, self.experts)
                self.experts = []

    return PreparedEager()


def env_info(cuda: bool) -> dict:
    import lightning
    import torch

    info: dict[str, Any] = {"date": datetime.now(UTC).strftime("%Y-%m-%d"), "python": sys.version.split()[0],
                            "torch": torch.__version__, "lightning": lightning.__version__}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if cuda:
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return info


def stats_record(stats: Any) -> dict:
    """The plugin's capture statistics, read by name with defaults (counters are named differently across
    versions): the full ``as_dict()`` plus replays, captures and the peak memory fields."""
    d = dict(stats.as_dict()) if hasattr(stats, "as_dict") else {}
    for key in ("replays", "captures", "eager_steps", "capture_time_s", "peak_eager_bytes", "peak_bytes"):
        d.setdefault(key, getattr(stats, key, None))
    d["peak_over_eager"] = getattr(stats, "peak_over_eager", None)
    return d


def build_module(job: dict, w: Any, v: Any, cuda: bool) -> Any:
    """The job's LightningModule: the workload's model, compiled as the variant says, and its optimizer; NeMo's
    variant gets AdamW(capturable=True) with a device-tensor learning rate and the schedule as a ``_LRScheduler``
    (its callback accepts nothing else)."""
    from .models import BenchLM

    return BenchLM(w, compile_mode=v.compile, compile_backend=job.get("compile_backend"), optim=job["optim"],
                   capturable=v.nemo and cuda, nemo_schedule=v.nemo, max_steps=w.steps,
                   device="cuda" if cuda else "cpu")


def run_variant(job: dict) -> dict:
    """Train the job's variant of its workload; the record's measured fields."""
    import lightning.pytorch as pl
    import torch

    from .models import token_loader
    from .variants import NEMO_CAPTURE_ITERATION, VARIANTS
    from .workloads import Workload

    w = Workload(**job["workload"])
    v = VARIANTS[job["variant"]]
    cuda = job["device"] == "cuda"
    out: dict[str, Any] = {"notes": []}
    if job.get("deterministic"):
        # inductor's embedding backward scatters with atomics: compiled runs repeat bitwise only like this
        torch.use_deterministic_algorithms(True, warn_only=True)
    callbacks: list[Any] = []
    nemo_cb = None
    if v.ours:
        from nemo_cudagraph_plugin import CudaGraphCallback

        callbacks.append(CudaGraphCallback(**dict(v.options)))
        if not cuda:
            out["notes"].append("CPU: the callback trains eagerly (no CUDA)")
    if v.prepared:
        callbacks.append(make_prepared_eager(out["notes"]))
    if v.nemo:
        from .nemo_reference import load_cuda_graph_module

        mod = load_cuda_graph_module(Path(job["nemo_wheel"]))
        out["nemo"] = mod.__nemo_provenance__
        # Without CUDA NeMo's callback can only be attached switched off (-1): it creates CUDA streams on fit start.
        nemo_cb = mod.CUDAGraphCallback(capture_iteration=NEMO_CAPTURE_ITERATION if cuda else -1)
        callbacks.append(nemo_cb)
        if not cuda:
            out["notes"].append("CPU: NeMo's callback loaded from the wheel and attached with capture_iteration=-1")
    fresh_start(job["seed"], cuda)
    t = time.perf_counter()
    module = build_module(job, w, v, cuda)
    out.update(build_s=time.perf_counter() - t, n_params=module.n_params, n_matmul_params=module.n_matmul_params)
    probe = make_probe(job)
    trainer = pl.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision=job["precision"],
                         max_steps=w.steps, callbacks=[*callbacks, probe], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         gradient_clip_val=job["clip"] or None)
    t = time.perf_counter()
    trainer.fit(module, train_dataloaders=token_loader(w, w.steps, job["seed"], pin=cuda))
    _sync(cuda)
    out["fit_s"] = time.perf_counter() - t
    out.update(probe.summary())
    if cuda:
        out["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
        # What the process held from the GPU: a replay (ours, or cudagraph trees') takes its memory from its graph's
        # pool without the allocator, so the allocated figure misses what replays use; the reserved one does not.
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    for cb in callbacks:
        if hasattr(cb, "stats"):
            out["stats"] = stats_record(cb.stats)
    if nemo_cb is not None and cuda:
        out["notes"].append(f"NeMo: {nemo_cb.state.current_iteration} optimizer steps, capture at "
                            f"{nemo_cb.state.capture_iteration}")
    return out


def matmul_ceiling(n: int = 8192, reps: int = 20) -> dict:
    """The bf16 matmul rate this GPU reaches on ``n³`` matmuls (CUDA events), TFLOP/s: the practical ceiling next
    to the datasheet's peak."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    s = start.elapsed_time(end) / 1e3
    return {"matmul_n": n, "matmul_tflops": 2 * n**3 * reps / s / 1e12}


def run_job(job: dict) -> dict:
    """The harness's jobs: the matmul ceiling, or one variant of one workload."""
    return matmul_ceiling() if job["kind"] == "ceiling" else run_variant(job)


def child_main(job_path: Path, record_path: Path, run: Optional[Any] = None) -> int:
    """Run the job in ``job_path`` and write its record to ``record_path``.

    ``run``: ``run(job) -> dict`` of the measured fields (default :func:`run_job`); another benchmark's child passes
    its own and keeps the record's conventions (``ok``, ``error``, ``env``, ``child_s``; a failure is a result)."""
    job = json.loads(Path(job_path).read_text())
    if job.get("deterministic") and job["device"] == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: deterministic matmuls
    rec: dict[str, Any] = {**job, "ok": False, "error": None}
    try:
        import torch

        cuda = job["device"] == "cuda"
        if cuda and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device in this process")
        rec["env"] = env_info(cuda)
        rec.update((run or run_job)(job))
        rec["ok"] = True
    except Exception as exc:  # noqa: BLE001 - a failure is a result of the table
        traceback.print_exc()
        text = str(exc).splitlines()[0][:300] if str(exc) else ""
        rec["error"] = f"{type(exc).__name__}: {text}"
    rec["child_s"] = time.perf_counter() - _T0
    Path(record_path).write_text(json.dumps(rec, default=str))
    return 0
