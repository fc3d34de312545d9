"""FP8 at real size: a 0.85 B Llama-style TransformerEngine model under Lightning, per recipe and variant.

What it measures that the harness cannot: TransformerEngine FP8 training (FP8 primary weights, FP32 master weights) at
a size where GEMMs dominate the step, against TE's own per-layer graphs and against BF16, per FP8 recipe.

On a Hopper GPU with TransformerEngine 2.x (``bash benchmarks/gpu_te_session.sh te_install``), one recipe per call of
at most ten minutes, ``--resume`` finishing what the budget left::

    python -m benchmarks.fp8_scale --plan                                   # runs and estimated time (any machine)
    python -m benchmarks.fp8_scale --recipes delayed --budget-s 520 --out benchmarks/results/fp8_scale \\
        --resume benchmarks/results/fp8_scale/fp8-scale.json               # repeat per recipe until complete
    python -m benchmarks.fp8_scale --report benchmarks/results/fp8_scale/fp8-scale.json --write-docs
    python -m benchmarks.fp8_scale --dry-run --rounds 1                     # CPU smoke run of the plumbing

Model (:mod:`benchmarks.fp8_scale_model`): 16 ``te.TransformerLayer`` (hidden 2048, 16 heads, 4 KV groups, SwiGLU FFN
5632, RMSNorm, RoPE from ``te.RotaryPositionEmbedding``, causal, fused QKV, no bias), vocabulary 32000, sequence 2048,
batch 4; embedding, final RMSNorm and LM head (untied) in plain torch with FP32 weights; Lightning
``precision="bf16-mixed"``, TE's FP8 autocast around the layers. FP8 variants build the layers under
``te.quantized_model_init`` (FP8 primary weights, the high-precision init kept for the masters). Optimizer:
``benchmarks.fp8_refresh.MasterWeightAdamW`` (AdamW on FP32 masters whose ``step()`` writes each FP8 weight's bytes
in place, flagging the cache as TE's contract asks: ``_reset_caches()``), the same for every variant; TE's
``FusedAdam(master_weights=True)`` refuses ``capturable=True`` with FP8 weights, so no whole-step graph can hold it.
Data: random windows of the embedded corpus (byte tokens), the same batches for every run; seed 0.

Variants, each in a process of its own, alternating within each round (:data:`VARIANTS`): ``te_eager`` (the
reference: TE as it is, no plugin), ``ours`` (``CudaGraphCallback()``, ``fp8_refresh="auto"``), ``te_graphed`` (TE's
``make_graphed_callables`` over the layers with the same recipe; TE's ``post_all_gather_processing`` after each
optimizer step writes the transposes, as TE asks of an optimizer that writes FP8 weights), ``ours_no_refresh``
(``fp8_refresh=False``), ``bf16`` (the same model without FP8: BF16 weights, the same FP32-master AdamW).

Per row: ms/step (median over rounds of the timed window), MFU against the card's dense FP8 peak (BF16 rows: dense BF16
peak), the kernel floor (``torch.profiler`` over the last steps, the harness's probe), peak memory and its ratio to
``te_eager``, max |Δloss| against ``te_eager`` of the same round over every step, FP8 transposes stale at the end
(``verify_fp8_transposes``), and the transposes' cost alone (captured into a graph of their own and replayed, as
``fp8_lightning`` does) as a share of the step. Pure Python down to the CLI: the plan, the report and the CPU tests
need neither torch nor TransformerEngine; the runs go through the harness's runner (one process per run, rounds,
``--budget-s``, ``--resume``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness import report as hreport
from benchmarks.harness import runner
from benchmarks.harness.workloads import model_flops_per_step

REPO = runner.REPO
RAW_NAME = "fp8-scale.json"
PAGE = REPO / "docs" / "results" / "fp8.md"
BEGIN, END = "<!-- fp8-scale:begin -->", "<!-- fp8-scale:end -->"
DEFAULT_OUT = Path("benchmarks/results/fp8_scale")
MIN_STEPS = 200  # the loss comparison spans at least this many steps
GIB = 2**30


# ---------------------------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """The model and batch of one recipe group, and its step counts (timed window: ``measure_from`` to
    ``steps - profile_steps - 1``; the last ``profile_steps`` run under the profiler)."""

    name: str
    title: str
    recipe: str
    hidden: int = 2048
    layers: int = 16
    heads: int = 16
    kv_heads: int = 4
    ffn: int = 5632
    vocab: int = 32000
    seq: int = 2048
    batch: int = 4
    steps: int = 220
    measure_from: int = 60
    profile_steps: int = 3

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def layer_matmul_params(s: Shape | dict) -> int:
    """Weights of one layer's GEMMs: fused QKV (queries plus ``kv_heads`` keys and values), the attention output, the
    SwiGLU FFN's two-in-one first GEMM and its second."""
    g = s if isinstance(s, dict) else asdict(s)
    h, kv = g["hidden"], g["kv_heads"] * (g["hidden"] // g["heads"])
    return h * (h + 2 * kv) + h * h + h * 2 * g["ffn"] + g["ffn"] * h


def matmul_params(s: Shape | dict) -> int:
    """N of the FLOP count: every layer's GEMM weights and the (untied) LM head; not the input embedding."""
    g = s if isinstance(s, dict) else asdict(s)
    return g["layers"] * layer_matmul_params(g) + g["vocab"] * g["hidden"]


def total_params(s: Shape | dict) -> int:
    """Every parameter: GEMM weights, two RMSNorm weights per layer and the final one, embedding and head."""
    g = s if isinstance(s, dict) else asdict(s)
    return matmul_params(g) + g["vocab"] * g["hidden"] + (2 * g["layers"] + 1) * g["hidden"]


def flops_per_step(s: Shape | dict, n_matmul: Optional[int] = None) -> float:
    """The harness's model FLOPs of one training step (:func:`benchmarks.harness.workloads.model_flops_per_step`):
    ``6 · N · tokens + 6 · layers · seq² · hidden · batch`` (causal attention's score and value GEMMs; GQA shares keys
    and values, not the query heads those GEMMs run over)."""
    g = s if isinstance(s, dict) else asdict(s)
    return model_flops_per_step(n_matmul or matmul_params(g), g["layers"], g["hidden"], g["batch"], g["seq"])


FLOPS_FORMULA = ("6 · N · tokens + 6 · layers · seq² · hidden · batch; N: the layers' GEMM weights and the LM head, "
                 "the input embedding left out; the second term: causal attention's score and value GEMMs")

#: dense tensor-core peaks from NVIDIA's datasheets, TFLOP/s: (BF16, FP8); the sparse figures are twice these
PEAKS: dict[str, tuple[float, float]] = {
    "H100 SXM": (989.4, 1979.0),
    "H100 PCIe": (756.0, 1513.0),
    "H100 NVL": (835.0, 1671.0),
    "H200": (989.4, 1979.0),
    "H200 NVL": (835.0, 1671.0),
}


def card_of(gpu: Optional[str]) -> tuple[str, bool]:
    """The :data:`PEAKS` entry of a ``torch.cuda.get_device_name()``, and whether it was recognised (otherwise the
    H100 SXM's figures are assumed)."""
    name = (gpu or "").upper()
    for key, needles in (("H200 NVL", ("H200", "NVL")), ("H200", ("H200",)), ("H100 NVL", ("H100", "NVL")),
                         ("H100 PCIe", ("H100", "PCIE")), ("H100 SXM", ("H100",))):
        if all(n in name for n in needles):
            return key, True
    return "H100 SXM", False


def peak_tflops(gpu: Optional[str], fp8: bool) -> float:
    bf16, f8 = PEAKS[card_of(gpu)[0]]
    return f8 if fp8 else bf16


def mfu(flops: Optional[float], ms: Optional[float], peak: float) -> Optional[float]:
    """Model FLOPs per second over ``peak`` TFLOP/s; None when a figure is missing."""
    if not flops or not ms:
        return None
    return flops / (ms / 1e3) / (peak * 1e12)


# --------------------------------------------------------------------------------------------------- recipes, variants

#: recipe name -> (TE recipe class, TE's support check); Hopper runs the first three (block scaling with CUDA >= 12.9)
RECIPES: dict[str, tuple[str, str]] = {
    "delayed": ("DelayedScaling", "is_fp8_available"),
    "current": ("Float8CurrentScaling", "is_fp8_available"),
    "block": ("Float8BlockScaling", "is_fp8_block_scaling_available"),
    "mxfp8": ("MXFP8BlockScaling", "is_mxfp8_available"),
    "nvfp4": ("NVFP4BlockScaling", "is_nvfp4_available"),
}
DEFAULT_RECIPES = ["delayed", "current", "block"]
#: recipes whose FP8 primary weights ``MasterWeightAdamW`` (the FP32-master optimizer every FP8 row trains with)
#: writes: per-tensor ``Float8Tensor``; a block-scaled, MXFP8 or NVFP4 weight it refuses when it is built
MASTER_WRITES = ("delayed", "current")
NO_MASTER_WRITER = ("MasterWeightAdamW, the FP32-master optimizer every FP8 row trains with, writes per-tensor "
                    "FP8 weights (delayed and current scaling) only; this recipe's block-scaled weights it refuses")


@dataclass(frozen=True)
class Variant:
    """One run's set-up.

    ``fp8``: FP8 primary weights and TE's FP8 autocast (else BF16 weights, no FP8); ``ours``: ``CudaGraphCallback``
    with ``options``; ``te_graphs``: TE's ``make_graphed_callables`` over the layers; ``te_post_step``: TE's
    ``post_all_gather_processing`` on the FP8 weights after every optimizer step (their transposes written in
    place); ``writer``: ``te-flags`` (the optimizer calls ``_reset_caches()`` before writing, TE's contract) or
    ``no-flags`` (bytes only, as a distributed optimizer's all-gather writes them); ``transposes``: how the FP8
    weights' transposes are rebuilt in the step (``fused``: the plugin's refresh, one launch; ``per-tensor``: TE's
    ``_create_transpose`` per weight, in the forward or after the step; ``none``: not at all)."""

    name: str
    label: str
    description: str
    fp8: bool = True
    ours: bool = False
    options: tuple[tuple[str, Any], ...] = ()
    te_graphs: bool = False
    te_post_step: bool = False
    writer: str = "te-flags"
    transposes: str = "per-tensor"
    #: planning figure: ms/step at batch 4 on an H100 SXM (measured walls replace the estimate on resume)
    est_step_ms: float = 110.0
    est_setup_s: float = 0.0

    @property
    def graphs(self) -> bool:
        return self.ours or self.te_graphs


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("te_eager", "TE eager", "TransformerEngine as it is: eager Lightning, no plugin; TE rebuilds each flagged "
            "transpose in the forward (the reference of the losses)", est_step_ms=115.0),
    Variant("ours", "ours", "`CudaGraphCallback()` (`fp8_refresh=\"auto\"`): the whole step one graph, the refresh "
            "captured after the optimizer", ours=True, transposes="fused", est_step_ms=100.0, est_setup_s=5.0),
    Variant("te_graphed", "TE graphed layers", "TE's `make_graphed_callables` over the 16 layers (same recipe, "
            "`cache_quantized_params=False`); embedding, head, loss and optimizer eager; TE's "
            "`post_all_gather_processing` after each optimizer step", te_graphs=True, te_post_step=True,
            est_step_ms=105.0, est_setup_s=10.0),
    Variant("ours_no_refresh", "ours, no refresh", "`CudaGraphCallback(fp8_refresh=False)`: the capture follows a "
            "flagged write, so TE's own rebuild in the forward is captured; what is stale at the end is reported",
            ours=True, options=(("fp8_refresh", False),), est_step_ms=100.0, est_setup_s=5.0),
    Variant("bf16", "BF16", "the same model without FP8: BF16 weights, the same FP32-master AdamW, eager (the baseline "
            "FP8 must beat)", fp8=False, transposes="", est_step_ms=150.0),
    Variant("bf16_ours", "BF16, ours", "BF16 with `CudaGraphCallback()`", fp8=False, ours=True, transposes="",
            est_step_ms=140.0, est_setup_s=5.0),
    Variant("te_graphed_stale", "TE graphed, no transposes after the step",
            "TE's graphed layers without `post_all_gather_processing`: the graphs read the transposes captured at "
            "their warm-up", te_graphs=True, transposes="none", est_step_ms=105.0, est_setup_s=10.0),
    Variant("ours_noflags", "ours, unflagged writes", "`CudaGraphCallback()` with an optimizer that writes the FP8 "
            "bytes without `_reset_caches()` (a distributed optimizer's all-gather)", ours=True, writer="no-flags",
            transposes="fused", est_step_ms=100.0, est_setup_s=5.0),
    Variant("ours_noflags_no_refresh", "ours, unflagged writes, no refresh",
            "`CudaGraphCallback(fp8_refresh=False)` with unflagged writes: nothing rebuilds the transposes",
            ours=True, options=(("fp8_refresh", False),), writer="no-flags", transposes="none", est_step_ms=100.0,
            est_setup_s=5.0),
)}
DEFAULT_VARIANTS = ["te_eager", "ours", "te_graphed", "ours_no_refresh", "bf16"]
REFERENCE = "te_eager"


def shape_for(recipe: str, batch: int = 4, steps: int = 220, dry_run: bool = False) -> Shape:
    """The recipe group's shape (``dry_run``: a tiny stand-in trained three steps on the CPU)."""
    if dry_run:
        return Shape(f"tiny-{recipe}", f"dry run: tiny stand-in (plain torch, 2 layers, d 64), {recipe}", recipe,
                     hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512, seq=32, batch=2, steps=3,
                     measure_from=1, profile_steps=1)
    s = Shape(f"llama0.85b-{recipe}", "", recipe, batch=batch, steps=steps)
    title = (f"Recipe {recipe} (`{RECIPES[recipe][0]}`): Llama-style {total_params(s) / 1e9:.2f} B, batch "
             f"{s.batch} × {s.seq}")
    return replace(s, title=title, measure_from=min(60, steps // 4))


def model_text(w: dict) -> str:
    """The model in words, for the page."""
    return (f"{w['layers']} `te.TransformerLayer` (d {w['hidden']}, {w['heads']} heads / {w['kv_heads']} KV groups, "
            f"SwiGLU {w['ffn']}, RMSNorm, RoPE), vocabulary {w['vocab']}")


# ------------------------------------------------------------------------------------------------------------ plan

START_S = 25.0  # interpreter, torch, Lightning and TransformerEngine imports
BUILD_S = 12.0  # the model on the GPU (FP8: quantized init keeping the high-precision values on the host)
END_S = 6.0  # profiler, transposes verified and timed alone
PROBE_S = 30.0


def estimate_s(job: dict) -> float:
    """Planning estimate of a job's wall time on an H100 SXM."""
    if job["kind"] == "probe":
        return 10.0 if job.get("dry_run") else PROBE_S
    if job.get("dry_run"):
        return 10.0
    w, v = job["workload"], VARIANTS[job["variant"]]
    ms = v.est_step_ms * w["batch"] / 4
    return START_S + BUILD_S + v.est_setup_s + END_S + w["steps"] * ms / 1e3


def job_key(job: dict) -> str:
    return "probe" if job["kind"] == "probe" else f"{job['round']}/{job['workload']['name']}/{job['variant']}"


def make_plan(recipes: list[str], variants: list[str], rounds: int, settings: dict) -> list[dict]:
    """The probe first, then round by round every recipe group's variants in the same order (one lane)."""
    vs = [v for v in VARIANTS if v in variants]
    plan = [{**settings, "kind": "probe", "round": 0, "recipes": recipes}]
    for rnd in range(rounds):
        for rec in recipes:
            shape = shape_for(rec, settings["batch"], settings["steps"], settings.get("dry_run", False))
            plan += [{**settings, "kind": "variant", "workload": shape.as_dict(), "variant": v, "round": rnd}
                     for v in vs]
    for j in plan:
        j["lane"] = 0
        j["key"] = job_key(j)
        j["est_s"] = estimate_s(j)
    return plan


def plan_text(plan: list[dict], done: set[str], budget_s: float) -> str:
    """What ``--plan`` prints: the harness's plan table (the probe in the ceiling's line)."""
    text = runner.plan_text([{**j, "kind": "ceiling"} if j["kind"] == "probe" else j for j in plan], done,
                            budget_s, 1)
    return text.replace("(matmul ceiling)", "(probe: TE, ceilings)")


# ---------------------------------------------------------------------------------------------------------- report


def _timed(r: dict) -> bool:
    return bool(r.get("ok")) and r.get("ms_per_step") is not None


def _groups(runs: list[dict]) -> list[tuple[str, list[dict]]]:
    by: dict[str, list[dict]] = {}
    for r in runs:
        if r.get("kind") == "variant":
            by.setdefault(r["workload"]["name"], []).append(r)
    order = {n: i for i, n in enumerate(RECIPES)}
    return sorted(by.items(), key=lambda kv: order.get(kv[1][0]["workload"]["recipe"], 99))


def _verify_cell(row: dict) -> str:
    v = row.get("verify")
    if v is None:
        return "–"
    if not v["checked"]:
        return f"none checked ({v['skipped']} skipped)" if v["skipped"] else "no `Float8Tensor` weights"
    if not v["stale"]:
        return f"0 of {v['checked']}"
    flagged = v["stale_flagged"]
    how = ("all flagged" if flagged == v["stale"]
           else "none flagged" if not flagged else f"{flagged} flagged")
    return f"**{v['stale']}** of {v['checked']}, {how}"


def aggregate(data: dict) -> list[dict]:
    """Per recipe group: the shape, FLOPs and every variant's row (figures over rounds, losses and memory against
    ``te_eager`` of the same round)."""
    env = data.get("env") or {}
    gpu = env.get("gpu")
    unsupported = (data.get("probe") or {}).get("support") or {}
    out = []
    for name, rs in _groups(data.get("runs", [])):
        wl = rs[0]["workload"]
        n_mm = next((r["n_matmul_params"] for r in rs if r.get("n_matmul_params")), None) or matmul_params(wl)
        flops = flops_per_step(wl, n_mm)
        ref_by_round = {r["round"]: r for r in rs if r["variant"] == REFERENCE and _timed(r)}
        res: dict[str, Any] = {
            "group": name, "title": wl.get("title") or name, "model": model_text(wl), "recipe": wl["recipe"],
            "tokens": wl["batch"] * wl["seq"],
            "steps": wl["steps"], "n_params": next((r["n_params"] for r in rs if r.get("n_params")), None),
            "n_matmul_params": n_mm, "flops_per_step": flops, "variants": {},
            "fp8_params": next((r["fp8_params"] for r in rs if r.get("fp8_params")), None),
            "fp8_param_class": next((r["fp8_param_class"] for r in rs if r.get("fp8_param_class")), None),
        }
        reason = next((r.get("unsupported") for r in rs if r.get("unsupported")), None)
        ok_support = unsupported.get(wl["recipe"])
        if reason is None and ok_support and not ok_support[0]:
            reason = ok_support[1] or "not supported here"
        res["unsupported"] = reason
        for vn in [v for v in VARIANTS if any(r["variant"] == v for r in rs)]:
            v = VARIANTS[vn]
            vr = sorted((r for r in rs if r["variant"] == vn), key=lambda r: r["round"])
            ok = [r for r in vr if _timed(r)]
            ms = hreport.median(r["ms_per_step"] for r in ok)
            floor = hreport.median(r.get("floor_ms") for r in ok)
            peak = peak_tflops(gpu, v.fp8)
            ratio_rounds = [r["ms_per_step"] / ref_by_round[r["round"]]["ms_per_step"]
                            for r in ok if r["round"] in ref_by_round]
            dl = [(hreport.max_abs_diff(r.get("losses"), ref_by_round[r["round"]].get("losses")), r["round"])
                  for r in ok if r["round"] in ref_by_round and ref_by_round[r["round"]] is not r]
            dloss = [d for (d, _), _ in dl if d is not None]
            firsts = [f for (_, f), _ in dl if f is not None]
            self_d = [hreport.max_abs_diff(a.get("losses"), b.get("losses"))[0] for i, a in enumerate(ok)
                      for b in ok[i + 1:]]
            peak_b = max((r["peak_mem_bytes"] for r in ok if r.get("peak_mem_bytes")), default=None)
            held_b = max((r["peak_reserved_bytes"] for r in ok if r.get("peak_reserved_bytes")), default=None)
            alone_key = {"fused": "refresh_fused_ms", "per-tensor": "refresh_per_tensor_ms"}.get(v.transposes)
            alone = hreport.median(r.get(alone_key) for r in ok) if alone_key else None
            last = ok[-1] if ok else None
            row: dict[str, Any] = {
                "label": v.label, "description": v.description, "fp8": v.fp8, "transposes": v.transposes,
                "rounds": len(vr), "ok_rounds": len(ok),
                "skipped": sum(1 for r in vr if r.get("skipped")),
                "errors": sorted({r["error"] for r in vr if not r.get("ok") and not r.get("skipped") and r.get("error")
                                  and not r.get("unsupported")}),
                "ms_rounds": {r["round"]: r["ms_per_step"] for r in ok}, "ms_per_step": ms,
                "ratio_rounds": ratio_rounds, "ratio": hreport.median(ratio_rounds),
                "peak_tflops": peak, "mfu": mfu(flops, ms, peak),
                "floor_ms": floor, "over_floor": ms / floor if ms and floor else None,
                "floor_mfu": mfu(flops, floor, peak),
                "gpu_idle_at_step_start": hreport.median(r.get("gpu_idle_at_step_start") for r in ok),
                "peak_gib": peak_b / GIB if peak_b else None, "peak_reserved_gib": held_b / GIB if held_b else None,
                "max_dloss": 0.0 if vn == REFERENCE and ok else (max(dloss) if dloss else None),
                "first_diff_step": min(firsts) if firsts else None,
                "self_noise": max((d for d in self_d if d is not None), default=None),
                "final_loss": next((r["losses"][-1] for r in reversed(ok) if r.get("losses")), None),
                "verify": last.get("verify") if last else None,
                "alone_ms": alone, "alone_share": alone / ms if alone and ms else None,
                "replays": hreport.median((r.get("stats") or {}).get("replays") for r in ok),
                "te_graphs_s": hreport.median(r.get("te_graphs_s") for r in ok),
                "notes": sorted({n for r in vr for n in r.get("notes", [])}),
            }
            res["variants"][vn] = row
        ref = res["variants"].get(REFERENCE)
        for vn, row in res["variants"].items():
            for key, ref_key in (("peak_over_ref", "peak_gib"), ("reserved_over_ref", "peak_reserved_gib")):
                a, b = row[ref_key], (ref or {}).get(ref_key)
                row[key] = a / b if a and b and vn != REFERENCE else None
        out.append(res)
    return out


#: label -> (variant, key, op, target, against): measured, reported met or missed, never asserted
CHECKS: dict[str, tuple[str, str, str, float, Optional[str]]] = {
    "ours / TE eager, ms/step": ("ours", "ratio", "<=", 1.0, None),
    "ours / TE graphed layers, ms/step": ("ours", "ms_per_step", "<=", 1.0, "te_graphed"),
    "ours (FP8) / BF16, ms/step": ("ours", "ms_per_step", "<", 1.0, "bf16"),
    "TE eager (FP8) / BF16, ms/step": ("te_eager", "ms_per_step", "<", 1.0, "bf16"),
    "ours, max |Δloss| vs TE eager": ("ours", "max_dloss", "<=", 0.0, None),
    "ours, peak memory / TE eager": ("ours", "peak_over_ref", "<=", 1.05, None),
    "ours, the refresh alone / step": ("ours", "alone_share", "<", 0.01, None),
}


def checks(results: list[dict]) -> list[dict]:
    out = []
    for label, (v, key, op, target, against) in CHECKS.items():
        for res in results:
            row = res["variants"].get(v)
            if row is None or res.get("unsupported"):
                continue
            got = row.get(key)
            if against is not None:
                other = res["variants"].get(against, {}).get(key)
                got = got / other if got and other else None
            met = None if got is None else {"<=": got <= target, "<": got < target}[op]
            out.append({"check": label, "group": res["group"], "value": got, "op": op, "target": target, "met": met})
    return out


def _f(x: Optional[float], fmt: str) -> str:
    return hreport._f(x, fmt)


def _state(row: dict, res: dict) -> Optional[str]:
    if row["ms_per_step"] is not None:
        return None
    if res.get("unsupported"):
        return f"not run: {res['unsupported']}"
    if row["skipped"] and not row["errors"]:
        return "skipped (budget)"
    return "failed: " + "; ".join(row["errors"])[:240] if row["errors"] else "no timing"


def _alone_cell(row: dict) -> str:
    if not row["fp8"]:
        return ""
    if row["transposes"] == "none":
        return "none in the step"
    if row["alone_ms"] is None:
        return "–"
    how = "one launch" if row["transposes"] == "fused" else "per tensor"
    return f"{row['alone_ms']:.3f} ms = {100 * row['alone_share']:.2f} % ({how})"


def group_table(res: dict) -> list[str]:
    """One recipe group's heading, sizes and table, and the notes under it."""
    lines = [f"### {res['title']}", ""]
    if res.get("unsupported") and not any(r["ms_per_step"] for r in res["variants"].values()):
        return lines + [f"Not run: {res['unsupported'].rstrip('.')}.", ""]
    lines += [hreport.wrap(
        f"{res['model']}: {_f(res['n_params'] and res['n_params'] / 1e6, '.1f')} M parameters "
        f"({_f(res['n_matmul_params'] / 1e6, '.1f')} M in GEMMs; FP8 weights: {res['fp8_params'] or '–'}"
        f"{' ' + res['fp8_param_class'] if res.get('fp8_param_class') else ''}), {res['tokens']:,} tokens per step, "
        f"{res['flops_per_step'] / 1e12:.2f} TFLOP per step; losses over {res['steps']} steps."), "",
        "| variant | ms/step | rounds (ms) | / TE eager | MFU | kernel floor (ms) | / floor | peak GiB | / TE eager "
        "| peak reserved GiB | max \\|Δloss\\| vs TE eager | FP8 transposes stale at the end "
        "| transposes alone, share of the step | replays |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in res["variants"].values():
        why = _state(row, res)
        if why:
            lines.append(f"| {row['label']} | {why} |" + " |" * 12)
            continue
        rounds = ", ".join(f"{row['ms_rounds'][k]:.2f}" for k in sorted(row["ms_rounds"]))
        ratio = ", ".join(f"{x:.3f}" for x in row["ratio_rounds"]) or "–"
        mfu_cell = (f"{_f(row['mfu'] and 100 * row['mfu'], '.1f')} % of {row['peak_tflops']:g}"
                    if row["mfu"] is not None else "–")
        lines.append(
            f"| {row['label']} | {row['ms_per_step']:.2f} | {rounds} | {ratio} | {mfu_cell} | "
            f"{_f(row['floor_ms'], '.2f')} | {_f(row['over_floor'], '.3f')} | {_f(row['peak_gib'], '.2f')} | "
            f"{_f(row['peak_over_ref'], '.3f')} | {_f(row['peak_reserved_gib'], '.2f')} | "
            f"{hreport._dloss(row['max_dloss'])} | {_verify_cell(row) if row['fp8'] else ''} | "
            f"{_alone_cell(row)} | {_f(row['replays'], '.0f')} |")
    lines.append("")
    for row in res["variants"].values():
        if row["first_diff_step"] is not None:
            lines.append(f"- {row['label']}: first Δloss vs TE eager at step {row['first_diff_step']}; final loss "
                         f"{_f(row['final_loss'], '.4f')}")
        if row["self_noise"] is not None and row["ok_rounds"] > 1:
            lines.append(f"- {row['label']}: against itself across rounds max |Δloss| {hreport._dloss(row['self_noise'])}")
        if row["te_graphs_s"]:
            lines.append(f"- {row['label']}: `make_graphed_callables` took {row['te_graphs_s']:.1f} s")
        lines += [f"- {row['label']}: {n}" for n in row["notes"]]
    return lines + [""]


def setup_lines(data: dict) -> list[str]:
    s, env, probe = data["settings"], data.get("env") or {}, data.get("probe") or {}
    card, known = card_of(env.get("gpu"))
    bf16, f8 = PEAKS[card]
    vers = ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "lightning", "transformer_engine", "cuda", "cudnn")
                     if env.get(k))
    ceil = probe.get("ceilings") or {}
    ceil_text = "; ".join(f"{k} {v:.0f} TFLOP/s" for k, v in (("BF16", ceil.get("bf16_tflops")),
                                                               ("FP8", ceil.get("fp8_tflops"))) if v)
    det = ("deterministic (`NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`, `CUBLAS_WORKSPACE_CONFIG=:4096:8`)"
           if s.get("deterministic") else "TE's and cuBLAS' default (non-deterministic) algorithms")
    support = probe.get("support") or {}
    sup = "; ".join(f"{k}: {'yes' if ok else 'no (' + why + ')'}" for k, (ok, why) in support.items())
    return [
        f"- **Date:** {env.get('date', '–')}",
        f"- **Versions:** {env.get('gpu') or 'CPU'}"
        f"{' (compute capability ' + '.'.join(map(str, env['capability'])) + ')' if env.get('capability') else ''}, "
        f"{vers or '–'}.",
        f"- **Setup:** `{s['precision']}`, TE's FP8 autocast around the layers, FP8 primary weights "
        "(`te.quantized_model_init`), `MasterWeightAdamW` (AdamW on FP32 masters, lr "
        f"{s['lr']:g}, betas 0.9/0.95, no weight decay; it writes each FP8 weight's bytes in place) for every variant, "
        f"gradient clipping {s['clip'] or 'off'}, seed {s['seed']}, {det}. One process per variant and round, the "
        f"variants alternating within each round; rounds: {s['rounds']}. ms/step: the timed window's wall time per "
        "step (a host sync at its two edges only), median over rounds.",
        f"- **MFU:** model FLOPs per step ({FLOPS_FORMULA}, as the harness counts) over the {card}'s dense peak: FP8 rows {f8:g} TFLOP/s, "
        f"BF16 rows {bf16:g} TFLOP/s (datasheet{'' if known else '; GPU not recognised, H100 SXM figures assumed'})"
        f"{'; measured GEMM ceilings on this GPU: ' + ceil_text if ceil_text else ''}.",
        "- **Kernel floor:** the summed device time of one step's kernels, copies and memsets (`torch.profiler` over "
        "the run's last steps).",
        "- **Peak memory:** `torch.cuda.max_memory_allocated()` (a graph replay's own pool is not counted there) and "
        "`max_memory_reserved()` (what the process held), each over TE eager's.",
        "- **Δloss:** max |loss − TE eager's| over every step, TE eager of the same round; same seed, data and "
        "initial weights.",
        "- **FP8 transposes stale at the end:** `verify_fp8_transposes(model)` after the last step: transposes whose "
        "bytes differ from their weight's, and how many TE had flagged (eager TE rebuilds a flagged one before use; "
        "a graph captured while the flag was clear does not). Block scaling keeps `Float8BlockwiseQTensor` weights, "
        "whose column-wise copy TE's quantization writes with the row-wise one: none to check.",
        "- **Transposes alone:** the step's transposes captured into a graph of their own and replayed 200 times "
        "on the trained model (one launch: the plugin's refresh; per tensor: TE's `_create_transpose` for each "
        "weight, what TE eager's forward and `post_all_gather_processing` run), over the row's ms/step.",
        f"- **Recipes on this GPU (TE's checks):** {sup or '–'}.",
    ]


def page_block(data: dict, command: str) -> str:
    """The generated part of ``docs/results/fp8.md``: setup, command, every recipe group's table, the checks."""
    results = aggregate(data)
    lines = ["## Result 5: a 0.85 B Llama-style model per recipe (generated)", ""] + setup_lines(data)
    lines += [f"- **Raw data:** `{data['settings'].get('raw_name', RAW_NAME)}` (every run's record, per-step losses "
              "included).", f"- **Command:** `{command}` (one recipe per call of at most ten minutes; `--resume` "
              "with the same file keeps what ran and adds the rest)", ""]
    if data["settings"].get("dry_run"):
        lines += ["**DRY RUN on CPU**: a plain-torch stand-in trained three steps per run; no figure here is a "
                  "measurement.", ""]
    skipped = [r["key"] for r in data.get("runs", []) if r.get("skipped")]
    if skipped:
        lines += [hreport.wrap(f"**Partial:** {len(skipped)} run(s) did not fit `--budget-s` ({', '.join(skipped)}); "
                               "`--resume` with this page's raw data runs them."), ""]
    elif not data["settings"].get("complete", True):
        lines += ["**INCOMPLETE**: written while the run was going, or it was stopped.", ""]
    lines += ["Variants:", ""]
    used = {v for res in results for v in res["variants"]}
    lines += [f"- {VARIANTS[v].label}: {VARIANTS[v].description}." for v in VARIANTS if v in used]
    lines.append("")
    for res in results:
        lines += group_table(res)
    lines += ["#### Checks (measured, not asserted)", ""]
    for c in checks(results):
        verdict = "not measured" if c["met"] is None else ("met" if c["met"] else "**missed**")
        lines.append(f"- {c['check']} ({c['group']}): {_f(c['value'], '.4g')} (target {c['op']} {c['target']:g}): "
                     f"{verdict}")
    return "\n".join(x if x.startswith(("|", "#")) or "\n" in x else hreport.wrap(x, bullet=x.startswith("- "))
                     for x in lines)


def short_table(data: dict) -> str:
    out = []
    for res in aggregate(data):
        out.append(f"{res['group']}: {res['flops_per_step'] / 1e12:.2f} TFLOP/step")
        for row in res["variants"].values():
            why = _state(row, res)
            if why:
                out.append(f"  {row['label']:34s} {why[:140]}")
                continue
            out.append(f"  {row['label']:34s} {row['ms_per_step']:9.2f} ms  x{_f(row['ratio'], '.3f')}  MFU "
                       f"{_f(row['mfu'] and 100 * row['mfu'], '.1f')} %  floor {_f(row['floor_ms'], '.2f')} ms  "
                       f"|dloss| {hreport._dloss(row['max_dloss'])}  peak {_f(row['peak_gib'], '.2f')} GiB  stale "
                       f"{_verify_cell(row) if row['fp8'] else '-'}  alone {_alone_cell(row) or '-'}")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.fp8_scale",
        description="FP8 training of a 0.85 B Llama-style TransformerEngine model under Lightning: TE eager, ours, "
                    "TE's graphed layers, ours without the refresh and BF16, per FP8 recipe; one process per run. "
                    "Needs a CUDA GPU with TransformerEngine (--plan and --dry-run run anywhere).")
    p.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES, choices=list(RECIPES),
                   help="FP8 recipes, one group each (a recipe TE says this GPU cannot run is reported as not run)")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=2, help="each round runs every variant of every recipe once")
    p.add_argument("--steps", type=int, default=220, help=f"steps per run (>= {MIN_STEPS}: the losses are compared "
                   "over every step)")
    p.add_argument("--batch", type=int, default=4, help="sequences of 2048 tokens per step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=0.0, help="gradient clipping by norm (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nondeterministic", action="store_true",
                   help="TE's and cuBLAS' default algorithms (runs of one variant then differ by atomics' order)")
    p.add_argument("--plan", action="store_true", help="print the runs and their estimated duration; run nothing")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no run that would end past this many seconds (estimated); --resume runs the rest")
    p.add_argument("--resume", type=Path, default=None,
                   help=f"a {RAW_NAME} of an earlier run with the same settings: its successful runs are kept")
    p.add_argument("--report", type=Path, default=None, help=f"render this {RAW_NAME} (no runs)")
    p.add_argument("--out", type=Path, default=None, help=f"where {RAW_NAME}, the page block and the log go "
                   f"(default {DEFAULT_OUT}; dry run: build/fp8_scale_dry_run)")
    p.add_argument("--write-docs", action="store_true",
                   help=f"also write docs/results/fp8.md's generated section (between {BEGIN} and {END}) and "
                        f"docs/results/{RAW_NAME}")
    p.add_argument("--child-timeout-s", type=float, default=420.0)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU smoke run of the plumbing: a plain-torch stand-in of the model (no TE, no FP8), three "
                        "steps per run; measures nothing")
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--record", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def canonical_command(args: argparse.Namespace, records: list[dict] = ()) -> str:
    """The command that regenerates the section: this run's, widened to the recipes and variants of the runs it
    resumed (the section holds those too)."""
    runs = [r for r in records if r.get("kind") == "variant"]
    recipes = [r for r in RECIPES if r in set(args.recipes) | {x["workload"]["recipe"] for x in runs}]
    variants = [v for v in VARIANTS if v in set(args.variants) | {x["variant"] for x in runs}]
    cmd = ["python", "-m", "benchmarks.fp8_scale", "--recipes", *recipes, "--rounds", str(args.rounds)]
    if variants != DEFAULT_VARIANTS:
        cmd += ["--variants", *variants]
    if args.steps != 220:
        cmd += ["--steps", str(args.steps)]
    if args.batch != 4:
        cmd += ["--batch", str(args.batch)]
    if args.lr != 3e-4:
        cmd += ["--lr", f"{args.lr:g}"]
    if args.clip:
        cmd += ["--clip", f"{args.clip:g}"]
    if args.seed:
        cmd += ["--seed", str(args.seed)]
    if args.nondeterministic:
        cmd.append("--nondeterministic")
    return shlex.join([*cmd, "--out", str(DEFAULT_OUT), "--write-docs"])


def settings_of(args: argparse.Namespace) -> dict:
    return {
        "precision": "32-true" if args.dry_run else "bf16-mixed", "optim": "MasterWeightAdamW", "lr": args.lr,
        "clip": args.clip, "seed": args.seed, "deterministic": not args.nondeterministic,
        "device": "cpu" if args.dry_run else "cuda", "dry_run": args.dry_run, "lanes": 1, "rounds": args.rounds,
        "steps": args.steps if not args.dry_run else 3, "batch": args.batch, "baseline": REFERENCE,
        "raw_name": RAW_NAME, "child_module": "benchmarks.fp8_scale",
    }


#: what a resumed file must share with this run
RESUME_KEYS = (*runner.RESUME_KEYS, "lr", "steps", "batch")


def as_data(settings: dict, records: list[dict], complete: bool) -> dict[str, Any]:
    """The raw JSON: settings, environment, the probe and every run's record (rounds, recipes, variants in order)."""
    probe = next((r for r in records if r.get("kind") == "probe" and r.get("ok")), None)
    env = dict((probe or {}).get("env") or next((r["env"] for r in records if r.get("env")), None) or {})
    order = {n: i for i, n in enumerate(RECIPES)}
    vorder = {n: i for i, n in enumerate(VARIANTS)}
    runs = sorted((r for r in records if r.get("kind") == "variant"),
                  key=lambda r: (r["round"], order.get(r["workload"]["recipe"], 99), vorder.get(r["variant"], 99)))
    return {"settings": {**settings, "complete": complete}, "env": env, "probe": probe, "runs": runs}


def write_outputs(data: dict, out: Path, command: str, docs: bool, page: Path = PAGE) -> None:
    """The raw JSON and the page block into ``out``; with ``docs`` also into the results page."""
    out.mkdir(parents=True, exist_ok=True)
    (out / RAW_NAME).write_text(json.dumps(data, indent=1, default=str))
    block = page_block(data, command)
    (out / "fp8-scale.page.md").write_text(block + "\n")
    if docs:
        write_docs(data, block, page)


def write_docs(data: dict, block: str, page: Path = PAGE) -> None:
    """Replace the generated section of the results page (between :data:`BEGIN` and :data:`END`; appended the first
    time) and write its raw JSON next to it."""
    text = page.read_text()
    if BEGIN not in text:  # the first measurement: the section is appended
        text = text.rstrip("\n") + f"\n\n{BEGIN}\n{END}\n"
    page.write_text(hreport.replace_between(text, BEGIN, END, block))
    (page.parent / RAW_NAME).write_text(json.dumps(data, indent=1, default=str) + "\n")


def _unsupported_records(plan: list[dict], support: dict) -> tuple[list[dict], list[dict]]:
    """The plan's jobs of recipes the probe found unsupported (or whose weights no optimizer here writes from FP32
    masters: :data:`MASTER_WRITES`), as records saying why, and the jobs left to run."""
    todo, recs = [], []
    for j in plan:
        ok = support.get(j["workload"]["recipe"], (True, "")) if j["kind"] == "variant" else (True, "")
        if ok[0] and j["kind"] == "variant" and j["workload"]["recipe"] not in MASTER_WRITES:
            ok = (False, NO_MASTER_WRITER)
        if ok[0]:
            todo.append(j)
        else:
            recs.append({**j, "ok": False, "unsupported": ok[1] or "not supported on this GPU",
                         "error": f"not run: {ok[1]}"})
    return recs, todo


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child is not None:
        from benchmarks.fp8_scale_model import child_main

        return child_main(args.child, args.record)
    if args.dry_run and args.write_docs:
        raise SystemExit("--write-docs with --dry-run would put a smoke run's numbers in the docs")
    if args.report is not None:
        data = json.loads(args.report.read_text())
        command = data.get("settings", {}).get("command") or canonical_command(args)
        if data.get("settings", {}).get("dry_run") and args.write_docs:
            raise SystemExit("--write-docs with a dry run's JSON would put a smoke run's numbers in the docs")
        if args.out is not None:
            write_outputs(data, args.out, command, docs=False)
        if args.write_docs:
            write_docs(data, page_block(data, command))
        print(short_table(data))
        return 0
    if args.steps < MIN_STEPS and not args.dry_run:
        raise SystemExit(f"--steps {args.steps}: the losses are compared over at least {MIN_STEPS} steps")
    settings = settings_of(args)
    plan = make_plan(args.recipes, args.variants, args.rounds, settings)
    gpu = None
    if not args.dry_run and not args.plan:
        try:
            import torch
        except ImportError:
            torch = None  # type: ignore[assignment]
        if torch is None or not torch.cuda.is_available():
            print("python -m benchmarks.fp8_scale needs a CUDA GPU with TransformerEngine (FP8: Ada, Hopper or "
                  "newer); --plan and --dry-run (the CPU smoke run of the plumbing) run anywhere.")
            return 2
        gpu = torch.cuda.get_device_name()
    records, done = runner.load_resume(args.resume, settings, gpu, keys=RESUME_KEYS)
    records = [r for r in records if r.get("kind") != "ceiling"]
    old_probe = json.loads(args.resume.read_text()).get("probe") if args.resume and args.resume.exists() else None
    if old_probe and old_probe.get("ok") and (old_probe.get("env") or {}).get("gpu") == gpu:
        records.append(old_probe)
        done.add("probe")
    settings["command"] = canonical_command(args, records)
    print(plan_text(plan, done, args.budget_s), flush=True)
    if args.plan:
        return 0
    out = args.out or (REPO / "build" / "fp8_scale_dry_run" if args.dry_run else REPO / DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def on_record() -> None:
        write_outputs(as_data(settings, records, complete=False), out, settings["command"], docs=False)

    log = out / "fp8_scale.log"
    probe = next((r for r in records if r.get("kind") == "probe"), None)
    if probe is None:
        runner.execute(plan[:1], set(), args.budget_s, args.child_timeout_s, 1, records, on_record, log)
        probe = records[-1]
    if not probe.get("ok"):
        print(f"fp8_scale: the probe failed ({probe.get('error')}); see {log}. TransformerEngine must import on "
              "this machine (bash benchmarks/gpu_te_session.sh te_install).")
        write_outputs(as_data(settings, records, complete=False), out, settings["command"], docs=False)
        return 2
    unsupported, todo = _unsupported_records(plan[1:], probe.get("support") or {})
    for r in unsupported:
        if r["key"] not in done:
            print(f"[{r['key']}] not run: {r['unsupported']}", flush=True)
    records += [r for r in unsupported if r["key"] not in done]
    # execute() counts its budget from its own start: what the probe left of it (0 stays "no limit")
    budget = max(1e-3, args.budget_s - (time.perf_counter() - t0)) if args.budget_s else 0.0
    runner.execute(todo, done, budget, args.child_timeout_s, 1, records, on_record, log)
    complete = all(r.get("ok") or r.get("unsupported") for r in records if r.get("kind") == "variant")
    data = as_data(settings, records, complete=complete)
    write_outputs(data, out, settings["command"], args.write_docs)
    print(f"\nfp8_scale: {time.perf_counter() - t0:.0f} s; {out / RAW_NAME}")
    print(short_table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())

