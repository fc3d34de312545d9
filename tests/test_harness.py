"""``benchmarks/harness``: the report's figures from run records, the plan and budget, the docs it writes, and the
CPU smoke run through the real parent/child plumbing (no GPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.harness import report, runner
from benchmarks.harness.cli import write_docs
from benchmarks.harness.variants import DEFAULT_VARIANTS, VARIANTS
from benchmarks.harness.workloads import DEFAULT_WORKLOADS, PEAK_BF16_TFLOPS, WORKLOADS, model_flops_per_step

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


def test_each_row_is_compared_with_its_own_loss_reference_the_run_without_graphs_of_the_same_kernels():
    """ours differs from eager (capturable AdamW's bias correction on the device) but not from eager with the
    optimizer prepared as ours: its Δ against its reference is 0 and the goal met; likewise compile + ours."""
    prepared, compiled, compiled_prepared = [2.0, 1.5, 1.0001], [2.0, 1.5, 1.25], [2.0, 1.5, 1.2501]
    runs = [run for rnd in (0, 1) for run in (
        _run("eager", rnd, 40.0, losses=[2.0, 1.5, 1.0]), _run("reference", rnd, 40.0, losses=prepared),
        _run("ours", rnd, 12.0, losses=prepared), _run("compile", rnd, 20.0, losses=compiled),
        _run("compile_reference", rnd, 20.0, losses=compiled_prepared),
        _run("compile_ro", rnd, 10.0, losses=[2.0, 1.5, 1.125]),
        _run("compile_ours", rnd, 8.0, losses=compiled_prepared), _run("nemo", rnd, 11.0, losses=prepared))]
    res = _one(runs)
    v = res["variants"]
    assert v["ours"]["max_dloss_eager"] == pytest.approx(1e-4) and v["ours"]["max_dloss_ref"] == 0.0
    assert v["ours"]["first_diff_ref"] is None and v["ours"]["dloss_ref_rounds"] == [0.0, 0.0]
    assert v["compile_ours"]["max_dloss_ref"] == 0.0 and v["compile_ours"]["max_dloss_compile"] == pytest.approx(1e-4)
    assert v["nemo"]["max_dloss_ref"] == 0.0
    assert v["compile_ro"]["max_dloss_ref"] == 0.125 and v["compile_ro"]["first_diff_ref"] == 2
    assert v["reference"]["max_dloss_ref"] == pytest.approx(1e-4)
    assert v["eager"]["max_dloss_ref"] is None
    loss_goals = {g["goal"]: g for g in report.goals([res]) if "Δloss" in g["goal"]}
    assert {g: (x["value"], x["met"]) for g, x in loss_goals.items()} == {
        "max |Δloss|, compile + ours against compile, optimizer prepared": (0.0, True),
        "max |Δloss|, ours against eager, optimizer prepared": (0.0, True)}
    assert {k: r["loss_reference"] for k, r in v.items()} == {
        "eager": None, "reference": "eager", "ours": "reference", "compile": "eager",
        "compile_reference": "compile", "compile_ro": "compile", "compile_ours": "compile_reference",
        "nemo": "reference"}
    page = report.page_block({"settings": {**SETTINGS, "rounds": 2}, "env": {}, "ceiling": None, "runs": runs}, "x")
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in page.splitlines() if line.startswith("| ")}
    col = rows["variant"].index("vs its reference")
    assert rows["ours"][col] == "0 (bitwise) vs eager, optimizer prepared"
    assert rows["compile + ours"][col] == "0 (bitwise) vs compile, optimizer prepared"
    assert rows["compile `reduce-overhead`"][col] == "0.125 vs compile"
    assert rows["eager"][col] == ""
    assert rows["ours"][col - 1] == "0.0001"  # the vs-eager column stays
    assert "- compile `reduce-overhead`: first Δ vs compile at step 2" in page
    assert "(vs reference: 0 (bitwise))" in report.short_table({"settings": SETTINGS, "runs": runs})


def test_floor_difference_lists_the_kernels_whose_time_per_step_differs_most():
    kernels = {f"k{i}": 10.0 for i in range(10)}
    ours = [{**kernels, "k0": 30.0, "k1": 11.0, "gemm|splitk": 5.0}, {**kernels, "k0": 50.0, "k1": 9.0}]
    runs = [_run("compile_ours", 0, 8.0, floor=0.15, kernels_us_per_step=ours[0]),
            _run("compile_ours", 1, 8.0, floor=0.16, kernels_us_per_step=ours[1]),
            _run("compile_ro", 0, 10.0, floor=0.12, kernels_us_per_step={**kernels, "k2": 2.0, "ro_only": 7.0}),
            _run("compile_ro", 1, 10.0, floor=0.12, kernels_us_per_step={**kernels, "k2": 2.0, "ro_only": 7.0})]
    res = _one(runs)
    assert res["variants"]["compile_ours"]["kernels_us"]["k0"] == 40.0  # median over rounds
    assert res["variants"]["compile_ours"]["kernels_us"]["gemm|splitk"] == 2.5  # absent in a round: 0 there
    fd = report.floor_diff(res, "compile_ours", "compile_ro")
    assert fd["names"] == 12 and len(fd["kernels"]) == 8
    assert [(k["name"], k["delta_us"]) for k in fd["kernels"][:4]] == [
        ("k0", 30.0), ("k2", 8.0), ("ro_only", -7.0), ("gemm|splitk", 2.5)]
    assert fd["kernels"][0]["us"] == 40.0 and fd["kernels"][0]["us_against"] == 10.0
    assert report.floor_diff(res, "ours", "reference") is None  # neither ran: no section
    lines = report.floor_diff_lines(res)
    assert lines[0] == "### Floor difference, compile + ours against compile `reduce-overhead`"
    assert "| `k0` | 40.0 | 10.0 | +30.0 |" in lines and "| `ro_only` | 0.0 | 7.0 | -7.0 |" in lines
    assert "| `gemm\\|splitk` | 2.5 | 0.0 | +2.5 |" in lines
    assert sum(line.startswith("| `") for line in lines) == 8
    page = report.page_block({"settings": {**SETTINGS, "rounds": 2}, "env": {}, "ceiling": None, "runs": runs}, "x")
    assert "### Floor difference, compile + ours against compile `reduce-overhead`" in page
    assert "ours against eager, optimizer prepared" not in page
    assert "Floor difference" not in report.readme_block({"settings": SETTINGS, "env": {}, "runs": runs})


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


def test_the_reserved_peak_is_a_column_next_to_the_allocated_one_because_replays_bypass_the_allocator():
    runs = [_run("eager", 0, 40.0, peak_gib=4.0, peak_reserved_bytes=5 * 2**30),
            _run("compile_ro", 0, 18.0, peak_gib=3.0, peak_reserved_bytes=int(4.5 * 2**30)),
            _run("compile_ours", 0, 16.5, peak_gib=3.6)]
    res = _one(runs)
    v = res["variants"]
    assert v["eager"]["peak_reserved_gib"] == pytest.approx(5.0)
    assert v["compile_ro"]["peak_reserved_gib"] == pytest.approx(4.5)
    assert v["compile_ours"]["peak_reserved_gib"] is None  # a record from before the column
    table = [ln for ln in report.workload_table(res) if ln.startswith("|")]
    head = [c.strip() for c in table[0].replace("\\|", "").split("|")]
    col = head.index("peak reserved GiB")
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.replace("\\|", "").split("|")] for ln in table[2:]}
    assert rows["compile `reduce-overhead`"][col] == "4.50" and rows["compile + ours"][col] == "–"


def test_the_capturable_math_variants_ask_the_callback_for_it_and_compare_with_the_users_eager_run():
    from benchmarks.harness.variants import VARIANTS as V

    for name, compiled in (("ours_capturable", None), ("compile_ours_capturable", "default"),
                           ("ours_torch_adam", None), ("compile_ours_torch_adam", "default")):
        v = V[name]
        assert dict(v.options)["optimizer_math"] == "capturable" and v.ours and v.compile == compiled, name
        assert v.loss_reference == ("compile" if compiled else "eager"), name
        assert runner.estimate_s({**_run(name, 0, 1.0), "dry_run": False}) == \
            runner.estimate_s({**_run("compile_ours" if compiled else "ours", 0, 1.0), "dry_run": False})
    assert dict(V["ours_torch_adam"].options)["fast_adam"] is False


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
    assert "python -m benchmarks.harness --rounds 1" in page and "**Partial:**" not in page
    partial = report.page_block({**data, "settings": {**data["settings"], "complete": False}}, "x")
    assert max(len(line) for line in partial.splitlines() if not line.startswith("|")) <= 120
    assert "**Partial:** 1 run(s) did not fit `--budget-s` and are marked skipped (0/llama156m-2x512/compile)" in " ".join(
        partial.split())
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


def test_the_share_of_steps_in_which_the_gpu_waited_for_the_host_is_a_column_of_every_row():
    runs = [_run("eager", 0, 40.0, gpu_idle_at_step_start=0.0), _run("ours", 0, 12.0, gpu_idle_at_step_start=0.97),
            _run("compile", 0, 20.0), {**_run("compile_ours", 0, None, ok=False), "skipped": True}]
    res = _one(runs)
    assert res["variants"]["ours"]["gpu_idle_at_step_start"] == pytest.approx(0.97)
    table = [line for line in report.workload_table(res) if line.startswith("|")]
    head = table[0].split(" | ")
    col = head.index("GPU waited for the host")
    cells = {row.split(" | ")[0].lstrip("| "): row.split(" | ") for row in table[2:]}
    assert cells["ours"][col] == "97 %" and cells["eager"][col] == "0 %" and cells["compile"][col] == "–"
    cols = table[0].replace("\\|", "").count("|")
    assert all(row.replace("\\|", "").count("|") == cols for row in table)


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


def test_the_prepared_references_are_planned_for_every_workload_and_estimated_as_their_unprepared_twins():
    assert {"reference", "compile_reference"} <= set(DEFAULT_VARIANTS)
    plan = runner.make_plan(list(WORKLOADS), DEFAULT_VARIANTS, 1, 1, SETTINGS)
    for name, w in WORKLOADS.items():
        vs = [j["variant"] for j in plan if j["kind"] == "variant" and j["workload"]["name"] == name]
        assert vs == [v for v in VARIANTS if v in DEFAULT_VARIANTS and (w.nemo or v != "nemo")], name
        est = {j["variant"]: j["est_s"] for j in plan if j["kind"] == "variant" and j["workload"]["name"] == name}
        assert est["reference"] == est["eager"] and est["compile_reference"] == est["compile"]
    assert VARIANTS["reference"].prepared and VARIANTS["compile_reference"].prepared
    assert not VARIANTS["reference"].graphs and not VARIANTS["compile_reference"].graphs


def test_resume_keeps_the_runs_that_succeeded_and_refuses_other_settings(tmp_path):
    path = tmp_path / "step-time.json"
    runs = [_run("eager", 0, 40.0), {**_run("ours", 0, None, ok=False), "skipped": True},
            _run("compile", 0, None, ok=False, rc=124, error="child exited 124 without a record"),
            _run("nemo", 0, None, ok=False, rc=0, error="AssertionError: Expect _LRScheduler type")]
    path.write_text(json.dumps({"settings": SETTINGS, "runs": runs, "ceiling": None}))
    records, done = runner.load_resume(path, SETTINGS)
    assert done == {"0/llama156m-2x512/eager"} and len(records) == 1
    with pytest.raises(SystemExit, match="clip"):
        runner.load_resume(path, {**SETTINGS, "clip": 0.0})
    # --keep-failed: a failure of its own stays; the budget skip and the kill at the child timeout run again
    records, done = runner.load_resume(path, SETTINGS, keep_failed=True)
    assert done == {"0/llama156m-2x512/eager", "0/llama156m-2x512/nemo"}
    assert [r["error"] for r in records if not r["ok"]] == ["AssertionError: Expect _LRScheduler type"]


def test_resume_refuses_runs_timed_on_another_gpu(tmp_path):
    path = tmp_path / "step-time.json"
    env = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130"}
    runs = [_run("eager", 0, 40.0, env=env), _run("ours", 0, 9.0, env=env)]
    path.write_text(json.dumps({"settings": SETTINGS, "runs": runs, "ceiling": None}))
    assert runner.load_resume(path, SETTINGS, "NVIDIA H200")[1] == {"0/llama156m-2x512/eager", "0/llama156m-2x512/ours"}
    with pytest.raises(SystemExit, match="timed on NVIDIA H200, this machine has NVIDIA H100 80GB HBM3"):
        runner.load_resume(path, SETTINGS, "NVIDIA H100 80GB HBM3")


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


def test_the_prepared_variants_callback_prepares_the_optimizer_as_ours_on_cuda_and_leaves_it_on_a_cpu(monkeypatch):
    """What tests/gpu's CapturableEager does: apply at train start, sync before every step; restored at the end."""
    import types

    import torch

    from benchmarks.harness.child import make_prepared_eager
    from nemo_cudagraph_plugin.core import optim
    from nemo_cudagraph_plugin.core.config import CaptureConfig

    calls = []

    class Prep:
        def __init__(self, optimizer, device, math, step_count):
            calls.append(("init", optimizer, device.type))
            assert math == CaptureConfig().optimizer_math and step_count() == 0  # as the callback prepares it

        def apply(self):
            calls.append("apply")

        def sync_hyperparams(self):
            calls.append("sync")

        def restore(self):
            calls.append("restore")

    monkeypatch.setattr(optim, "OptimizerPrep", Prep)
    opt = object()
    trainer = types.SimpleNamespace(optimizers=[opt], global_step=0)
    gpu = types.SimpleNamespace(device=torch.device("cuda", 0), modules=lambda: iter(()))
    notes: list[str] = []
    cb = make_prepared_eager(notes)
    cb.on_train_start(trainer, gpu)
    for i in range(2):
        cb.on_train_batch_start(trainer, gpu, None, i)
    cb.on_train_end(trainer, gpu)
    assert calls == [("init", opt, "cuda"), "apply", "sync", "sync", "restore"] and notes == []
    calls.clear()
    cpu = types.SimpleNamespace(device=torch.device("cpu"))
    cb = make_prepared_eager(notes)
    cb.on_train_start(trainer, cpu)
    cb.on_train_batch_start(trainer, cpu, None, 0)
    cb.on_train_end(trainer, cpu)
    assert calls == [] and len(notes) == 1 and "unprepared" in notes[0]


def test_the_partial_tier_cases_read_the_host_in_the_step_and_their_variants_ask_for_partial_graphs():
    pytest.importorskip("transformers")
    import torch

    from benchmarks.harness.models import BenchLM, HostCheck
    from benchmarks.harness.variants import VARIANTS as V
    from benchmarks.harness.workloads import dry_run

    assert dict(V["ours_modules"].options) == {"scope": "modules"} and dict(V["ours_auto"].options) == {"scope": "auto"}
    assert V["ours_modules"].loss_reference == V["ours_auto"].loss_reference == "reference"
    layer, loss = WORKLOADS["llama156m-hostcheck-2x512"], WORKLOADS["llama156m-itemloss-2x512"]
    assert layer.name not in DEFAULT_WORKLOADS and loss.name not in DEFAULT_WORKLOADS
    lm = BenchLM(dry_run(layer))
    assert isinstance(lm.model.model.layers[1], HostCheck)
    batch = {"input_ids": torch.randint(0, 512, (2, 32))}
    batch["labels"] = batch["input_ids"]
    seen = []
    lm.model.model.layers[1].register_forward_pre_hook(lambda m, a: seen.append(1))
    lm.training_step(batch)
    assert seen == [1]
    lm = BenchLM(dry_run(loss), log=False)
    assert lm.training_step(batch).item() == lm.last_loss
    packed = WORKLOADS["llama156m-packed-2x512"]
    assert packed.name not in DEFAULT_WORKLOADS
    lm = BenchLM(dry_run(packed), log=False)
    positions = []
    lm.model.model.register_forward_pre_hook(lambda m, a, kw: positions.append(kw["position_ids"]), with_kwargs=True)
    lm.training_step(batch)
    assert positions[0].tolist() == [list(range(16)) * 2] * 2  # two documents a row, positions restarting


def test_dry_run_trains_every_variant_through_the_parent_and_child_processes(tmp_path):
    """The CPU smoke run: the Llama workload eagerly, with the optimizer prepared (eager and compiled) and compiled
    with the callback, each in its own process."""
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    variants = ["eager", "reference", "compile_reference", "compile_ours"]
    cmd = [sys.executable, "-m", "benchmarks.harness", "--dry-run", "--rounds", "1", "--workloads",
           "llama156m-2x512", "--variants", *variants, "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((out / "step-time.json").read_text())
    assert [(r["variant"], r["ok"]) for r in data["runs"]] == [(v, True) for v in variants], \
        [r.get("error") for r in data["runs"]]
    runs = {r["variant"]: r for r in data["runs"]}
    for r in data["runs"]:
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
        assert r["n_matmul_params"] < r["n_params"] and r["ms_per_step"] > 0
        assert r["kernels_us_per_step"] and max(len(n) for n in r["kernels_us_per_step"]) <= 120
    assert runs["compile_ours"]["stats"]["replays"] == 0  # on a CPU the callback trains eagerly
    for v in ("reference", "compile_reference"):  # on a CPU capturable AdamW cannot step: trained unprepared
        assert any("trains unprepared" in n for n in runs[v]["notes"]), runs[v]["notes"]
    assert runs["reference"]["losses"] == runs["eager"]["losses"]
    page = (out / "step-time.page.md").read_text()
    assert "DRY RUN on CPU" in page and " vs compile, optimizer prepared |" in page  # compile + ours' reference
    assert "| eager, optimizer prepared |" in page and "| compile, optimizer prepared |" in page


def test_plan_prints_the_runs_and_runs_nothing_and_docs_are_never_written_from_a_dry_run(capsys):
    from benchmarks.harness.cli import main

    assert main(["--plan", "--gpus", "4", "--budget-s", "100", "--workloads", "llama1b-4x2048", "gpt-tiny"]) == 0
    out = capsys.readouterr().out
    assert "(matmul ceiling)" in out and "llama1b-4x2048" in out and "skipped: does not fit --budget-s" in out
    assert out.splitlines()[-1].startswith("31 jobs, 0 done; estimated ")
    with pytest.raises(SystemExit, match="smoke run"):
        main(["--dry-run", "--write-docs"])


def test_nemos_variant_gets_the_schedule_as_an_lrscheduler_subclass_with_the_same_learning_rates():
    """NeMo 3.0.0's callback asserts ``isinstance(scheduler, _LRScheduler)`` on train start, which torch's
    ``LambdaLR`` fails: its variant gets the same warm-up + cosine as such a subclass, every learning rate equal."""
    import warnings

    import torch

    from benchmarks.harness.child import build_module
    from benchmarks.harness.models import BenchLM
    from benchmarks.harness.workloads import dry_run

    w = replace(dry_run(WORKLOADS["gpt-tiny"]), steps=40)
    job = {"optim": "adamw"}

    def lrs(variant):
        cfg = build_module(job, w, VARIANTS[variant], cuda=False).configure_optimizers()
        opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
        seen = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the scheduler stepped without an optimizer step
            for _ in range(w.steps):
                seen.append([g["lr"] for g in opt.param_groups])
                sched.step()
        return sched, seen

    nemo_sched, nemo_lrs = lrs("nemo")
    eager_sched, eager_lrs = lrs("eager")
    assert isinstance(nemo_sched, torch.optim.lr_scheduler._LRScheduler)
    assert isinstance(eager_sched, torch.optim.lr_scheduler.LambdaLR)
    assert nemo_lrs == eager_lrs and len({lr[0] for lr in nemo_lrs}) > 10

    # On the GPU its optimizer is capturable with a tensor lr: the callback copies get_lr()'s values into the first
    # list it saw (Tensor.copy_), so they must be tensors, and the optimizer's lr tensor is filled in place.
    module = BenchLM(w, capturable=True, nemo_schedule=True, max_steps=w.steps, device="cpu")
    cfg = module.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    lr_tensor = opt.param_groups[0]["lr"]
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(w.steps):
            seen.append(float(opt.param_groups[0]["lr"]))
            assert all(isinstance(v, torch.Tensor) for v in sched.get_lr())
            sched.step()
    assert isinstance(lr_tensor, torch.Tensor) and opt.param_groups[0]["lr"] is lr_tensor
    assert seen == pytest.approx([lr[0] for lr in eager_lrs], rel=1e-6)


def test_a_resumed_table_quotes_a_command_that_regenerates_every_run_it_holds():
    from benchmarks.harness.cli import build_parser, table_command

    args = build_parser().parse_args(["--rounds", "1", "--workloads", "gpt-tiny", "--variants", "nemo"])
    assert "--workloads gpt-tiny --variants nemo" in table_command(args, [])
    resumed = [_run("eager", 0, 40.0), _run("compile_ours", 0, 9.0)]  # llama156m-2x512
    cmd = table_command(args, resumed)
    assert "--workloads llama156m-2x512 gpt-tiny --variants eager compile_ours nemo" in cmd, cmd
    every = [_run(v, 0, 1.0, workload=WORKLOADS[n].as_dict()) for n in DEFAULT_WORKLOADS for v in DEFAULT_VARIANTS]
    assert table_command(args, every) == \
        "python -m benchmarks.harness --rounds 1 --out benchmarks/results --write-docs"
