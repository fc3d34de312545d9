"""The parent side: the plan of jobs, their estimated durations, the budget, one child process per job.

Jobs run round by round, every workload's variants in the same order within a round (ABCDE ABCDE ...), so a drift of
the host hits every variant alike. With ``lanes > 1`` (one GPU each) the rounds of the workloads are spread over the lanes, each
lane running its jobs one after another on its own GPU: the variants of a workload's round share one GPU, so the
ratios within a round compare runs on the same GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from .variants import VARIANTS, variants_for
from .workloads import WORKLOADS, dry_run

REPO = Path(__file__).resolve().parents[2]

#: seconds a child spends before its first step: interpreter, torch, Lightning (and transformers) imports
START_S = {"llama": 15.0, "moe": 18.0, "gpt": 12.0, "ceiling": 15.0}


def job_key(job: dict) -> str:
    if job["kind"] == "ceiling":
        return "ceiling"
    return f"{job['round']}/{job['workload']['name']}/{job['variant']}"


#: variants planned as another one: the optimizer's preparation changes neither the model, its compile nor the
#: step time by much (the optimizer's kernels are a few percent of a step)
ESTIMATE_AS = {"reference": "eager", "compile_reference": "compile", "ours_torch_adam": "ours",
               "compile_ours_torch_adam": "compile_ours", "ours_capturable": "ours",
               "compile_ours_capturable": "compile_ours"}


def estimate_s(job: dict) -> float:
    """Planning estimate of a job's wall time on an H200 (a later round's compile is about half: inductor's caches)."""
    if job["kind"] == "ceiling":
        return START_S["ceiling"]
    w, v = job["workload"], VARIANTS[ESTIMATE_AS.get(job["variant"], job["variant"])]
    if job.get("dry_run"):
        return 10.0 + (8.0 if v.compile else 0.0)
    s = START_S[w["kind"]] + w["est_build_s"] + w["steps"] * w["est_step_ms"] / 1e3
    if v.compile:
        s += w["est_compile_s"] * (1.0 if job["round"] == 0 else 0.5) + (10.0 if v.compile != "default" else 0.0)
    return s


def make_plan(workloads: list[str], variants: list[str], rounds: int, lanes: int, settings: dict,
              ceiling: bool = True) -> list[dict]:
    """Every job with its lane and estimate, in launch order per lane (the matmul ceiling first on lane 0)."""
    ws = [dry_run(WORKLOADS[n]) if settings.get("dry_run") else WORKLOADS[n] for n in workloads]
    per_w = {w.name: [v for v in variants_for(w.nemo, variants)] for w in ws}
    jobs_of: dict[str, list[dict]] = {w.name: [] for w in ws}
    for rnd in range(rounds):
        for w in ws:
            for v in per_w[w.name]:
                jobs_of[w.name].append({**settings, "kind": "variant", "workload": w.as_dict(), "variant": v,
                                        "round": rnd})
    # A workload's round is one unit: its variants run back to back on one GPU. Longest units first, each to the
    # least loaded lane.
    units = {(w.name, rnd): [j for j in jobs_of[w.name] if j["round"] == rnd] for w in ws for rnd in range(rounds)}
    load = [0.0] * lanes
    lane_of: dict[tuple[str, int], int] = {}
    for unit in sorted(units, key=lambda u: -sum(estimate_s(j) for j in units[u])):
        lane = min(range(lanes), key=lambda i: load[i])
        lane_of[unit] = lane
        load[lane] += sum(estimate_s(j) for j in units[unit])
    plan: list[dict] = []
    if ceiling and not settings.get("dry_run"):
        plan.append({**settings, "kind": "ceiling", "lane": 0, "round": 0})
    for rnd in range(rounds):
        for w in ws:
            plan += [{**j, "lane": lane_of[(w.name, rnd)]} for j in units[(w.name, rnd)]]
    for j in plan:
        j["key"] = job_key(j)
        j["est_s"] = estimate_s(j)
    return plan


def plan_text(plan: list[dict], done: set[str], budget_s: float, lanes: int) -> str:
    """What ``--plan`` prints: every job, its lane and estimate, and what fits in the budget."""
    lines = [f"{'lane':>4s} {'round':>5s}  {'workload':22s} {'variant':17s} {'est s':>6s}  note"]
    clock = [0.0] * lanes
    skipped = 0
    for j in plan:
        if j["key"] in done:
            note, est = "done (resumed)", 0.0
        elif budget_s and clock[j["lane"]] + j["est_s"] > budget_s:
            note, est = "skipped: does not fit --budget-s", 0.0
            skipped += 1
        else:
            note, est = "", j["est_s"]
        clock[j["lane"]] += est
        name = j["workload"]["name"] if j["kind"] == "variant" else "(matmul ceiling)"
        lines.append(f"{j['lane']:4d} {j.get('round', 0):5d}  {name:22s} {j.get('variant', ''):17s} "
                     f"{j['est_s']:6.0f}  {note}")
    todo = sum(j["est_s"] for j in plan if j["key"] not in done)
    lines.append(f"{len(plan)} jobs, {len(done & {j['key'] for j in plan})} done; estimated {todo:.0f} s of runs "
                 f"({todo / 60:.1f} min) over {lanes} lane(s): about {max(clock):.0f} s wall"
                 + (f"; {skipped} skipped by --budget-s {budget_s:.0f}" if budget_s else ""))
    return "\n".join(lines)


def run_child(job: dict, timeout_s: float, log: Callable[[str], None]) -> dict:
    """One job in a fresh process (``python -m benchmarks.harness --child``, or the job's ``child_module``: another
    benchmark with the same ``--child JOB --record RECORD`` entry); its record (or why there is none)."""
    with tempfile.TemporaryDirectory(prefix="harness_") as tmp:
        jp, rp = Path(tmp) / "job.json", Path(tmp) / "record.json"
        jp.write_text(json.dumps(job))
        module = job.get("child_module", "benchmarks.harness")
        cmd = [sys.executable, "-m", module, "--child", str(jp), "--record", str(rp)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "8")
        if job.get("lanes", 1) > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(job["lane"])
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, text = p.returncode, (p.stdout or "") + (p.stderr or "")
        except subprocess.TimeoutExpired as exc:
            rc = 124
            text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                           for x in (exc.stdout, exc.stderr))
        wall = time.perf_counter() - t
        if rp.exists():
            rec = json.loads(rp.read_text())
        else:
            rec = {**job, "ok": False, "error": f"child exited {rc} without a record"
                                                + (f" (killed after {timeout_s:.0f} s)" if rc == 124 else "")}
        rec.update(rc=rc, wall_s=wall)
        lines = text.splitlines()
        log(f"===== {job['key']}: rc {rc}, {wall:.1f} s\n" + "\n".join(lines if not rec.get("ok") else lines[-20:]))
        return rec


def execute(plan: list[dict], done: set[str], budget_s: float, child_timeout_s: float, lanes: int,
            records: list[dict], on_record: Callable[[], None], log_path: Path) -> None:
    """Run the plan's jobs not in ``done``, one thread per lane; each record (or a skipped one) is appended to
    ``records`` and ``on_record`` is called after each, under a lock."""
    lock = threading.Lock()
    t_start = time.perf_counter()
    measured: dict[tuple, float] = {}
    for r in records:
        if r.get("wall_s") and r.get("kind") == "variant":
            measured[(r["workload"]["name"], r["variant"])] = r["wall_s"]
    todo = [j for j in plan if j["key"] not in done]

    with log_path.open("a") as logf:
        def log(text: str) -> None:
            with lock:
                logf.write(text + "\n")
                logf.flush()

        def lane_main(lane: int) -> None:
            for j in [j for j in todo if j["lane"] == lane]:
                elapsed = time.perf_counter() - t_start
                key = (j["workload"]["name"], j["variant"]) if j["kind"] == "variant" else ("ceiling",)
                est = measured.get(key, j["est_s"])
                tag = f"[lane {lane} {elapsed:5.0f} s] {j['key']}"
                if budget_s and elapsed + est > budget_s:
                    rec = {**j, "ok": False, "skipped": True,
                           "error": f"skipped: estimated {est:.0f} s would end past --budget-s {budget_s:.0f}"}
                    print(f"{tag}: skipped (budget)", flush=True)
                else:
                    timeout = child_timeout_s if not budget_s else min(child_timeout_s, max(60.0, budget_s - elapsed))
                    rec = run_child(j, timeout, log)
                    measured[key] = rec["wall_s"]
                    ms = rec.get("ms_per_step")
                    what = f"{ms:.3f} ms/step" if ms is not None else ("ok" if rec.get("ok") else rec.get("error"))
                    print(f"{tag}: {what} ({rec['wall_s']:.0f} s)", flush=True)
                with lock:
                    records.append(rec)
                    on_record()

        threads = [threading.Thread(target=lane_main, args=(i,), daemon=True) for i in range(lanes)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()


#: the settings a resumed file must share with this run
RESUME_KEYS = ("precision", "optim", "clip", "seed", "deterministic", "device", "dry_run")


def failed_of_its_own(record: dict) -> bool:
    """A run that ended with its own error: not skipped for the budget, not killed at the child timeout."""
    return not record.get("ok") and not record.get("skipped") and record.get("rc") != 124 and bool(record.get("error"))


def load_resume(path: Optional[Path], settings: dict, gpu: Optional[str] = None,
                keys: tuple[str, ...] = RESUME_KEYS, keep_failed: bool = False) -> tuple[list[dict], set[str]]:
    """The records of an earlier run with the same settings (``keys``) and their keys; runs that did not succeed
    (skipped for the budget, killed at the child timeout, or failed) are run again, except, with ``keep_failed``,
    those that failed with an error of their own (a variant that fails on a model fails again: the record stays).

    ``gpu``: this machine's GPU name; runs timed on another GPU are refused, since one table compares its variants
    as ratios and an H100's milliseconds beside an H200's would read as a speed-up or a loss of either.
    """
    if path is None or not path.exists():
        return [], set()
    data = json.loads(path.read_text())
    old = data.get("settings", {})
    diff = [k for k in keys if old.get(k) != settings.get(k)]
    if diff:
        raise SystemExit(f"--resume {path}: its runs used other settings ({', '.join(f'{k}={old.get(k)!r}' for k in diff)})")
    keep = [r for r in data.get("runs", []) if r.get("ok") or (keep_failed and failed_of_its_own(r))]
    if data.get("ceiling"):
        keep.append(data["ceiling"])
    other = sorted({g for r in keep if (g := (r.get("env") or {}).get("gpu")) and g != gpu}) if gpu else []
    if other:
        raise SystemExit(f"--resume {path}: its runs were timed on {', '.join(other)}, this machine has {gpu}; "
                         "one table holds one GPU's timings (run the whole table here, or resume on that GPU)")
    return keep, {r["key"] for r in keep if r.get("key")}


def as_data(settings: dict, records: list[dict], complete: bool) -> dict[str, Any]:
    """The raw JSON: settings, environment, the matmul ceiling and every variant's record."""
    ceiling = next((r for r in records if r.get("kind") == "ceiling" and r.get("ok")), None)
    env = next((r["env"] for r in records if r.get("env") and r.get("kind") == "variant"), None) or \
        (ceiling or {}).get("env") or {}
    runs = sorted((r for r in records if r.get("kind") == "variant"),
                  key=lambda r: (r["round"], list(WORKLOADS).index(r["workload"]["name"])
                                 if r["workload"]["name"] in WORKLOADS else 99, list(VARIANTS).index(r["variant"])))
    return {"settings": {**settings, "complete": complete}, "env": env, "ceiling": ceiling, "runs": runs}

