"""``python -m benchmarks.harness``: the command line (plan, run, report, write the docs)."""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from typing import Optional

from . import report
from .nemo_reference import DOWNLOAD_COMMAND, default_wheel
from .runner import REPO, as_data, execute, load_resume, make_plan, plan_text
from .variants import DEFAULT_VARIANTS, VARIANTS
from .workloads import DEFAULT_WORKLOADS, WORKLOADS

RAW_NAME = "step-time.json"
PAGE = REPO / "docs" / "results" / "step-time.md"
README = REPO / "README.md"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.harness",
        description="Step time, losses, peak memory, MFU and kernel floor of every workload and variant; one "
                    "process per run. Writes step-time.json and the tables to --out; --write-docs also updates "
                    "README.md's results table and docs/results/step-time.md.")
    p.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS, choices=list(WORKLOADS))
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS),
                   help="NeMo's callback runs only on the GPT workloads")
    p.add_argument("--rounds", type=int, default=2, help="each round runs every variant once, in the same order")
    p.add_argument("--gpus", type=int, default=1,
                   help="lanes: the workloads spread over this many GPUs, a workload's variants on one GPU")
    p.add_argument("--baseline", default="compile_ro", choices=list(VARIANTS),
                   help="the ratio column's reference within each round (eager where it did not run)")
    p.add_argument("--precision", default=None, help="default bf16-mixed (dry run: 32-true)")
    p.add_argument("--optim", default="adamw", choices=["adamw", "fused_adamw"],
                   help="adamw: torch's default (foreach) AdamW; Lightning refuses clipping with a fused one under "
                        "bf16-mixed")
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping by norm (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True, warn_only=True) in every run: compiled runs then "
                        "repeat bitwise (inductor's embedding backward scatters with atomics otherwise)")
    p.add_argument("--plan", action="store_true", help="print the runs and their estimated duration; run nothing")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no run that would end past this many seconds (estimated); skipped runs are reported "
                        "as skipped and --resume runs them later. 0: no limit")
    p.add_argument("--resume", type=Path, default=None,
                   help="a step-time.json of an earlier run with the same settings: its successful runs are kept, the rest "
                        "(missing, skipped for the budget, failed) run")
    p.add_argument("--keep-failed", action="store_true",
                   help="with --resume: keep the runs that failed with an error of their own instead of running them "
                        "again (budget skips and child-timeout kills still run)")
    p.add_argument("--report", type=Path, default=None,
                   help="render the tables of this step-time.json (no runs; with --write-docs, update the docs)")
    p.add_argument("--out", type=Path, default=None,
                   help="where step-time.json, step-time.page.md, step-time.readme.md and harness.log go "
                        "(default benchmarks/results; dry run: build/harness_dry_run)")
    p.add_argument("--write-docs", action="store_true",
                   help="also write README.md's results table, docs/results/step-time.md and its step-time.json")
    p.add_argument("--child-timeout-s", type=float, default=480.0)
    p.add_argument("--nemo-wheel", type=Path, default=None, help=f"default .bench/ ({DOWNLOAD_COMMAND})")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU smoke run: tiny shapes, 3 eager steps per run, torch.compile with the eager backend, "
                        "no CUDA; checks the plumbing, measures nothing")
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--record", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def canonical_command(args: argparse.Namespace) -> str:
    """The command that regenerates the table, as the page quotes it."""
    cmd = ["python", "-m", "benchmarks.harness", "--rounds", str(args.rounds)]
    if args.workloads != DEFAULT_WORKLOADS:
        cmd += ["--workloads", *args.workloads]
    if args.variants != DEFAULT_VARIANTS:
        cmd += ["--variants", *args.variants]
    if args.gpus > 1:
        cmd += ["--gpus", str(args.gpus)]
    if args.deterministic:
        cmd.append("--deterministic")
    if args.clip != 1.0:
        cmd += ["--clip", str(args.clip)]
    if args.optim != "adamw":
        cmd += ["--optim", args.optim]
    return shlex.join([*cmd, "--out", "benchmarks/results", "--write-docs"])


def table_command(args: argparse.Namespace, records: list[dict]) -> str:
    """The command quoted with the table: this run's, widened to the workloads and variants of the runs it resumed
    (the table holds those too, so the command must regenerate them)."""
    runs = [r for r in records if r.get("kind") == "variant"]
    if not runs:
        return canonical_command(args)
    names = set(args.workloads) | {r["workload"]["name"] for r in runs}
    variants = set(args.variants) | {r["variant"] for r in runs}
    return canonical_command(argparse.Namespace(**{**vars(args), "workloads": [w for w in WORKLOADS if w in names],
                                                   "variants": [v for v in VARIANTS if v in variants]}))


def write_outputs(data: dict, out: Path, command: str, docs: bool) -> None:
    """The raw JSON and both markdown blocks into ``out``; with ``docs`` also into README.md and the results page."""
    out.mkdir(parents=True, exist_ok=True)
    (out / RAW_NAME).write_text(json.dumps(data, indent=1, default=str))
    page = report.page_block(data, command)
    readme = report.readme_block(data)
    (out / "step-time.page.md").write_text(page + "\n")
    (out / "step-time.readme.md").write_text(readme + "\n")
    if docs:
        write_docs(data, page, readme, README, PAGE)


def write_docs(data: dict, page: str, readme: str, readme_path: Path, page_path: Path) -> None:
    """Replace the generated blocks of the README and the results page, and the page's raw JSON next to it."""
    readme_path.write_text(report.replace_between(readme_path.read_text(), report.README_BEGIN, report.README_END,
                                                  readme))
    page_path.write_text(report.replace_between(page_path.read_text(), report.PAGE_BEGIN, report.PAGE_END, page))
    (page_path.parent / RAW_NAME).write_text(json.dumps(data, indent=1, default=str) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child is not None:
        from .child import child_main

        return child_main(args.child, args.record)
    if args.dry_run and args.write_docs:
        raise SystemExit("--write-docs with --dry-run would put a smoke run's numbers in the docs")
    if args.report is not None:
        data = json.loads(args.report.read_text())
        command = data.get("settings", {}).get("command") or canonical_command(args)
        if args.out is not None:
            write_outputs(data, args.out, command, docs=False)
        if args.write_docs:
            write_docs(data, report.page_block(data, command), report.readme_block(data), README, PAGE)
        print(report.short_table(data))
        return 0
    settings = {
        "precision": args.precision or ("32-true" if args.dry_run else "bf16-mixed"), "optim": args.optim,
        "clip": args.clip, "seed": args.seed, "deterministic": args.deterministic,
        "device": "cpu" if args.dry_run else "cuda", "dry_run": args.dry_run, "lanes": args.gpus,
        "rounds": args.rounds, "baseline": args.baseline, "raw_name": RAW_NAME,
        "nemo_wheel": str(args.nemo_wheel or default_wheel(REPO)), "command": canonical_command(args),
    }
    if args.dry_run:
        settings["compile_backend"] = "eager"
    plan = make_plan(args.workloads, args.variants, args.rounds, args.gpus, settings)
    gpu = None
    if not args.dry_run and not args.plan:
        import torch

        if not torch.cuda.is_available():
            print("python -m benchmarks.harness needs a CUDA GPU (or --dry-run, the CPU smoke run).")
            return 2
        gpu = torch.cuda.get_device_name()
    records, done = load_resume(args.resume, settings, gpu, keep_failed=args.keep_failed)
    settings["command"] = table_command(args, records)
    print(plan_text(plan, done, args.budget_s, args.gpus), flush=True)
    if args.plan:
        return 0
    out = args.out or (REPO / "build" / "harness_dry_run" if args.dry_run else REPO / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def on_record() -> None:
        write_outputs(as_data(settings, records, complete=False), out, settings["command"], docs=False)

    execute(plan, done, args.budget_s, args.child_timeout_s, args.gpus, records, on_record, out / "harness.log")
    data = as_data(settings, records, complete=all(not r.get("skipped") for r in records))
    write_outputs(data, out, settings["command"], args.write_docs)
    print(f"\nharness: {time.perf_counter() - t0:.0f} s; {out / RAW_NAME}")
    print(report.short_table(data))
    return 0

