"""``benchmarks/harness``: the report's figures from run records, the plan and budget, the docs it writes, and the
CPU smoke run through the real parent/child plumbing (no GPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import report, runner
from benchmarks.harness.cli import write_docs
from benchmarks.harness.workloads import PEAK_BF16_TFLOPS, WORKLOADS, model_flops_per_step

ROOT = Path(__file__).resolve().parents[1]
W = WORKLOADS["llama156m-2x512"].as_dict()
SETTINGS = {"precision": "bf16-mixed", "optim": "adamw", "clip": 1.0, "seed": 0, "deterministic": False,
            "device": "cuda", "dry_run": False, "lanes": 1, "rounds": 4, "baseline": "compile_ro"}


def _run(variant: str, rnd: int, ms: float | None, losses=(2.0, 1.5, 1.0), peak_gib=1.0, floor=None, ok=True,
         workload=W, **kw) -> dict:
    r = {"kind": "variant", "workload": workload, "variant": variant, "round": rnd, "ok": ok,
         "ms_per_step": ms if ok else None, "losses": list(losses), "peak_mem_bytes": int(peak_gib * 2**30),
         "floor_ms": floor, "n_params": 156_000_000, "n_matmul_params": 123_000_000, "notes": [],
         "key": f"{rnd}/{workload['name']}/{variant}"}
    r.update(kw)
    return r


def _one(runs: list[dict]) -> dict:
    (res,) = report.aggregate(runs, "compile_ro")
    return res


def test_ratio_to_the_baseline_pairs_runs_of_the_same_round_and_leaves_out_a_round_without_both():
    runs = [_run("compile_ro", 0, 10.0), _run("compile_ours", 0, 8.0),
            _run("compile_ro", 1, 20.0, ok=False, error="RuntimeError: x"), _run("compile_ours", 1, 9.0),
            _run("compile_ro", 2, 12.0), _run("compile_ours", 2, 6.0)]
    v = _one(runs)["variants"]
    assert v["compile_ours"]["ratio_rounds"] == [0.8, 0.5]
    assert v["compile_ours"]["ratio"] == pytest.approx(0.65)
    assert v["compile_ours"]["ms_rounds"] == {0: 8.0, 1: 9.0, 2: 6.0}
    assert v["compile_ours"]["ms_per_step"] == 8.0
    assert v["compile_ro"]["errors"] == ["RuntimeError: x"]
    assert report.goals([_one(runs)])[0]["value"] == pytest.approx(0.65)  # the host-bound goal, same pairing


def test_loss_differences_are_against_the_same_rounds_eager_and_compiled_ones_also_against_compile():
    runs = [_run("eager", 0, 40.0, losses=[2.0, 1.5, 1.0]), _run("eager", 1, 40.0, losses=[2.0, 1.5, 1.25]),
            _run("ours", 0, 12.0, losses=[2.0, 1.5, 1.0]), _run("ours", 1, 12.0, losses=[2.0, 1.5, 1.25]),
            _run("compile", 0, 20.0, losses=[2.0, 1.5, 1.5]), _run("compile_ours", 0, 9.0, losses=[2.0, 1.75, 1.5])]
    v = _one(runs)["variants"]
    assert v["ours"]["max_dloss_eager"] == 0.0  # each round against its own eager run: bitwise
    assert v["ours"]["self_noise"] == 0.25  # but not against itself across rounds
    assert v["eager"]["max_dloss_eager"] == 0.0
    assert v["compile_ours"]["max_dloss_eager"] == 0.5 and v["compile_ours"]["first_diff_step"] == 1
    assert v["compile_ours"]["max_dloss_compile"] == 0.25
    assert v["compile"]["max_dloss_compile"] == 0.0
    assert "max_dloss_compile" not in v["ours"]


def test_mfu_counts_six_n_tokens_plus_causal_attention_over_the_datasheet_peak():
    w = WORKLOADS["llama1b-4x2048"]
    flops = model_flops_per_step(1_000_000_000, w.layers, w.hidden, w.batch, w.seq)
    assert flops == 6 * 1e9 * 8192 + 6 * 16 * 2048**2 * 2048 * 4
    res = _one([_run("eager", 0, 100.0, workload={**W, "layers": 16, "hidden": 2048, "batch": 4, "seq": 2048},
                     n_matmul_params=1_000_000_000)])
    assert res["flops_per_step"] == flops
    assert res["variants"]["eager"]["mfu"] == pytest.approx(flops / 0.1 / (PEAK_BF16_TFLOPS * 1e12))
    assert PEAK_BF16_TFLOPS == 989.4


def test_peak_memory_is_compared_with_the_same_run_without_our_graphs_and_the_floor_with_the_variants_own():
    runs = [_run("eager", 0, 40.0, peak_gib=4.0, floor=30.0), _run("ours", 0, 33.0, peak_gib=4.2, floor=30.0,
                                                                     stats={"peak_over_eager": 1.04, "replays": 95}),
            _run("compile", 0, 20.0, peak_gib=3.0, floor=15.0), _run("compile_ours", 0, 16.5, peak_gib=3.6, floor=15.0),
            _run("compile_ro", 0, 18.0, peak_gib=3.3, floor=15.5)]
    v = _one(runs)["variants"]
    assert v["ours"]["peak_over_reference"] == pytest.approx(1.05)
    assert v["compile_ours"]["peak_over_reference"] == pytest.approx(1.2)
    assert v["compile_ro"]["peak_over_reference"] == pytest.approx(1.1)
    assert v["eager"]["peak_over_reference"] is None and v["compile"]["peak_over_reference"] is None
    assert v["ours"]["peak_over_eager"] == 1.04 and v["ours"]["replays"] == 95
    assert v["compile_ours"]["over_floor"] == pytest.approx(1.1)
    missed = {(g["goal"], g["met"]) for g in report.goals([_one(runs)]) if g["value"] is not None}
    assert ("peak memory, compile + ours / compile", False) in missed
    assert ("peak memory, ours / eager", True) in missed


def test_page_and_readme_show_skipped_and_failed_runs_and_the_markers_are_replaced(tmp_path):
    runs = [_run("eager", 0, 40.0), _run("ours", 0, 12.0),
            {**_run("compile", 0, None, ok=False), "skipped": True, "error": "skipped: estimated 90 s ..."},
            _run("compile_ours", 0, None, ok=False, error="CaptureError: model.py:3: host-sync")]
    data = {"settings": {**SETTINGS, "rounds": 1}, "env": {"gpu": "NVIDIA H200", "date": "2026-12-04"},
            "ceiling": {"matmul_tflops": 731.0, "matmul_n": 8192}, "runs": runs}
    page = report.page_block(data, "python -m benchmarks.harness --rounds 1")
    assert "| compile | skipped (budget) |" in page
    assert "| compile + ours | failed: CaptureError: model.py:3: host-sync |" in page
    assert "measured bf16 matmul ceiling on this GPU: 731 TFLOP/s" in " ".join(page.split())
    assert max(len(line) for line in page.splitlines() if not line.startswith("|")) <= 120
    assert "python -m benchmarks.harness --rounds 1" in page
    readme = report.readme_block(data)
    assert "| HF Llama 156 M, batch 2 × 512 | 40.00 | 12.00 | skipped | failed |" in readme
    (tmp_path / "README.md").write_text(f"# x\n{report.README_BEGIN}\nold table\n{report.README_END}\nrest\n")
    (tmp_path / "step-time.md").write_text(f"# Step time\n{report.PAGE_BEGIN}\nold\n{report.PAGE_END}\n## Why\nkept\n")
    write_docs(data, page, readme, tmp_path / "README.md", tmp_path / "step-time.md")
    text = (tmp_path / "README.md").read_text()
    assert "old table" not in text and text.endswith(f"{report.README_END}\nrest\n") and "| 40.00 |" in text
    text = (tmp_path / "step-time.md").read_text()
    assert text.startswith("# Step time\n") and text.endswith("## Why\nkept\n") and "old" not in text
    assert json.loads((tmp_path / "step-time.json").read_text())["runs"][0]["variant"] == "eager"
    with pytest.raises(ValueError):
        report.replace_between("no markers", report.README_BEGIN, report.README_END, "x")


def test_plan_keeps_a_workloads_round_on_one_lane_runs_nemo_on_gpt_only_and_skips_what_the_budget_cannot_hold():
    plan = runner.make_plan(list(WORKLOADS), ["eager", "ours", "nemo"], 2, 3, dict(SETTINGS, lanes=3))
    assert plan[0]["kind"] == "ceiling"
    lanes: dict[tuple, set] = {}
    for j in plan[1:]:
        lanes.setdefault((j["workload"]["name"], j["round"]), set()).add(j["lane"])
    assert all(len(s) == 1 for s in lanes.values()) and len({next(iter(s)) for s in lanes.values()}) == 3
    assert {j["workload"]["name"] for j in plan if j.get("variant") == "nemo"} == {"gpt-tiny", "gpt-small"}
    text = runner.plan_text(plan, set(), budget_s=60.0, lanes=3)
    assert "skipped: does not fit --budget-s" in text and text.splitlines()[-1].endswith("skipped by --budget-s 60")
    first = [j for j in plan if j["kind"] == "variant"]
    assert [j["round"] for j in first] == sorted(j["round"] for j in first)  # round by round


def test_resume_keeps_the_runs_done_and_refuses_other_settings(tmp_path):
    path = tmp_path / "step-time.json"
    runs = [_run("eager", 0, 40.0), {**_run("ours", 0, None, ok=False), "skipped": True},
            _run("compile", 0, None, ok=False, rc=124, error="child exited 124 without a record")]
    path.write_text(json.dumps({"settings": SETTINGS, "runs": runs, "ceiling": None}))
    records, done = runner.load_resume(path, SETTINGS)
    assert done == {"0/llama156m-2x512/eager"} and len(records) == 1
    with pytest.raises(SystemExit, match="clip"):
        runner.load_resume(path, {**SETTINGS, "clip": 0.0})


def test_parameters_in_matmuls_leave_out_embedding_tables_but_count_a_tied_head_once():
    pytest.importorskip("transformers")
    from benchmarks.harness.models import build_model, param_counts
    from benchmarks.harness.workloads import dry_run

    gpt = build_model(dry_run(WORKLOADS["gpt-tiny"]))
    total, mm = param_counts(gpt)
    assert total - mm == gpt.emb.pos.weight.numel()  # the tied token table is the head: a matmul
    llama = build_model(dry_run(WORKLOADS["llama156m-2x512"]))
    total, mm = param_counts(llama)
    assert total - mm == llama.get_input_embeddings().weight.numel()
    assert llama.get_output_embeddings().weight is not llama.get_input_embeddings().weight


def test_dry_run_trains_every_variant_through_the_parent_and_child_processes(tmp_path):
    """The CPU smoke run: the Llama workload eagerly and compiled with the callback, each in its own process."""
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.harness", "--dry-run", "--rounds", "1", "--workloads",
           "llama156m-2x512", "--variants", "eager", "compile_ours", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((out / "step-time.json").read_text())
    assert [(r["variant"], r["ok"]) for r in data["runs"]] == [("eager", True), ("compile_ours", True)], \
        [r.get("error") for r in data["runs"]]
    for r in data["runs"]:
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
        assert r["n_matmul_params"] < r["n_params"] and r["ms_per_step"] > 0
    assert data["runs"][1]["stats"]["replays"] == 0  # on a CPU the callback trains eagerly
    assert "DRY RUN on CPU" in (out / "step-time.page.md").read_text()


def test_plan_prints_the_runs_and_runs_nothing_and_docs_are_never_written_from_a_dry_run(capsys):
    from benchmarks.harness.cli import main

    assert main(["--plan", "--gpus", "4", "--budget-s", "100", "--workloads", "llama1b-4x2048", "gpt-tiny"]) == 0
    out = capsys.readouterr().out
    assert "(matmul ceiling)" in out and "llama1b-4x2048" in out and "skipped: does not fit --budget-s" in out
    assert out.splitlines()[-1].startswith("23 jobs, 0 done; estimated ")
    with pytest.raises(SystemExit, match="smoke run"):
        main(["--dry-run", "--write-docs"])
