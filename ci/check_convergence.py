"""Check that the CUDA-graphed run of ``gpt-pretrain --compare`` trains like the eager run.

Reads the ``results.json`` that ``python -m recipes.gpt_pretrain --compare --out DIR`` writes to
``DIR/results.json``. The fields this check needs (the rest is ignored)::

    {"steps": 200,
     "runs": [{"mode": "eager",   "losses": [float, ...], "graph_stats": null},
              {"mode": "graphed", "losses": [float, ...],
               "graph_stats": {"captures": int, "replays": int, ...}}]}

``losses`` holds one training loss per optimizer step; a non-finite loss is written as ``null``.

The check fails (exit 1, one line per failed criterion) unless all of these hold:

1. both runs exist and each has ``steps`` finite losses;
2. the graphed run really replayed graphs (``graph_stats.replays > 0``): a "graphed" run that fell back to
   eager would otherwise pass trivially;
3. the loss curves agree window by window: for each block of ``--window`` consecutive steps,
   ``|mean_graphed - mean_eager| <= atol + rtol * |mean_eager|`` (window means, because single steps may
   differ by floating-point non-determinism that is not a bug);
4. both runs converge: the mean loss of the last window is at most ``--min-drop`` times that of the first.

Exit 2 on a missing or malformed file. ``--summary PATH`` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class BadResults(ValueError):
    """The results file does not have the fields this check needs."""


def window_means(values: Sequence[float], window: int) -> list[float]:
    """Means of consecutive blocks of ``window`` values; a shorter last block is kept."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return [sum(values[i : i + window]) / len(values[i : i + window]) for i in range(0, len(values), window)]


def _run(report: dict[str, Any], mode: str) -> dict[str, Any]:
    runs = report.get("runs")
    if not isinstance(runs, list):
        raise BadResults("no 'runs' list: was the recipe run with --compare?")
    found = [r for r in runs if isinstance(r, dict) and r.get("requested", r.get("mode")) == mode]
    if len(found) != 1:
        modes = [r.get("mode") for r in runs if isinstance(r, dict)]
        raise BadResults(f"expected exactly one run with mode {mode!r}, found modes {modes}: run with --compare")
    return found[0]


def _losses(run: dict[str, Any]) -> list[float | None]:
    losses = run.get("losses")
    if not isinstance(losses, list) or not all(v is None or isinstance(v, (int, float)) for v in losses):
        raise BadResults(f"run {run.get('mode')!r} has no 'losses' list of numbers")
    return [None if v is None else float(v) for v in losses]


def check(
    report: dict[str, Any],
    *,
    rtol: float = 0.02,
    atol: float = 0.02,
    window: int = 20,
    min_drop: float = 0.8,
) -> tuple[list[str], dict[str, Any]]:
    """Return ``(failures, summary)``; ``failures`` is empty when the curves agree and converge."""
    eager, graphed = _run(report, "eager"), _run(report, "graphed")
    e_losses, g_losses = _losses(eager), _losses(graphed)
    steps = report.get("steps")
    if not isinstance(steps, int) or steps < 1:
        raise BadResults("no positive integer 'steps'")
    failures: list[str] = []
    for name, losses in (("eager", e_losses), ("graphed", g_losses)):
        if len(losses) != steps:
            failures.append(f"{name} run has {len(losses)} losses, expected one per step ({steps})")
        bad = [i + 1 for i, v in enumerate(losses) if v is None or not math.isfinite(v)]
        if bad:
            failures.append(f"{name} run has non-finite losses at steps {bad[:10]}{' ...' if len(bad) > 10 else ''}")
    stats = graphed.get("graph_stats") or {}
    replays = stats.get("replays", 0) if isinstance(stats, dict) else 0
    captures = stats.get("captures", 0) if isinstance(stats, dict) else 0
    if not isinstance(replays, int) or replays < 1:
        reasons = stats.get("eager_reasons") if isinstance(stats, dict) else None
        failures.append(
            f"the graphed run replayed no CUDA graph (graph_stats={stats!r}; eager reasons: {reasons}): "
            "it trained eagerly, so comparing it with the eager run proves nothing"
        )
    summary: dict[str, Any] = {
        "steps": steps, "rtol": rtol, "atol": atol, "window": window, "min_drop": min_drop,
        "captures": captures, "replays": replays,
    }
    if failures:
        return failures, summary

    e = [float(v) for v in e_losses]  # all finite here
    g = [float(v) for v in g_losses]
    e_w, g_w = window_means(e, window), window_means(g, window)
    worst = 0.0
    for i, (a, b) in enumerate(zip(e_w, g_w)):
        diff = abs(b - a)
        limit = atol + rtol * abs(a)
        worst = max(worst, diff / limit)
        if diff > limit:
            first, last = i * window + 1, min((i + 1) * window, steps)
            failures.append(
                f"steps {first}-{last}: mean loss graphed {b:.4f} vs eager {a:.4f} differ by {diff:.4f} > "
                f"{limit:.4f} (atol {atol} + rtol {rtol} x |eager|)"
            )
    for name, w in (("eager", e_w), ("graphed", g_w)):
        if not w[-1] <= min_drop * w[0]:
            failures.append(
                f"{name} run did not converge: last-window mean loss {w[-1]:.4f} > {min_drop} x first-window "
                f"mean {w[0]:.4f}"
            )
    summary.update(
        eager_first=e_w[0], eager_last=e_w[-1], graphed_first=g_w[0], graphed_last=g_w[-1],
        max_abs_step_diff=max(abs(a - b) for a, b in zip(e, g)),
        worst_window_ratio=worst,  # largest |diff| / allowed over the windows; <= 1 passes
    )
    return failures, summary


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="results.json of gpt-pretrain --compare")
    p.add_argument("--rtol", type=float, default=0.02, help="relative tolerance of window means (default 0.02)")
    p.add_argument("--atol", type=float, default=0.02, help="absolute tolerance of window means (default 0.02)")
    p.add_argument("--window", type=int, default=20, help="steps per compared window (default 20)")
    p.add_argument("--min-drop", type=float, default=0.8,
                   help="last-window mean must be <= this x first-window mean (default 0.8)")
    p.add_argument("--summary", type=Path, default=None, help="write the numbers as JSON here")
    args = p.parse_args(argv)
    try:
        report = json.loads(args.results.read_text())
        if not isinstance(report, dict):
            raise BadResults("the file is not a JSON object")
        failures, summary = check(report, rtol=args.rtol, atol=args.atol, window=args.window,
                                  min_drop=args.min_drop)
    except (OSError, json.JSONDecodeError, BadResults, ValueError) as exc:
        print(f"check_convergence: error: {args.results}: {exc}", file=sys.stderr)
        return 2
    summary["passed"] = not failures
    summary["failures"] = failures
    if args.summary is not None:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(summary, indent=2) + "\n")
    for line in failures:
        print(f"check_convergence: FAIL: {line}")
    if failures:
        return 1
    print(
        f"check_convergence: OK: {summary['steps']} steps, {summary['replays']} graph replays; loss "
        f"{summary['eager_first']:.3f} -> {summary['eager_last']:.3f} (eager) vs {summary['graphed_first']:.3f} -> "
        f"{summary['graphed_last']:.3f} (graphed); worst window at {summary['worst_window_ratio']:.2f} of the "
        f"tolerance; max per-step |diff| {summary['max_abs_step_diff']:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
