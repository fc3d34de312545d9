"""``benchmarks/_step_report.py``: the step-time report's figures from run records (pure Python, no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _step_report as report  # noqa: E402


def _run(variant: str, rnd: int, ms: float, ok: bool = True) -> dict:
    return {"variant": variant, "preset": "tiny", "round": rnd, "ok": ok, "ms_per_step": ms if ok else None,
            "config": {}, "tokens_per_step": 512, "notes": []}


def test_ours_over_nemo_is_given_within_each_round_and_a_round_without_both_is_left_out():
    runs = [_run("nemo_callback", 0, 0.700), _run("callback", 0, 0.714),
            _run("nemo_callback", 1, 0.800, ok=False), _run("callback", 1, 0.690),  # NeMo failed: no pair
            _run("nemo_callback", 2, 0.900), _run("callback", 2, 0.720),
            _run("nemo_callback", 3, 0.700), _run("callback", 3, 0.686)]
    (res,) = report.aggregate(runs, ["nemo_callback", "callback"])
    assert [round(x, 4) for x in res["ours_over_nemo_rounds"]] == [1.02, 0.8, 0.98]
    # the targets' figure stays the ratio of the medians (0.700 over 0.702 here), shown next to the pairs
    assert round(res["nemo_over_ours"], 4) == round(0.700 / 0.702, 4)
    setup = {"precision": "bf16-true", "optim": "fused_adamw", "clip": 0.0, "steps": 200, "measure_from": 80,
             "sync_from": 20, "rounds": 4, "seed": 0}
    md = report.markdown([res], setup, {}, {}, [])
    assert "ours / NeMo within each round (`callback` ÷ `nemo_callback`, adjacent processes): 1.020, 0.800, 0.980; " \
           "median 0.980" in md
