"""Where a harness run's peak memory goes: the allocated and reserved memory after every step and the peak within it.

A graph replay (ours, or cudagraph trees' under ``reduce-overhead``) takes its memory from its graph's pool without the
caching allocator, so ``torch.cuda.max_memory_allocated()`` over a run sees the eager warm-up and the capture, not what
the replays use; the per-step view shows which phase sets the peak, and ``memory_reserved`` what the process holds.

    python -m benchmarks.memory_by_step gpt-small compile_ours --steps 40
    python -m benchmarks.memory_by_step gpt-small compile_ro --steps 40

Runs one harness workload and variant in this process (CUDA only) with the harness's own model, data and
callbacks; prints one line per step for the first steps and the last two, and the step with the highest peak.
"""

from __future__ import annotations

import argparse
from typing import Any

GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    from .harness.runner import make_plan
    from .harness.variants import VARIANTS
    from .harness.workloads import WORKLOADS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("variant", choices=sorted(VARIANTS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--show", type=int, default=8, help="steps printed from the start")
    args = ap.parse_args(argv)

    import torch

    from .harness import child

    if not torch.cuda.is_available():
        print("benchmarks.memory_by_step needs a CUDA GPU.")
        return 2
    settings = {"precision": args.precision, "optim": "adamw", "clip": 0.0, "seed": 0, "deterministic": False,
                "device": "cuda", "dry_run": False, "lanes": 1, "rounds": 1, "baseline": "eager", "raw_name": "",
                "nemo_wheel": "", "command": ""}
    job = next(j for j in make_plan([args.workload], [args.variant], 1, 1, settings, ceiling=False)
               if j["kind"] == "variant")
    w = job["workload"]
    w.update(steps=args.steps, measure_from=min(w["measure_from"], args.steps // 2), profile_steps=0)
    rows: list[tuple[int, float, float, float, float]] = []
    make_probe = child.make_probe

    def probe_with_memory(job: dict) -> Any:
        probe = make_probe(job)
        base = type(probe)

        class MemoryProbe(base):  # type: ignore[misc, valid-type]
            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
                super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
                torch.cuda.synchronize()
                rows.append((batch_idx, torch.cuda.memory_allocated() / GIB, torch.cuda.max_memory_allocated() / GIB,
                             torch.cuda.memory_reserved() / GIB, torch.cuda.max_memory_reserved() / GIB))
                torch.cuda.reset_peak_memory_stats()

        probe.__class__ = MemoryProbe
        return probe

    child.make_probe = probe_with_memory
    try:
        child.run_variant(job)
    finally:
        child.make_probe = make_probe
    print(f"{args.workload} {args.variant} ({torch.cuda.get_device_name()}, torch {torch.__version__}), GiB:")
    print(" step  allocated after  peak within  reserved after  reserved peak within")
    for r in rows[:args.show] + rows[-2:]:
        print(f"{r[0]:5d}  {r[1]:15.3f}  {r[2]:11.3f}  {r[3]:14.3f}  {r[4]:20.3f}")
    top = max(rows, key=lambda r: r[2])
    print(f"highest allocated peak {top[2]:.3f} GiB in step {top[0]}; highest reserved {max(r[4] for r in rows):.3f} "
          f"GiB; last step: peak {rows[-1][2]:.3f}, reserved {rows[-1][3]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
