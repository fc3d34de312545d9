"""``benchmarks/fp8_scale.py``: the plan and its estimates, the FLOP count and MFU against each card's peak, the report
from run records and the docs section it writes, resuming, and the CPU smoke run through the harness's parent/child
plumbing (no GPU, no TransformerEngine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import fp8_scale as fs
from benchmarks.harness import runner

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"precision": "bf16-mixed", "optim": "MasterWeightAdamW", "lr": 3e-4, "clip": 0.0, "seed": 0,
            "deterministic": True, "device": "cuda", "dry_run": False, "lanes": 1, "rounds": 2, "steps": 220,
            "batch": 4, "baseline": "te_eager", "raw_name": fs.RAW_NAME, "child_module": "benchmarks.fp8_scale"}
H100 = "NVIDIA H100 80GB HBM3"


# ------------------------------------------------------------------------------------------------------------ plan


def test_the_plan_probes_once_then_alternates_every_recipes_variants_round_by_round():
    plan = fs.make_plan(["block", "delayed"], ["bf16", "te_eager", "ours"], 2, SETTINGS)
    assert [j["key"] for j in plan] == [
        "probe",
        "0/llama0.85b-block/te_eager", "0/llama0.85b-block/ours", "0/llama0.85b-block/bf16",
        "0/llama0.85b-delayed/te_eager", "0/llama0.85b-delayed/ours", "0/llama0.85b-delayed/bf16",
        "1/llama0.85b-block/te_eager", "1/llama0.85b-block/ours", "1/llama0.85b-block/bf16",
        "1/llama0.85b-delayed/te_eager", "1/llama0.85b-delayed/ours", "1/llama0.85b-delayed/bf16"]
    assert all(j["child_module"] == "benchmarks.fp8_scale" and j["lane"] == 0 for j in plan)
    assert plan[0]["recipes"] == ["block", "delayed"]
    w = plan[1]["workload"]
    assert (w["hidden"], w["layers"], w["heads"], w["kv_heads"], w["ffn"], w["vocab"], w["seq"], w["batch"]) == \
        (2048, 16, 16, 4, 5632, 32000, 2048, 4)
    assert (w["steps"], w["measure_from"], w["profile_steps"]) == (220, 55, 3)


def test_estimates_are_start_build_setup_and_steps_at_the_variants_planning_rate_scaled_by_the_batch():
    plan = fs.make_plan(["delayed"], ["te_eager", "te_graphed"], 1, SETTINGS)
    te_eager, te_graphed = plan[1], plan[2]
    assert te_eager["est_s"] == pytest.approx(fs.START_S + fs.BUILD_S + fs.END_S + 220 * 0.115)
    assert te_graphed["est_s"] == pytest.approx(fs.START_S + fs.BUILD_S + 10.0 + fs.END_S + 220 * 0.105)
    half = fs.make_plan(["delayed"], ["te_eager"], 1, {**SETTINGS, "batch": 2})[1]
    assert half["est_s"] == pytest.approx(fs.START_S + fs.BUILD_S + fs.END_S + 220 * 0.0575)
    assert plan[0]["est_s"] == fs.PROBE_S


def test_plan_text_counts_what_is_done_and_what_the_budget_leaves_out():
    plan = fs.make_plan(["delayed"], fs.DEFAULT_VARIANTS, 1, SETTINGS)
    text = fs.plan_text(plan, {"probe", "0/llama0.85b-delayed/te_eager"}, budget_s=100.0)
    lines = text.splitlines()
    assert "(probe: TE, ceilings)" in lines[1] and "done (resumed)" in lines[1]
    assert "te_eager" in lines[2] and "done (resumed)" in lines[2]
    assert "ours " in lines[3] and lines[3].rstrip().endswith(f"{plan[2]['est_s']:.0f}")  # fits: 70 s of 100
    assert all("skipped: does not fit --budget-s" in x for x in lines[4:7]), text  # 70 + 70 or more > 100
    todo = sum(j["est_s"] for j in plan[2:])
    assert lines[-1].startswith(f"6 jobs, 2 done; estimated {todo:.0f} s of runs"), lines[-1]
    assert lines[-1].endswith("3 skipped by --budget-s 100")


def test_plan_runs_without_torch_or_transformer_engine():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformer_engine'] = None\n"
            "from benchmarks.fp8_scale import main\n"
            "raise SystemExit(main(['--plan', '--recipes', 'current', '--rounds', '1', '--budget-s', '200']))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "llama0.85b-current" in p.stdout and "6 jobs, 0 done" in p.stdout
    assert "skipped by --budget-s 200" in p.stdout


def test_a_real_run_needs_a_gpu_and_at_least_200_steps(capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert fs.main(["--recipes", "delayed", "--rounds", "1"]) == 2
    assert "needs a CUDA GPU with TransformerEngine" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="at least 200 steps"):
        fs.main(["--steps", "199"])
    with pytest.raises(SystemExit, match="smoke run"):
        fs.main(["--dry-run", "--write-docs"])


# -------------------------------------------------------------------------------------------------- FLOPs and MFU


def test_the_flop_count_is_six_n_tokens_plus_causal_attention_with_n_the_gemm_weights_and_the_head():
    s = fs.shape_for("delayed")
    per_layer = 2048 * (2048 + 2 * 512) + 2048 * 2048 + 2048 * 2 * 5632 + 5632 * 2048  # QKV (GQA 4), out, FFN in, out
    assert fs.layer_matmul_params(s) == per_layer == 45_088_768
    assert fs.matmul_params(s) == 16 * per_layer + 32000 * 2048 == 786_956_288
    assert fs.total_params(s) == 786_956_288 + 32000 * 2048 + 33 * 2048 == 852_559_872
    flops = 6 * 786_956_288 * 8192 + 6 * 16 * 2048**2 * 2048 * 4
    assert fs.flops_per_step(s) == pytest.approx(flops)
    assert fs.flops_per_step(s) == pytest.approx(4.1978e13, rel=1e-4)
    assert fs.flops_per_step(s, n_matmul=1) == pytest.approx(6 * 8192 + 6 * 16 * 2048**2 * 2048 * 4)
    assert "0.85 B" in s.title and "`DelayedScaling`" in s.title
    assert "16 heads / 4 KV groups, SwiGLU 5632" in fs.model_text(s.as_dict())


def test_mfu_is_against_the_cards_dense_fp8_peak_and_bf16_rows_against_the_dense_bf16_peak():
    assert fs.peak_tflops(H100, fp8=True) == 1979.0 and fs.peak_tflops(H100, fp8=False) == 989.4
    assert fs.peak_tflops("NVIDIA H200", True) == 1979.0 and fs.peak_tflops("NVIDIA H200", False) == 989.4
    assert fs.peak_tflops("NVIDIA H100 PCIe", True) == 1513.0 and fs.peak_tflops("NVIDIA H100 NVL", False) == 835.0
    assert fs.peak_tflops("NVIDIA H200 NVL", True) == 1671.0
    assert fs.card_of(H100) == ("H100 SXM", True) and fs.card_of("NVIDIA A100-SXM4-80GB") == ("H100 SXM", False)
    flops = fs.flops_per_step(fs.shape_for("current"))
    assert fs.mfu(flops, 50.0, 1979.0) == pytest.approx(flops / 0.05 / 1.979e15)
    assert fs.mfu(flops, 50.0, 1979.0) == pytest.approx(0.4242, abs=1e-4)
    assert fs.mfu(None, 50.0, 1979.0) is None and fs.mfu(flops, None, 1979.0) is None


# ---------------------------------------------------------------------------------------------------------- report


def _w(recipe: str) -> dict:
    return fs.shape_for(recipe).as_dict()


def _run(variant: str, rnd: int, ms, *, recipe="delayed", losses=(10.0, 6.0, 4.0), peak_gib=30.0, floor=None,
         ok=True, **kw) -> dict:
    w = _w(recipe)
    r = {**SETTINGS, "kind": "variant", "workload": w, "variant": variant, "round": rnd, "ok": ok,
         "ms_per_step": ms if ok else None, "losses": list(losses), "peak_mem_bytes": int(peak_gib * 2**30),
         "peak_reserved_bytes": int((peak_gib + 2) * 2**30), "floor_ms": floor, "n_params": 852_559_872,
         "n_matmul_params": 786_956_288, "notes": [], "key": f"{rnd}/{w['name']}/{variant}", "env": {"gpu": H100}}
    r.update(kw)
    return r


VERIFY_CLEAN = {"checked": 64, "stale": 0, "stale_flagged": 0, "skipped": 0}
VERIFY_FLAGGED = {"checked": 64, "stale": 64, "stale_flagged": 64, "skipped": 0}


def _data(runs: list[dict], support=None) -> dict:
    probe = {"kind": "probe", "ok": True, "key": "probe", "env": {"gpu": H100, "date": "2026-12-07",
                                                                  "torch": "2.11.0", "transformer_engine": "2.20.2",
                                                                  "capability": [9, 0]},
             "support": support or {"delayed": [True, ""], "block": [False, "FP8 block scaled GEMM requires CUDA "
                                                                            ">= 12.9."]},
             "ceilings": {"bf16_tflops": 700.0, "fp8_tflops": 1300.0}}
    return fs.as_data({**SETTINGS, "command": "python -m benchmarks.fp8_scale --recipes delayed block"},
                      [probe, *runs], complete=True)


def _synthetic() -> dict:
    runs = []
    for rnd, scale in ((0, 1.0), (1, 1.1)):
        runs += [
            _run("te_eager", rnd, 100.0 * scale, floor=80.0, verify=VERIFY_FLAGGED, refresh_per_tensor_ms=0.9),
            _run("ours", rnd, 85.0 * scale, floor=80.0, peak_gib=31.5, verify=VERIFY_CLEAN, refresh_fused_ms=0.5,
                 refresh_per_tensor_ms=0.9, stats={"replays": 214}),
            _run("te_graphed", rnd, 95.0 * scale, floor=82.0, verify=VERIFY_CLEAN, refresh_per_tensor_ms=0.9,
                 te_graphs_s=6.5),
            _run("ours_no_refresh", rnd, 84.0 * scale, verify=VERIFY_FLAGGED, refresh_per_tensor_ms=0.9,
                 stats={"replays": 214}),
            _run("bf16", rnd, 140.0 * scale, losses=(10.0, 6.0, 4.125), peak_gib=40.0),
        ]
    runs += [_run("te_eager", 0, None, recipe="block", ok=False, unsupported="FP8 block scaled GEMM requires CUDA "
                  ">= 12.9.", error="not run: FP8 block scaled GEMM requires CUDA >= 12.9.")]
    return _data(runs)


def test_each_row_is_compared_with_te_eager_of_its_round_and_mfu_uses_the_fp8_or_bf16_peak():
    data = _synthetic()
    (delayed, block) = fs.aggregate(data)
    assert delayed["recipe"] == "delayed" and block["recipe"] == "block"
    v = delayed["variants"]
    assert list(v) == ["te_eager", "ours", "te_graphed", "ours_no_refresh", "bf16"]
    assert v["ours"]["ratio_rounds"] == pytest.approx([0.85, 0.85])
    assert v["ours"]["ms_per_step"] == pytest.approx(89.25)  # median of 85 and 93.5
    flops = fs.flops_per_step(_w("delayed"))
    assert v["ours"]["mfu"] == pytest.approx(flops / 0.08925 / 1979e12)
    assert v["bf16"]["mfu"] == pytest.approx(flops / 0.147 / 989.4e12)
    assert v["ours"]["over_floor"] == pytest.approx(89.25 / 80.0)
    assert v["te_eager"]["max_dloss"] == 0.0 and v["ours"]["max_dloss"] == 0.0
    assert v["bf16"]["max_dloss"] == 0.125 and v["bf16"]["first_diff_step"] == 2
    assert v["ours"]["peak_over_ref"] == pytest.approx(31.5 / 30.0)
    assert v["ours"]["reserved_over_ref"] == pytest.approx(33.5 / 32.0)
    assert v["te_eager"]["peak_over_ref"] is None
    assert v["ours"]["alone_ms"] == 0.5 and v["ours"]["alone_share"] == pytest.approx(0.5 / 89.25)
    assert v["te_graphed"]["alone_ms"] == 0.9  # its transposes: TE's, per tensor
    assert v["bf16"]["alone_ms"] is None and v["ours"]["replays"] == 214
    assert block["unsupported"].startswith("FP8 block scaled GEMM")


def test_the_page_block_shows_every_row_the_stale_transposes_and_why_a_recipe_did_not_run():
    data = _synthetic()
    page = fs.page_block(data, data["settings"]["command"])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in page.splitlines() if line.startswith("| ")}
    assert "| 89.25 | 85.00, 93.50 | 0.850, 0.850 |" in rows["ours"]
    assert "0 of 64" in rows["ours"] and "0.500 ms = 0.56 % (one launch)" in rows["ours"]
    assert "**64** of 64, all flagged |" in rows["ours, no refresh"]
    assert "0.900 ms" in rows["TE graphed layers"] and "(per tensor)" in rows["TE graphed layers"]
    assert f"{100 * fs.flops_per_step(_w('delayed')) / 0.147 / 989.4e12:.1f} % of 989.4" in rows["BF16"]
    assert "0.125" in rows["BF16"] and "| 0 (bitwise) |" in rows["ours"]
    assert "Not run: FP8 block scaled GEMM requires CUDA >= 12.9.\n" in page
    assert "delayed: yes; block: no (FP8 block scaled GEMM" in page.replace("\n  ", " ")
    assert "measured GEMM ceilings on this GPU: BF16 700 TFLOP/s; FP8 1300 TFLOP/s" in page.replace("\n  ", " ")
    assert "`make_graphed_callables` took 6.5 s" in page
    assert "- ours / TE eager, ms/step (llama0.85b-delayed): 0.85 (target <= 1): met" in page
    assert "- ours (FP8) / BF16, ms/step (llama0.85b-delayed): 0.6071 (target < 1): met" in page
    assert "(llama0.85b-block)" not in page  # no checks of a recipe that did not run
    assert "**DRY RUN" not in page and "**Partial" not in page
    assert all(len(x) <= 118 for x in page.splitlines() if not x.startswith("|"))


def test_skipped_and_failed_runs_are_said_so_and_a_dry_run_is_marked():
    data = _data([_run("te_eager", 0, 100.0), _run("ours", 0, None, ok=False, skipped=True, error="skipped: x"),
                  _run("te_graphed", 0, None, ok=False, error="RuntimeError: capture failed")])
    page = fs.page_block(data, "cmd")
    assert "| ours | skipped (budget) |" in page and "| TE graphed layers | failed: RuntimeError: capture failed |" in page
    assert "**Partial:** 1 run(s) did not fit `--budget-s` (0/llama0.85b-delayed/ours)" in page
    data["settings"]["dry_run"] = True
    assert "**DRY RUN on CPU**" in fs.page_block(data, "cmd")


def test_write_docs_appends_its_section_once_then_replaces_only_that_section(tmp_path):
    real = (ROOT / "docs" / "results" / "fp8.md").read_text()
    page = tmp_path / "fp8.md"
    page.write_text(real)
    data = _synthetic()
    fs.write_docs(data, fs.page_block(data, "cmd"), page)
    once = page.read_text()
    assert once.count(fs.BEGIN) == 1 and once.count(fs.END) == 1 and once.index(fs.BEGIN) < once.index(fs.END)
    head = real[:real.index(fs.BEGIN)] if fs.BEGIN in real else real.rstrip("\n")
    assert once.startswith(head) and "| ours | 89.25 |" in once
    fs.write_docs(data, fs.page_block(data, "cmd"), page)
    assert page.read_text() == once
    page.write_text(once.replace("| ours | 89.25 |", "| ours | 1.00 |") + "\nafter the section\n")
    fs.write_docs(data, fs.page_block(data, "cmd"), page)
    assert page.read_text() == once + "\nafter the section\n"
    assert json.loads((tmp_path / fs.RAW_NAME).read_text())["runs"][0]["variant"] == "te_eager"


def test_the_quoted_command_regenerates_every_recipe_and_variant_the_file_holds():
    args = fs.build_parser().parse_args(["--recipes", "current", "--rounds", "1"])
    assert fs.canonical_command(args) == ("python -m benchmarks.fp8_scale --recipes current --rounds 1 "
                                          "--out benchmarks/results/fp8_scale --write-docs")
    resumed = [_run("te_eager", 0, 100.0, recipe="block"), _run("bf16_ours", 0, 100.0, recipe="current")]
    cmd = fs.canonical_command(args, resumed)
    assert "--recipes current block --rounds 1 --variants te_eager ours te_graphed ours_no_refresh bf16 bf16_ours" \
        in cmd, cmd


def test_resume_keeps_successful_runs_and_refuses_a_file_with_other_steps_or_another_gpu(tmp_path):
    data = _synthetic()
    path = tmp_path / fs.RAW_NAME
    path.write_text(json.dumps(data))
    settings = dict(data["settings"])
    keep, done = runner.load_resume(path, settings, H100, keys=fs.RESUME_KEYS)
    assert len(keep) == 10 and "0/llama0.85b-delayed/ours" in done and "0/llama0.85b-block/te_eager" not in done
    with pytest.raises(SystemExit, match="steps=220"):
        runner.load_resume(path, {**settings, "steps": 300}, H100, keys=fs.RESUME_KEYS)
    runner.load_resume(path, {**settings, "steps": 300}, H100)  # the harness's own keys leave steps out
    with pytest.raises(SystemExit, match="timed on NVIDIA H100"):
        runner.load_resume(path, settings, "NVIDIA H200", keys=fs.RESUME_KEYS)


def test_the_runner_starts_each_job_in_its_own_child_module(monkeypatch, tmp_path):
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        Path(cmd[cmd.index("--record") + 1]).write_text(json.dumps({"ok": True, "ms_per_step": 1.0}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    job = fs.make_plan(["delayed"], ["ours"], 1, SETTINGS)[1]
    assert runner.run_child(job, 10.0, lambda _: None)["ok"]
    assert seen[-1][1:3] == ["-m", "benchmarks.fp8_scale"] and seen[-1][3] == "--child"
    runner.run_child({k: v for k, v in job.items() if k != "child_module"}, 10.0, lambda _: None)
    assert seen[-1][1:3] == ["-m", "benchmarks.harness"]


# ------------------------------------------------------------------------------------------------ the child's parts


def test_the_dry_run_stand_in_has_the_formulas_parameter_count_and_te_graph_arguments_follow_the_te_api():
    torch = pytest.importorskip("torch")
    from benchmarks import fp8_scale_model as fm

    w = fs.shape_for("delayed", dry_run=True).as_dict()
    model = fm.LlamaTE(w, fp8=False, recipe=None, te=None, device=torch.device("cpu"))
    assert sum(p.numel() for p in model.parameters()) == fs.total_params(w)
    assert sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n) == \
        fs.matmul_params(w)
    ids = torch.randint(0, w["vocab"], (w["batch"], w["seq"]))
    assert model(ids).shape == (w["batch"], w["seq"], w["vocab"])
    f = fm.rope_freqs(None, 16, 8, torch.device("cpu"))
    assert f.shape == (8, 1, 1, 16) and torch.equal(f[..., :8], f[..., 8:])
    assert f[3, 0, 0, 1].item() == pytest.approx(3 / 10000 ** (2 / 16))

    def new_api(modules, sample_args, *, enabled=None, recipe=None, cache_quantized_params=None):
        pass

    def old_api(modules, sample_args, *, fp8_enabled=False, fp8_recipe=None, fp8_weight_caching=False):
        pass

    rec = object()
    assert fm.te_graph_kwargs(new_api, True, rec) == {"enabled": True, "recipe": rec, "cache_quantized_params": False}
    assert fm.te_graph_kwargs(old_api, True, rec) == {"fp8_enabled": True, "fp8_recipe": rec,
                                                      "fp8_weight_caching": False}
    assert fm.te_graph_kwargs(new_api, False, rec)["recipe"] is None


def test_the_cpu_smoke_run_goes_through_the_harness_plumbing_and_resumes(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.fp8_scale", "--dry-run", "--rounds", "1", "--recipes", "delayed",
           "--variants", "te_eager", "ours", "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((tmp_path / fs.RAW_NAME).read_text())
    assert data["probe"]["ok"] and data["settings"]["complete"] and data["settings"]["dry_run"]
    assert [(r["variant"], r["ok"], len(r["losses"])) for r in data["runs"]] == [("te_eager", True, 3),
                                                                                ("ours", True, 3)]
    ours = data["runs"][1]
    assert ours["stats"]["eager_reasons"] == {"no CUDA device": 3} and ours["verify"]["checked"] == 0
    assert ours["n_matmul_params"] == ours["n_matmul_params_formula"]
    assert "**DRY RUN on CPU**" in (tmp_path / "fp8-scale.page.md").read_text()
    again = subprocess.run([*cmd, "--resume", str(tmp_path / fs.RAW_NAME)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "3 jobs, 3 done" in again.stdout and "[lane" not in again.stdout


def test_a_recipe_whose_weights_no_fp32_master_optimizer_here_writes_is_not_run_and_says_why():
    # block scaling runs on Hopper (TE's check passes), but MasterWeightAdamW, which every FP8 row trains with, refuses
    # its block-scaled weights: the group is reported as not run before any device time is spent on it
    plan = fs.make_plan(["delayed", "block"], ["bf16", "te_eager", "ours"], 1, SETTINGS)
    support = {"delayed": (True, ""), "block": (True, "")}
    recs, todo = fs._unsupported_records(plan[1:], support)
    assert [j["key"] for j in todo] == ["0/llama0.85b-delayed/te_eager", "0/llama0.85b-delayed/ours",
                                        "0/llama0.85b-delayed/bf16"]
    assert {r["key"] for r in recs} == {"0/llama0.85b-block/te_eager", "0/llama0.85b-block/ours",
                                        "0/llama0.85b-block/bf16"}
    assert all("MasterWeightAdamW" in r["unsupported"] for r in recs)
    # TE's own reason wins where TE refuses the recipe
    recs, _ = fs._unsupported_records(plan[1:], {"block": (False, "FP8 block scaled GEMM requires CUDA >= 12.9")})
    assert all(r["unsupported"].startswith("FP8 block scaled GEMM") for r in recs)
