"""CPU tests of ``benchmarks/megatron_bed.py`` and ``benchmarks/megatron_session.sh`` (the GPU parts run on the host).

Unmarked: argument parsing, the report's verdicts on hand-made records, the session script (syntax, and that it
produces every arm the GPU test reads). ``@pytest.mark.nemo`` (``.venv-nemo``, real megatron-core 0.16.1): each
arm's ``TransformerConfig`` built through the flag's own ``apply_megatron_graph_fields``, and a run on a machine
without CUDA ends in a record that says so.
"""

from __future__ import annotations

import dataclasses
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
    cfg = bed.parse_args(["--mode", "layer", "--keep-graph-inputs", "--grad-fingerprints", "3"])
    assert (cfg.keep_graph_inputs, cfg.grad_fingerprints) == (True, 3)
    with pytest.raises(ValueError, match="--keep-graph-inputs .*use --mode layer"):
        bed.parse_args(["--mode", "eager", "--keep-graph-inputs"])
    with pytest.raises(ValueError, match="--grad-fingerprints N"):
        bed.parse_args(["--grad-fingerprints", "-1"])


def test_the_1b_shape_sets_the_sizes_and_flags_given_after_it_win():
    cfg = bed.parse_args(["--shape", "1b", "--mode", "full"])
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.seq_length, cfg.micro_batch_size, cfg.microbatches) == \
        (16, 2048, 16, 2048, 1, 4)
    assert 0.9e9 < bed.parameter_count(cfg) < 1.0e9 and cfg.bucket_params == 40_000_000 and cfg.tag == "full"
    assert bed.parse_args(["--shape", "1b", "--steps", "7", "--layers", "2"]).steps == 7
    assert bed.parse_args(["--layers", "2", "--shape", "1b"]).layers == 2
    small = bed.parse_args([])
    assert (small.layers, small.hidden, small.steps) == (2, 256, 120)
    # a 1 B arm is a configuration group of its own: never compared with a small arm's eager reference
    assert bed.group_key({"config": dataclasses.asdict(cfg)}) != bed.group_key({"config": dataclasses.asdict(small)})
    with pytest.raises(SystemExit):
        bed.parse_args(["--shape", "7b"])


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
    # Losses equal but gradient norms outside the eager spread (0 here): a different run, not noise.
    grads_off = _rec("layer", [3.0, 2.5, 2.0], grad_norms=[1.0, 1.0001, 1.0])
    s2 = bed.compare([a, b2, grads_off])
    assert {r["tag"]: r.get("verdict") for r in s2["rows"]}["layer"] == "differs"
    (group,) = s["groups"]  # hand-made records without a config: one group, BedConfig's defaults
    noise = group["noise"]
    assert math.isclose(noise["max_abs"], 0.0002, rel_tol=1e-6) and noise["bitwise_steps"] == 2
    assert (group["reference"], group["noise_arm"]) == ("eager_a", "eager_b")
    text = bed.table(s)
    assert "eager-vs-eager noise" in text and "within eager noise" in text
    md = bed.markdown([a, b2, off], s)
    assert md.startswith("# Megatron-core test bed") and "## full (mode full)" in md
    err = _rec("full", [], mode="full", traceback="Traceback...\nRuntimeError: boom")
    err["error"] = "RuntimeError: boom"
    s = bed.compare([a, b, err])
    assert "ERROR" in bed.table(s) and "**error**: RuntimeError: boom" in bed.markdown([a, b, err], s)


def _cfg(**kw):
    return dataclasses.asdict(bed.BedConfig(**kw))


def test_grad_fingerprints_name_the_parameters_whose_main_grad_is_not_bitwise_the_references():
    import torch

    class Wrapped(torch.nn.Module):  # the DDP wrapper's "module." prefix, as megatron-core's DDP has it
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))

    def grads(model, bump=None, scale=None):
        for name, p in model.named_parameters():
            g = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / 7 + 1
            if name.endswith(bump or "-"):
                g.view(-1)[0] = -g.view(-1)[0]  # one element's sign: other bytes, the very same norm
            if name.endswith(scale or "-"):
                g = g * 2
            p.main_grad = g
        return bed.grad_fingerprints(model)

    model = Wrapped()
    ref_fp = grads(model)
    assert sorted(ref_fp) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert ref_fp["0.weight"]["numel"] == 12 and ref_fp["0.weight"]["nonfinite"] == 0
    ref = _rec("dg_eager", [2.0, 1.0], mode="eager", grad_fingerprints={"0": ref_fp, "1": ref_fp})
    layer = _rec("dg_layer", [2.0, 1.0], grad_fingerprints={"0": grads(model),
                                                             "1": grads(model, bump="1.weight", scale="0.bias")})
    s = bed.compare([ref, layer])
    row = next(r for r in s["rows"] if r["tag"] == "dg_layer")
    step0, step1 = row["grads_vs_ref"]
    assert (step0["step"], step0["params"], step0["differ"]) == (0, 4, [])
    # bitwise is judged on the bytes: a flipped sign is named although the norm does not move at all
    assert [d["param"] for d in step1["differ"]] == ["0.bias", "1.weight"], step1
    assert math.isclose(step1["differ"][0]["norm_rel_diff"], 1.0) and step1["differ"][1]["norm_rel_diff"] == 0.0
    text = bed.table(s)
    assert "dg_layer main_grad vs dg_eager step 0: 0/4 params not bitwise" in text, text
    assert re.search(r"step 1: 2/4 params not bitwise: 0\.bias \(1\), 1\.weight \(\S+\) \(norm rel Δ\)", text), text


def test_every_arm_is_compared_with_the_eager_arms_of_its_own_configuration():
    # The default set: FP8 primary weights, 120 steps; its 60-step FP8 arms see other data (another group).
    eager_a = _rec("eager_a", [3.0, 2.5, 2.0], mode="eager", config=_cfg(tag="eager_a"))
    eager_b = _rec("eager_b", [3.0, 2.5, 2.0001], mode="eager", config=_cfg(tag="eager_b"))
    full = _rec("full", [3.0, 2.5, 2.00005], mode="full", config=_cfg(mode="full", overlap_param_gather=False))
    forced = _rec("fp8_forced", [4.0, 3.6, 3.3], mode="eager", config=_cfg(steps=60, force_sync_every=10))
    fixed = _rec("fp8_forced_fixed", [4.0, 3.5, 3.0], mode="eager",
                 config=_cfg(steps=60, force_sync_every=10, param_gather_refresh=True))
    align = _rec("align_each_step", [4.0, 3.5, 3.0], mode="eager", config=_cfg(steps=60, align_every_step=True))
    # No FP8 primary weights: its own eager pair (bitwise to each other) and a per-layer arm.
    np_a = _rec("np_eager_a", [5.0, 4.0, 3.0], mode="eager", config=_cfg(fp8_params=False))
    np_layer = _rec("np_layer", [5.0, 4.0, 3.0], config=_cfg(mode="layer", fp8_params=False, warmup_steps=3))
    np_b = _rec("np_eager_b", [5.0, 4.0, 3.0], mode="eager", config=_cfg(fp8_params=False))
    np_guard = _rec("np_seed000_guard", [5.0, 4.0, 3.00001],
                    config=_cfg(mode="layer", fp8_params=False, break_grad_added=True, guard_fused_wgrad=True))
    lone = _rec("bf_layer", [6.0, 5.0, 4.0], config=_cfg(mode="layer", fp8="none"))
    records = [eager_a, forced, fixed, np_a, np_layer, eager_b, full, align, np_b, np_guard, lone]
    s = bed.compare(records)
    rows = {r["tag"]: r for r in s["rows"]}
    ref = {t: r["reference"] for t, r in rows.items()}
    assert ref == {"eager_a": "eager_a", "eager_b": "eager_a", "full": "eager_a", "fp8_forced": "align_each_step",
                   "fp8_forced_fixed": "align_each_step", "align_each_step": "align_each_step",
                   "np_eager_a": "np_eager_a", "np_layer": "np_eager_a", "np_eager_b": "np_eager_a",
                   "np_seed000_guard": "np_eager_a", "bf_layer": None}
    verdicts = {t: r.get("verdict") for t, r in rows.items()}
    assert verdicts == {"eager_a": None, "eager_b": "within eager noise", "full": "within eager noise",
                        "fp8_forced": "differs", "fp8_forced_fixed": "bitwise", "align_each_step": None,
                        "np_eager_a": None, "np_layer": "bitwise", "np_eager_b": "bitwise",
                        # np's eager pair is bitwise: its noise floor is 0, the default group's 1e-4 does not apply
                        "np_seed000_guard": "differs", "bf_layer": "no eager ref"}
    groups = {g["reference"]: g for g in s["groups"]}
    assert groups["np_eager_a"]["noise_arm"] == "np_eager_b" and groups["np_eager_a"]["noise"]["max_abs"] == 0
    assert groups["eager_a"]["noise_arm"] == "eager_b" and groups["align_each_step"]["noise_arm"] is None
    assert set(groups["eager_a"]["tags"]) == {"eager_a", "eager_b", "full"}
    assert "steps=60" in groups["align_each_step"]["label"] and "fp8_params=False" in groups["np_eager_a"]["label"]
    text = bed.table(s)
    assert re.search(r"^np_layer +G\d +\S+ +\S+ +np_eager_a ", text, re.M), text
    assert "no plain eager arm, no verdicts" in text and "no second eager arm" in text
    md = bed.markdown(records, s)
    assert "compared with `np_eager_a`" in md and "no plain eager arm in its group" in md
    # --reference / --noise pick inside a group that holds them; other groups keep their first / second eager arm.
    s = bed.compare(records, reference="eager_b", noise="eager_a")
    rows = {r["tag"]: r for r in s["rows"]}
    assert rows["full"]["reference"] == "eager_b" and rows["np_layer"]["reference"] == "np_eager_a"


def test_every_bed_option_is_either_part_of_a_group_or_a_run_switch():
    fields = [f.name for f in dataclasses.fields(bed.BedConfig)]
    assert not set(bed.GROUP_FIELDS) & set(bed.RUN_FIELDS)
    assert sorted(bed.GROUP_FIELDS + bed.RUN_FIELDS) == sorted(fields)
    # --fp8 none has no FP8 primary weights whatever fp8_params says in an older record
    assert bed.group_key({"config": {"fp8": "none", "fp8_params": True}}) == bed.group_key(
        {"config": _cfg(fp8="none")})


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
    calls = re.findall(r"^ *part (\w+) \d+ \$BED .*--tag (\w+) --out \"\$P/(\w+)\.json\"$", text, re.M)
    tags = set(re.findall(r"--tag (\w+)", text))
    assert calls and {c[1] for c in calls} == tags
    for name, tag, out in calls:  # each arm writes its record where the report and the GPU test look, once
        assert name == tag == out, (name, tag, out)
        assert text.count(f"--tag {tag} ") == 1, tag
    test = open(os.path.join(ROOT, "tests", "gpu", "test_megatron_gpu.py")).read()
    arms = set(re.findall(r'^    "(\w+)": \[', test, re.M))
    assert arms and arms <= tags, arms - tags
    assert 'for a in "${ORDER[@]}"' in text  # the report reads every record the run wrote
    assert "timeout" in text and "MEGATRON_BED_RECORDS" in text and ".te/final/install_on_host.sh" in text


# A stand-in for the host's python3 (CPU): import checks pass, each arm writes a small record from its real
# BedConfig (losses from the config group, per-layer graphs for --mode layer unless the arm is named in
# FAKE_FAIL), pytest passes, and the report runs for real. It checks the script's control flow only.
_FAKE_PYTHON = """#!{python}
import json, os, sys
real = {python!r}
args = sys.argv[1:]
if args[:1] == ["-c"] and ("transformer_engine" in args[1] or "megatron.core" in args[1]):
    sys.exit(0)
if args[:1] == ["-"]:
    sys.stdin.read(); print("versions: fake"); sys.exit(0)
if args[:2] == ["-m", "pytest"]:
    print("fake pytest on", os.environ.get("MEGATRON_BED_RECORDS")); print("1 passed"); sys.exit(0)
if "benchmarks/megatron_bed.py" in args and "report" not in args:
    sys.path.insert(0, "benchmarks")
    import dataclasses, megatron_bed as bed
    cfg = bed.parse_args(args[args.index("benchmarks/megatron_bed.py") + 1:])
    base = 3.0 + (cfg.fp8 == "none") + (not cfg.fp8_params)
    losses = [base - 0.01 * i for i in range(cfg.steps)]
    layer = cfg.mode == "layer" and cfg.tag != os.environ.get("FAKE_FAIL")
    rec = {{"tag": cfg.tag, "mode": cfg.mode, "config": dataclasses.asdict(cfg), "losses": losses,
           "grad_norms": [1.0] * cfg.steps, "ms": [5.0] * cfg.steps, "excluded_steps": [], "fp8_checks": [],
           "error": None if cfg.tag != os.environ.get("FAKE_FAIL") else "AcceleratorError: fake",
           "graphs": {{"layer_fwd_graphs": 2 * layer, "layer_bwd_graphs": 2 * layer,
                      "full_iteration_graphs": int(cfg.mode == "full")}}}}
    rec["summary"] = bed.summarize(rec)
    json.dump(rec, open(cfg.out, "w"))
    print("BED", cfg.tag); sys.exit(0)
os.execv(real, [real] + args)
"""


def _fake_session(tmp_path, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "python3"
    fake.write_text(_FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "out"
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), **env}
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "megatron_session.sh")], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=240)
    log = (out / "session.log").read_text()
    ran = re.findall(r"^===== (\w+) ", log, re.M)
    return proc, ran, out


BF = ["bf_eager_a", "bf_layer", "bf_eager_b", "bf_full", "bf_seed000_break", "bf_seed000_guard"]
NP_REST = ["np_eager_b", "np_full", "np_seed000_break", "np_seed000_guard"]


def test_bf16layer_set_runs_np_first_and_reports_each_config_against_its_own_eager(tmp_path):
    proc, ran, out = _fake_session(tmp_path, ARMS="bf16layer", TOTAL_BUDGET="1000", RUN_BUDGET="1000")
    assert proc.returncode == 0, proc.stderr
    assert ran == ["np_eager_a", "np_layer", *NP_REST, *BF, "gpu_test"], ran
    assert sorted(os.listdir(out)) == ["megatron_record.json", "megatron_record.md", "parts.tgz", "session.log"]
    summary = json.loads((out / "megatron_record.json").read_text())["summary"]
    rows = {r["tag"]: r for r in summary["rows"]}
    assert len(rows) == 12 and len(summary["groups"]) == 2
    for tag, row in rows.items():
        assert row["reference"] == tag[:3] + "eager_a", row
    assert rows["np_layer"]["verdict"] == rows["bf_full"]["verdict"] == "bitwise"
    assert "np_layer" in proc.stdout and "eager-vs-eager noise (np_eager_b)" in proc.stdout


def test_bf16layer_set_puts_bf16_first_when_np_per_layer_fails_and_keeps_the_budget(tmp_path):
    proc, ran, _ = _fake_session(tmp_path, ARMS="bf16layer", FAKE_FAIL="np_layer", TOTAL_BUDGET="1000",
                                 RUN_BUDGET="1000")
    assert proc.returncode == 0, proc.stderr
    assert ran == ["np_eager_a", "np_layer", *BF, *NP_REST, "gpu_test"], ran
    # 70 s in all: the arms leave KEEP (40 s) + 20 s for the GPU test, so every arm is skipped and the test runs.
    proc, ran, _ = _fake_session(tmp_path / "short", ARMS="bf16layer", TOTAL_BUDGET="70")
    assert proc.returncode == 0 and ran == ["gpu_test"], (ran, proc.stderr)
    assert proc.stdout.count("SKIPPED (budget)") == 12, proc.stdout
    bad = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "megatron_session.sh")], cwd=ROOT,
                         env={**os.environ, "OUT": str(tmp_path / "bad"), "ARMS": "bf16"}, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "use ARMS=default, ARMS=bf16layer, ARMS=layerdiag or ARMS=1b" in bad.stderr


DG = ["dg_bf_eager", "dg_bf_layer", "dg_bf_keep", "dg_np_eager", "dg_np_layer", "dg_np_keep", "dg_bf_eager_b"]


def test_layerdiag_set_compares_each_per_layer_arm_with_its_configs_eager_with_fingerprints(tmp_path):
    proc, ran, out = _fake_session(tmp_path, ARMS="layerdiag", TOTAL_BUDGET="1000", RUN_BUDGET="1000")
    assert proc.returncode == 0, proc.stderr
    assert ran == [*DG, "gpu_test"], ran
    log = (out / "session.log").read_text()
    for tag in DG:
        cmd = re.search(rf"^===== {tag} .*$", log, re.M).group(0)
        assert "--grad-fingerprints 3" in cmd and "--steps 120" in cmd, cmd
        assert ("--keep-graph-inputs" in cmd) == tag.endswith("_keep"), cmd
    rows = {r["tag"]: r for r in json.loads((out / "megatron_record.json").read_text())["summary"]["rows"]}
    assert {t: r["reference"] for t, r in rows.items()} == {
        t: ("dg_bf_eager" if t.startswith("dg_bf") else "dg_np_eager") for t in DG}
    assert rows["dg_bf_eager_b"]["verdict"] == "bitwise" and rows["dg_bf_eager"]["noise_arm"] == "dg_bf_eager_b"


def test_1b_set_runs_the_1b_shape_and_compares_each_arm_with_its_own_eager(tmp_path):
    arms = ["b1_eager_a", "b1_full", "b1_eager_b", "b1_layer"]
    proc, ran, out = _fake_session(tmp_path, ARMS="1b", TOTAL_BUDGET="1000", RUN_BUDGET="1000")
    assert proc.returncode == 0, proc.stderr
    assert ran == [*arms, "gpu_test"], ran
    log = (out / "session.log").read_text()
    for tag in arms:
        assert "--shape 1b" in re.search(rf"^===== {tag} .*$", log, re.M).group(0)
    rows = {r["tag"]: r for r in json.loads((out / "megatron_record.json").read_text())["summary"]["rows"]}
    assert {t: r["reference"] for t, r in rows.items()} == dict.fromkeys(arms, "b1_eager_a")
    assert rows["b1_eager_a"]["noise_arm"] == "b1_eager_b"


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
    # The flag itself would not give these on megatron-core 0.16.1 (its default there is the whole iteration): the
    # record says why; with the bed's --keep-graph-inputs that hazard is gone.
    assert "cuda_graphs.py:995" in info["refused"]
    tc, info = bed.transformer_config(bed.parse_args(["--mode", "layer", "--keep-graph-inputs"]))
    assert info["refused"] is None and tc.cuda_graph_scope == [] and info["full_iteration"] is False
    assert tc.gradient_accumulation_fusion  # megatron-core 0.16.1 restores grad_added_to_main_grad
    tc, info = bed.transformer_config(bed.parse_args(["--mode", "full"]))
    assert tc.cuda_graph_scope == [CudaGraphScope.full_iteration] and info["full_iteration"]
    tc, info = bed.transformer_config(bed.parse_args(["--mode", "layer", "--break-grad-added",
                                                      "--guard-fused-wgrad"]))
    assert tc.gradient_accumulation_fusion is False and "#1279" in info["notes"][0]
    tc, info = bed.transformer_config(bed.parse_args(["--shape", "1b", "--mode", "full"]))
    assert (tc.num_layers, tc.hidden_size, tc.num_attention_heads, tc.ffn_hidden_size) == (16, 2048, 16, 8192)
    assert tc.fp8_param and info["full_iteration"]
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
    assert rec["parameters"] == bed.parameter_count(bed.BedConfig())  # the model's size, in every record
    assert "BED layer:" in proc.stdout


@pytest.mark.nemo
def test_keep_graph_inputs_takes_a_forward_input_buffer_back_from_megatron_cores_reuse_pool(monkeypatch):
    _need("megatron.core")
    import types

    import torch
    from megatron.core.transformer import cuda_graphs as cg

    pool = cg._CudagraphGlobalRecord.tensor_reuse_pool
    monkeypatch.setattr(pool, "pool", [])  # TensorReusePool keeps its lists on the class: work on a private one
    hidden = cg.ArgMetadata(torch.zeros(8, 2, 16, dtype=torch.bfloat16))  # a layer's hidden states [s, b, h]
    rotary = cg.ArgMetadata(torch.zeros(8, 1, 1, 4))
    param = torch.nn.Parameter(torch.ones(3))

    def forward_capture_0161(self, args, kwargs, outputs=None, clone_inputs=True):
        # What 0.16.1's create_fwd_graph does with its input buffers (l.872-875, l.986-995), on the real pool.
        bufs = [pool.get(m).detach() for m in (hidden, rotary)]
        for b in bufs:
            b.can_skip_replay_copy = False
            pool.insert(b)
        self.fwd_graph_input_surface = tuple(bufs) + (param,)

    # Unpatched, megatron-core's pool hands the first layer's input buffer to the next request of that shape: in
    # 0.16.1 the last layer's output-gradient buffer (create_bwd_graph, l.1056).
    monkeypatch.setattr(cg._CudaGraphRunner, "create_fwd_graph", forward_capture_0161)
    first = types.SimpleNamespace()
    cg._CudaGraphRunner.create_fwd_graph(first, (), {})
    assert pool.get(hidden).data_ptr() == first.fwd_graph_input_surface[0].data_ptr()

    pool.pool[:] = []
    stats = bed.install_keep_graph_inputs()
    assert cg._CudaGraphRunner.create_fwd_graph.__wrapped__ is forward_capture_0161
    runner = types.SimpleNamespace()
    cg._CudaGraphRunner.create_fwd_graph(runner, (), {})
    assert stats == {"forward_captures": 1, "withheld_buffers": 2} and pool.pool == []
    assert pool.get(hidden).data_ptr() not in {t.data_ptr() for t in runner.fwd_graph_input_surface}
    # A buffer some other graph returned stays available.
    other = pool.get(hidden)
    pool.insert(other)
    assert bed.withhold_forward_inputs(runner, pool) == 0 and pool.pool == [other]
