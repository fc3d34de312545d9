"""CPU tests of ``benchmarks/megatron_bed.py`` and ``benchmarks/megatron_session.sh`` (the GPU parts run on the host).

Unmarked: argument parsing, the report's verdicts on hand-made records, the session script (syntax, and that it
produces every arm the GPU test reads). ``@pytest.mark.nemo`` (``.venv-nemo``, real megatron-core 0.16.1): each
arm's ``TransformerConfig`` built through the flag's own ``apply_megatron_graph_fields``, and a run on a machine
without CUDA ends in a record that says so.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import megatron_bed as bed  # noqa: E402

REQUIRE_NEMO = os.environ.get("NCG_REQUIRE_NEMO") == "1"


def _need(module: str):
    if REQUIRE_NEMO:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed (ci/stages.sh nemo builds .venv-nemo)")


def test_arguments_and_their_checks():
    cfg = bed.parse_args(["--mode", "full", "--steps", "7", "--no-gaf", "--param-gather-refresh"])
    assert (cfg.mode, cfg.steps, cfg.gaf, cfg.param_gather_refresh, cfg.tag) == ("full", 7, False, True, "full")
    assert bed.parse_args([]).fp8 == "hybrid" and bed.parse_args([]).fp8_params
    assert bed.parse_args(["--fp8", "none"]).fp8_params is False
    with pytest.raises(ValueError, match="microbatches must be >= 2"):
        bed.parse_args(["--microbatches", "1"])
    with pytest.raises(ValueError, match="use --mode layer"):
        bed.parse_args(["--mode", "full", "--break-grad-added"])
    with pytest.raises(ValueError, match="only makes sense with --break-grad-added"):
        bed.parse_args(["--mode", "layer", "--guard-fused-wgrad"])
    with pytest.raises(SystemExit):
        bed.parse_args(["--mode", "graphs"])


def _rec(tag, losses, grad_norms=None, mode="layer", graphs=None, **extra):
    rec = {"tag": tag, "mode": mode, "losses": losses, "grad_norms": grad_norms or [1.0] * len(losses),
           "ms": [10.0] * len(losses), "excluded_steps": [], "fp8_checks": [], "graphs": graphs, "error": None}
    rec.update(extra)
    rec["summary"] = bed.summarize(rec, timing_skip=1)
    return rec


def test_report_verdicts():
    a = _rec("eager_a", [3.0, 2.5, 2.0], mode="eager")
    b = _rec("eager_b", [3.0, 2.5, 2.0], mode="eager")
    same = _rec("layer", [3.0, 2.5, 2.0], graphs={"layer_fwd_graphs": 2, "layer_bwd_graphs": 2,
                                                   "full_iteration_graphs": 0})
    off = _rec("full", [3.0, 2.5, 2.0001], mode="full")
    nan = _rec("seed000_break", [3.0, float("nan"), float("nan")], grad_norms=[1.0, float("nan"), float("nan")])
    s = bed.compare([a, b, same, off, nan])
    verdicts = {r["tag"]: r.get("verdict") for r in s["rows"]}
    assert verdicts == {"eager_a": None, "eager_b": "bitwise", "layer": "bitwise", "full": "differs",
                        "seed000_break": "NaN"}
    # With eager-vs-eager noise, a graphed arm inside it is "within eager noise"; outside it still "differs".
    b2 = _rec("eager_b", [3.0, 2.5, 2.0002], mode="eager")
    s = bed.compare([a, b2, off, _rec("layer", [3.0, 2.5, 2.0003])])
    verdicts = {r["tag"]: r.get("verdict") for r in s["rows"]}
    assert verdicts["full"] == "within eager noise" and verdicts["layer"] == "differs"
    assert math.isclose(s["noise"]["max_abs"], 0.0002, rel_tol=1e-6) and s["noise"]["bitwise_steps"] == 2
    text = bed.table(s)
    assert "eager-vs-eager noise" in text and "within eager noise" in text
    md = bed.markdown([a, b2, off], s)
    assert md.startswith("# Megatron-core test bed") and "## full (mode full)" in md
    err = _rec("full", [], mode="full", traceback="Traceback...\nRuntimeError: boom")
    err["error"] = "RuntimeError: boom"
    s = bed.compare([a, b, err])
    assert "ERROR" in bed.table(s) and "**error**: RuntimeError: boom" in bed.markdown([a, b, err], s)


def test_summary_leaves_verified_forced_and_warmup_steps_out_of_the_timing():
    rec = _rec("x", [1.0] * 6)
    rec["ms"] = [100.0, 50.0, 10.0, 11.0, 99.0, 12.0]
    rec["excluded_steps"] = [4]
    rec["fp8_checks"] = [{"step": 4, "checked": 3, "stale": 2, "stale_unflagged": 1, "flagged": 1,
                          "after_forced_sync": True}]
    s = bed.summarize(rec, timing_skip=2)
    assert s["ms_median"] == 11.0 and s["timed_steps"] == 3
    assert (s["fp8_stale"], s["fp8_stale_unflagged"], s["fp8_stale_after_forced"], s["fp8_checked"]) == (2, 1, 2, 3)


def test_report_command(tmp_path, capsys):
    paths = []
    for r in (_rec("eager_a", [2.0, 1.0], mode="eager"), _rec("eager_b", [2.0, 1.0], mode="eager"),
              _rec("layer", [2.0, 1.0])):
        p = tmp_path / f"{r['tag']}.json"
        p.write_text(json.dumps(r))
        paths.append(str(p))
    (tmp_path / "broken.json").write_text("{")
    rc = bed.main(["report", *paths, str(tmp_path / "broken.json"), "--md", str(tmp_path / "r.md"),
                   "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr()
    assert rc == 0 and "layer" in out.out and "skipped" in out.err
    data = json.loads((tmp_path / "r.json").read_text())
    assert [r["tag"] for r in data["summary"]["rows"]] == ["eager_a", "eager_b", "layer"]
    assert bed.main(["report", str(tmp_path / "broken.json")]) == 2


def test_session_script_runs_every_arm_the_gpu_test_reads():
    script = os.path.join(ROOT, "benchmarks", "megatron_session.sh")
    subprocess.run(["bash", "-n", script], check=True)
    text = open(script).read()
    tags = set(re.findall(r"--tag (\w+)", text))
    test = open(os.path.join(ROOT, "tests", "gpu", "test_megatron_gpu.py")).read()
    arms = set(re.findall(r'^    "(\w+)": \[', test, re.M))
    assert arms and arms <= tags, arms - tags
    for tag in tags:  # each arm writes its record where the report and the GPU test look
        assert f'--tag {tag} --out "$P/{tag}.json"' in text
    assert set(re.search(r'ARMS="([^"]+)"', text).group(1).split()) == tags  # the report reads every arm
    assert "timeout" in text and "MEGATRON_BED_RECORDS" in text and ".te/final/install_on_host.sh" in text


# -- real megatron-core ------------------------------------------------------------------------------------------


@pytest.mark.nemo
def test_each_arm_config_goes_through_the_flag_function():
    _need("megatron.core")
    from megatron.core.transformer.enums import CudaGraphScope

    tc, info = bed.transformer_config(bed.parse_args(["--mode", "eager"]))
    assert tc.cuda_graph_impl == "none" and info["changes"] == [] and tc.use_te_rng_tracker
    assert tc.fp8 == "hybrid" and tc.fp8_param and tc.gradient_accumulation_fusion
    tc, info = bed.transformer_config(bed.parse_args(["--mode", "layer", "--warmup-steps", "3"]))
    assert tc.cuda_graph_impl == "local" and tc.cuda_graph_scope == [] and tc.cuda_graph_warmup_steps == 3
    assert any("cuda_graph_impl" in c for c in info["changes"]) and info["full_iteration"] is False
    assert tc.gradient_accumulation_fusion  # megatron-core 0.16.1 restores grad_added_to_main_grad
    tc, info = bed.transformer_config(bed.parse_args(["--mode", "full"]))
    assert tc.cuda_graph_scope == [CudaGraphScope.full_iteration] and info["full_iteration"]
    tc, info = bed.transformer_config(bed.parse_args(["--mode", "layer", "--break-grad-added",
                                                      "--guard-fused-wgrad"]))
    assert tc.gradient_accumulation_fusion is False and "#1279" in info["notes"][0]
    ddp = bed.ddp_config(bed.parse_args([]))
    assert ddp.overlap_param_gather and ddp.overlap_grad_reduce and ddp.use_distributed_optimizer
    assert ddp.fp8_param_gather and not ddp.check_for_nan_in_grad


@pytest.mark.nemo
def test_a_run_without_cuda_ends_in_a_record_that_says_so(tmp_path):
    _need("megatron.core")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the GPU test runs the bed for real")
    out = tmp_path / "layer.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "megatron_bed.py"), "--mode", "layer",
                           "--steps", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    rec = json.loads(out.read_text())
    assert "needs a CUDA device" in rec["error"] and rec["losses"] == []
    assert "BED layer:" in proc.stdout
