"""Megatron-core on the GPU, through ``benchmarks/megatron_bed.py``.

Each arm runs in its own process (megatron-core keeps its CUDA-graph state in globals and class attributes, so
per-layer and whole-iteration graphs cannot share a process). With ``MEGATRON_BED_RECORDS=<dir>`` the test reads the
records ``benchmarks/megatron_session.sh`` has just written instead of running the arms again; an arm without a
record there (the other arm set, or skipped for the run's time limit) skips the tests that read it. Without it the
test runs the arms of ``MEGATRON_BED_SET`` (``default``, ``bf16layer``, ``layerdiag`` or ``all``, the default; 30 steps
each).

Two arm sets, each compared within its configuration group (``megatron_bed.compare``: an arm against the eager arm
of the same precision / weights / steps, with that group's second eager arm as the noise floor):

* default (FP8 primary weights): ``eager_a``, ``eager_b``, ``layer``, ``full``, the forced-sync arms, ``seed000_*``.
  megatron-core 0.16.1's per-layer graphs fail there at the first replay (``cuda_graphs.py:587``, a
  ``Float8Tensor`` parameter copied onto itself); ``with_cuda_graph`` refuses that config, and the per-layer arms
  of this set are expected failures while that exact crash is what they record.
* ``bf16layer``: ``np_*`` (FP8 hybrid compute, bf16 primary weights) and ``bf_*`` (bf16), where per-layer graphs run.

Asserted, per set where its records are present:
1. per-layer graphs (the NeMo flag's fields, applied by ``apply_megatron_graph_fields``): megatron-core captured a
   forward and a backward graph per layer, and the losses equal the group's eager ones (bitwise, or within the
   group's eager-vs-eager noise);
2. the whole-iteration graph (``full_iteration_forward_backward``): one graph captured, no per-layer graph, losses
   equal eager's;
3. FP8 primary weights with the overlapped all-gather: no stale transpose at the checked steps (default set);
4. the forced-sync gap: a forced parameter all-gather (NeMo's checkpoint save) leaves the next step's transposes
   stale (megatron-core 0.16.1 rebuilds nothing there), and the completion-path refresh removes that;
5. seed 000 (Megatron-LM #1279): with TE's fused wgrad accumulation and its placeholder wgrads poisoned with NaN,
   no eager / per-layer / whole-iteration arm has a NaN gradient (no double add); with megatron-core's restore of
   ``grad_added_to_main_grad`` removed the per-layer arm does (the mechanism), and the flag's decision (fusion off)
   keeps it finite and close to eager.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # conftest marks these skipped; do not import TE on a CPU machine
    pytest.skip("needs a CUDA device", allow_module_level=True)
for _mod in ("transformer_engine", "megatron.core"):
    if importlib.util.find_spec(_mod.split(".")[0]) is None:
        pytest.skip(f"{_mod} is not installed (see benchmarks/megatron_session.sh)", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import megatron_bed  # noqa: E402

ARMS = {
    # default set: FP8 primary weights
    "eager_a": ["--mode", "eager", "--verify-every", "10", "--param-gather-refresh"],
    "eager_b": ["--mode", "eager", "--verify-every", "10", "--param-gather-refresh"],
    "layer": ["--mode", "layer", "--verify-every", "10", "--param-gather-refresh"],
    "full": ["--mode", "full", "--verify-every", "10", "--param-gather-refresh"],
    "fp8_forced": ["--mode", "eager", "--verify-every", "0", "--force-sync-every", "10"],
    "fp8_forced_fixed": ["--mode", "eager", "--verify-every", "0", "--force-sync-every", "10",
                         "--param-gather-refresh"],
    "seed000_break": ["--mode", "layer", "--verify-every", "0", "--break-grad-added"],
    "seed000_guard": ["--mode", "layer", "--verify-every", "0", "--break-grad-added", "--guard-fused-wgrad"],
    # bf16layer set: FP8 hybrid compute with bf16 primary weights (np_), bf16 (bf_)
    "np_eager_a": ["--mode", "eager", "--no-fp8-params", "--verify-every", "0"],
    "np_eager_b": ["--mode", "eager", "--no-fp8-params", "--verify-every", "0"],
    "np_layer": ["--mode", "layer", "--no-fp8-params", "--verify-every", "0"],
    "np_full": ["--mode", "full", "--no-fp8-params", "--verify-every", "0"],
    "np_seed000_break": ["--mode", "layer", "--no-fp8-params", "--verify-every", "0", "--break-grad-added"],
    "np_seed000_guard": ["--mode", "layer", "--no-fp8-params", "--verify-every", "0", "--break-grad-added",
                         "--guard-fused-wgrad"],
    "bf_eager_a": ["--mode", "eager", "--fp8", "none", "--verify-every", "0"],
    "bf_eager_b": ["--mode", "eager", "--fp8", "none", "--verify-every", "0"],
    "bf_layer": ["--mode", "layer", "--fp8", "none", "--verify-every", "0"],
    "bf_full": ["--mode", "full", "--fp8", "none", "--verify-every", "0"],
    "bf_seed000_break": ["--mode", "layer", "--fp8", "none", "--verify-every", "0", "--break-grad-added"],
    "bf_seed000_guard": ["--mode", "layer", "--fp8", "none", "--verify-every", "0", "--break-grad-added",
                         "--guard-fused-wgrad"],
    # layerdiag set: why per-layer graphs differ (dg_bf_ = bf16, dg_np_ = FP8 hybrid compute with bf16 weights)
    **{f"dg_{cfg}_{arm}": ["--mode", mode, *precision, "--verify-every", "0", "--grad-fingerprints", "3", *extra]
       for cfg, precision in (("bf", ["--fp8", "none"]), ("np", ["--no-fp8-params"]))
       for arm, mode, extra in (("eager", "eager", []), ("layer", "layer", []),
                                ("keep", "layer", ["--keep-graph-inputs"]))},
    # 1b set: the 1 B shape with FP8 primary weights (b1_)
    **{f"b1_{arm}": ["--shape", "1b", "--mode", mode, "--verify-every", "20", "--param-gather-refresh"]
       for arm, mode in (("eager_a", "eager"), ("eager_b", "eager"), ("full", "full"), ("layer", "layer"))},
}
SETS = {"default": [t for t in ARMS if t[:3] not in ("np_", "bf_", "dg_", "b1_")],
        "1b": [t for t in ARMS if t[:3] == "b1_"],
        "bf16layer": [t for t in ARMS if t[:3] in ("np_", "bf_")],
        "layerdiag": [t for t in ARMS if t[:3] == "dg_"]}
GIVEN = os.environ.get("MEGATRON_BED_RECORDS")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = {}
    folder = GIVEN or str(tmp_path_factory.mktemp("megatron_bed"))
    which = os.environ.get("MEGATRON_BED_SET", "all")
    tags = list(ARMS) if GIVEN or which == "all" else SETS[which]
    for tag in tags:
        path = os.path.join(folder, f"{tag}.json")
        if not GIVEN:
            steps = "20" if tag.startswith("b1_") else "30"
            cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "megatron_bed.py"), *ARMS[tag], "--steps", steps,
                   "--tag", tag, "--out", path]
            subprocess.run(cmd, cwd=ROOT, timeout=240, check=False)
        if os.path.exists(path):
            with open(path) as f:
                out[tag] = json.load(f)
    out["_ran"] = tags
    return out


def _present(records, tag):
    """The record of ``tag``; an arm this run did not run (another arm set, or its time limit) skips the test."""
    if tag not in records:
        if GIVEN or tag not in records["_ran"]:
            pytest.skip(f"no record of arm {tag} in this run (another arm set, or skipped for the run's time limit)")
        pytest.fail(f"arm {tag} wrote no record (see the run's log for its output)")
    return records[tag]


def _known_fp8_param_crash(rec):
    """megatron-core 0.16.1's per-layer replay on FP8 primary weights (cuda_graphs.py:587); the flag refuses it."""
    return (rec["mode"] == "layer" and rec["config"].get("fp8_params") and rec.get("error")
            and "cudagraph_input.copy_(user_input)" in (rec.get("traceback") or ""))


def _get(records, tag):
    rec = _present(records, tag)
    if _known_fp8_param_crash(rec):
        pytest.xfail(f"{tag}: per-layer graphs on FP8 primary weights fail in megatron-core "
                     f"(cuda_graphs.py:587, {rec['error'].splitlines()[0]}); with_cuda_graph refuses this config")
    assert rec["error"] is None, f"arm {tag} failed: {rec['error']}\n{rec.get('traceback', '')[-3000:]}"
    return rec


def _row(records, tag):
    """``tag``'s row of the report over every record present (each arm against its own group's eager arm)."""
    set_ref = {"np_": "np_eager_a", "bf_": "bf_eager_a", "dg_": tag[:6] + "eager", "b1_": "b1_eager_a"}.get(tag[:3],
                                                                                                          "eager_a")
    _get(records, set_ref)  # its set's reference ran cleanly
    summary = megatron_bed.compare([r for t, r in records.items() if t != "_ran"])
    row = next(r for r in summary["rows"] if r["tag"] == tag)
    group = next(g for g in summary["groups"] if g["name"] == row["group"])
    assert row["reference"] is not None, f"{tag}: no eager arm of the same configuration ({group['label']})"
    return row, group


# megatron-core 0.16.1's per-layer graphs were measured NOT bitwise to eager (docs/results/megatron.md: gradient
# norms differ from the first captured step, loss max |Δ| 0.027 over 120 steps); the flag does
# not give them there (integrations.megatron.per_layer_refusal; its default is the whole iteration) and the arms set the fields by
# hand. This test holds what was measured: graphs captured, warm-up steps bitwise, no non-finite value, every step's
# loss within 5 % of eager's (a double-counted or skipped gradient leaves that band).
PER_LAYER_LOSS_RTOL = 0.05


@pytest.mark.parametrize("tag", ["layer", "np_layer", "bf_layer", "dg_bf_layer", "dg_np_layer"])
def test_per_layer_graphs_captured_and_close_to_eager(records, tag):
    rec = _get(records, tag)
    layers = rec["config"]["layers"]
    assert rec["flag"]["changes"], "the flag's fields were not applied"
    if rec["capabilities"].get("per_layer_input_buffer_reuse"):
        assert "cuda_graphs.py" in (rec["flag"].get("refused") or ""), "the flag must not give these graphs here"
    g = rec["graphs"]
    assert g["layer_fwd_graphs"] >= layers and g["layer_bwd_graphs"] >= layers, g
    assert g["full_iteration_graphs"] == 0
    row, group = _row(records, tag)
    assert row["verdict"] != "NaN", (row, group)
    ref = records[row["reference"]]["losses"]
    # megatron-core's local per-layer graphs are created at the end of the first step (its cuda_graph_warmup_steps
    # count warm-up runs inside the capture), so only that step is certainly eager
    assert rec["losses"][:1] == ref[:1], "the first step, before any graph, must be bitwise"
    rel = max(abs(a - b) / abs(b) for a, b in zip(rec["losses"], ref))
    print(f"\nPER-LAYER {tag}: verdict {row['verdict']}, loss max rel diff {rel:.3g} over {len(ref)} steps")
    assert rel <= PER_LAYER_LOSS_RTOL, (rel, row)


@pytest.mark.parametrize("tag", ["dg_bf_keep", "dg_np_keep"])
def test_per_layer_graphs_equal_eager_once_saved_inputs_stay_out_of_the_reuse_pool(records, tag):
    # The cause of the difference above: with each layer graph's forward input buffers kept out of megatron-core
    # 0.16.1's reuse pool (--keep-graph-inputs, what megatron-core 0.18 does) per-layer graphs equal eager.
    rec = _get(records, tag)
    assert rec["keep_graph_inputs"]["withheld_buffers"] > 0, rec["keep_graph_inputs"]
    g = rec["graphs"]
    assert g["layer_fwd_graphs"] >= rec["config"]["layers"] and g["full_iteration_graphs"] == 0, g
    row, group = _row(records, tag)
    assert row["verdict"] in ("bitwise", "within eager noise"), (row, group)


@pytest.mark.parametrize("tag", ["full", "np_full", "bf_full", "b1_full"])
def test_full_iteration_graph_captured_and_equal_to_eager(records, tag):
    rec = _get(records, tag)
    g = rec["graphs"]
    assert g["full_iteration_graphs"] == 1 and g["layer_fwd_graphs"] == 0, g
    row, group = _row(records, tag)
    assert row["verdict"] in ("bitwise", "within eager noise"), (row, group)


@pytest.mark.parametrize("tag", ["eager_a", "layer", "full", "b1_eager_a", "b1_full"])
def test_fp8_transposes_current_with_overlapped_all_gather(records, tag):
    rec = _get(records, tag)
    assert rec["fp8_params"] > 0 and rec["config"]["fp8_params"]
    s = rec["summary"]
    assert s["fp8_checked"] > 0
    assert s["fp8_stale"] == 0, rec["fp8_checks"]
    # megatron-core rebuilt the transposes itself on every ordinary step: the completion hook refreshed nothing.
    assert rec["param_gather_refresh"]["refreshed"] == {}, rec["param_gather_refresh"]


def test_forced_sync_leaves_stale_transposes_and_the_completion_refresh_fixes_it(records):
    gap = _get(records, "fp8_forced")["summary"]
    fixed = _get(records, "fp8_forced_fixed")
    assert gap["fp8_stale_after_forced"] > 0, "megatron-core rebuilt after the forced sync: the gap is gone"
    assert fixed["summary"]["fp8_checked"] > 0 and fixed["summary"]["fp8_stale"] == 0, fixed["fp8_checks"]
    assert fixed["param_gather_refresh"]["refreshed"].get("forced", 0) > 0


@pytest.mark.parametrize("prefix", ["", "np_", "bf_"], ids=["fp8_params", "np", "bf"])
def test_seed000_no_double_count_under_graphs_and_the_mechanism(records, prefix):
    seen = [t for t in ("eager_a", "layer", "full") if prefix + t in records]
    if not seen and prefix + "seed000_break" not in records:
        _present(records, prefix + "seed000_break")
    for tag in seen:  # the real megatron-core: fused wgrad on, placeholders poisoned, no NaN
        rec = records[prefix + tag]
        if rec.get("error"):
            continue  # its own test reports it
        assert rec["gradient_accumulation_fusion"] is True and rec["config"]["poison_placeholder"]
        assert rec["summary"]["nonfinite_grad_norms"] == 0, (prefix + tag, rec["grad_norms"][:10])
    broken = _present(records, prefix + "seed000_break")
    if _known_fp8_param_crash(broken):
        pytest.xfail(f"{prefix}seed000_break: per-layer graphs on FP8 primary weights fail first (cuda_graphs.py:587)")
    # It may also end in an error once NaN reaches a later step: the NaN came first.
    assert broken["gradient_accumulation_fusion"] is True, broken.get("error")
    assert broken["summary"]["nonfinite_grad_norms"] > 0, (
        f"removing the restore did not double-add the placeholder (error: {broken.get('error')})")
    guarded = _get(records, prefix + "seed000_guard")
    assert guarded["gradient_accumulation_fusion"] is False  # the flag's decision for such a megatron-core
    assert guarded["graphs"]["layer_fwd_graphs"] > 0, guarded["graphs"]
    assert guarded["summary"]["nonfinite_grad_norms"] == 0
    row, _group = _row(records, prefix + "seed000_guard")
    ref = records[row["reference"]]["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(guarded["losses"], ref))
    assert math.isfinite(rel) and rel < 0.05, rel  # unfused accumulation: close to eager, not bitwise
