"""The harness's figures and tables from its run records. Pure Python (no torch, no GPU): the CPU tests run it.

Input: the records the children write (:mod:`benchmarks.harness.child`), one per workload, variant and round, plus
the matmul-ceiling record. Output: per workload and variant the ms/step (median over rounds and every round), the
ratio to a baseline variant within each round, max |Δloss| against eager of the same round and against the row's own
loss reference of the same round (``Variant.loss_reference``: for ours the run without graphs whose optimizer is
prepared as ours prepares it, so the same kernels run and the losses must agree bitwise), peak memory and its ratio to
the same run without our graphs, MFU and the kernel floor, and which kernels make the floor of compile + ours differ
from ``reduce-overhead``'s (and ours' from its reference's); the goals of the table reported met or missed (never
asserted); the page's and the README's markdown.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Iterable
from typing import Any, Optional

from .variants import COMPILED_EAGER, EAGER, VARIANTS
from .workloads import FLOPS_FORMULA, PEAK_BF16_TFLOPS, WORKLOADS, model_flops_per_step

README_BEGIN, README_END = "<!-- results:begin -->", "<!-- results:end -->"
PAGE_BEGIN, PAGE_END = "<!-- harness:begin -->", "<!-- harness:end -->"
GIB = 2**30


def median(xs: Iterable[Optional[float]]) -> Optional[float]:
    vals = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(vals) if vals else None


def max_abs_diff(a: Optional[list], b: Optional[list]) -> tuple[Optional[float], Optional[int]]:
    """max |a - b| over the steps both recorded, and the first step where they differ (None: never)."""
    if not a or not b:
        return None, None
    worst, first = 0.0, None
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            continue
        d = abs(x - y) if math.isfinite(x) and math.isfinite(y) else (0.0 if x == y else math.inf)
        if d > 0 and first is None:
            first = i
        worst = max(worst, d)
    return worst, first


def _timed(r: dict) -> bool:
    return bool(r.get("ok")) and r.get("ms_per_step") is not None


def _loss_vs(runs: list[dict], ref_runs: dict[int, dict]) -> tuple[Optional[float], Optional[int], list]:
    """max |Δloss| of ``runs`` against the reference run of the same round; per round too."""
    per, firsts = [], []
    for r in runs:
        ref = ref_runs.get(r["round"])
        if ref is None or ref is r or not r.get("losses"):
            continue
        d, f = max_abs_diff(r["losses"], ref.get("losses"))
        if d is not None:
            per.append(d)
            firsts.append(f)
    fs = [f for f in firsts if f is not None]
    return (max(per) if per else None), (min(fs) if fs else None), per


def kernels_median(runs: list[dict]) -> Optional[dict[str, float]]:
    """Per kernel name, the median over ``runs`` of its time per step (a name a run's profile lacks: 0 there);
    None when no run kept every kernel's time."""
    profs = [r["kernels_us_per_step"] for r in runs if r.get("kernels_us_per_step")]
    if not profs:
        return None
    names = {n for k in profs for n in k}
    return {n: statistics.median(k.get(n, 0.0) for k in profs) for n in names}


def aggregate(runs: list[dict], baseline: str = "compile_ro") -> list[dict]:
    """Per-workload results, workloads and variants in table order."""
    by_w: dict[str, list[dict]] = {}
    for r in runs:
        if r.get("kind") == "variant":
            by_w.setdefault(r["workload"]["name"], []).append(r)
    order = [n for n in WORKLOADS if n in by_w] + sorted(set(by_w) - set(WORKLOADS))
    results = []
    for name in order:
        wr = by_w[name]
        wl = wr[0]["workload"]
        vnames = [v for v in VARIANTS if any(r["variant"] == v for r in wr)]
        by_v = {v: sorted((r for r in wr if r["variant"] == v), key=lambda r: r["round"]) for v in vnames}
        ok_by_round = {v: {r["round"]: r for r in rs if _timed(r)} for v, rs in by_v.items()}
        n_mm = next((r["n_matmul_params"] for r in wr if r.get("n_matmul_params")), None)
        flops = model_flops_per_step(n_mm, wl["layers"], wl["hidden"], wl["batch"], wl["seq"]) if n_mm else None
        base = baseline if baseline in ok_by_round and ok_by_round[baseline] else EAGER
        res: dict[str, Any] = {
            "workload": name, "title": wl.get("title", name), "why": wl.get("why", ""), "bound": wl.get("bound"),
            "tokens": wl["batch"] * wl["seq"], "n_params": next((r["n_params"] for r in wr if r.get("n_params")), None),
            "n_matmul_params": n_mm, "flops_per_step": flops, "baseline": base, "variants": {},
        }
        for v, rs in by_v.items():
            ok = [r for r in rs if _timed(r)]
            ms = median(r["ms_per_step"] for r in ok)
            floor = median(r.get("floor_ms") for r in ok)
            ratio_rounds = [ok_by_round[v][k]["ms_per_step"] / ok_by_round[base][k]["ms_per_step"]
                            for k in sorted(ok_by_round[v]) if k in ok_by_round.get(base, {})]
            stats = [r["stats"] for r in ok if r.get("stats")]
            peak = max((r["peak_mem_bytes"] for r in ok if r.get("peak_mem_bytes")), default=None)
            held = max((r["peak_reserved_bytes"] for r in ok if r.get("peak_reserved_bytes")), default=None)
            d_eager, first_eager, d_eager_rounds = _loss_vs(ok, ok_by_round.get(EAGER, {}))
            loss_ref = VARIANTS[v].loss_reference
            d_ref, first_ref, d_ref_rounds = _loss_vs(ok, ok_by_round.get(loss_ref, {})) if loss_ref else (None,) * 3
            self_d = [max_abs_diff(a.get("losses"), b.get("losses"))[0] for i, a in enumerate(ok) for b in ok[i + 1:]]
            row: dict[str, Any] = {
                "label": VARIANTS[v].label, "rounds": len(rs), "ok_rounds": len(ok),
                "skipped": sum(1 for r in rs if r.get("skipped")),
                "errors": sorted({r["error"] for r in rs if not r.get("ok") and not r.get("skipped") and r.get("error")}),
                "ms_rounds": {r["round"]: r["ms_per_step"] for r in ok},
                "ms_per_step": ms,
                "ratio_rounds": ratio_rounds, "ratio": median(ratio_rounds),
                "mfu": _mfu(flops, ms),
                "floor_ms": floor, "over_floor": ms / floor if ms and floor else None,
                "device_events_per_step": median(r.get("device_events_per_step") for r in ok),
                "gpu_idle_at_step_start": median(r.get("gpu_idle_at_step_start") for r in ok),
                "max_dloss_eager": 0.0 if v == EAGER and ok else d_eager, "first_diff_step": first_eager,
                "dloss_eager_rounds": d_eager_rounds,
                "loss_reference": loss_ref, "max_dloss_ref": d_ref, "first_diff_ref": first_ref,
                "dloss_ref_rounds": d_ref_rounds or [],
                "self_noise": max((d for d in self_d if d is not None), default=None),
                "peak_gib": peak / GIB if peak else None,
                "peak_reserved_gib": held / GIB if held else None,
                "peak_over_eager": median(s.get("peak_over_eager") for s in stats),
                "replays": median(s.get("replays") for s in stats),
                "captures": median(s.get("captures") for s in stats),
                "notes": sorted({n for r in rs for n in r.get("notes", [])}),
                "loss_aliased": any(r.get("loss_aliased") for r in ok),
                "final_loss": next((r["losses"][-1] for r in reversed(ok) if r.get("losses")), None),
                "kernels_us": kernels_median(ok),
            }
            if VARIANTS[v].compile is not None:
                d, f, per = _loss_vs(ok, ok_by_round.get(COMPILED_EAGER, {}))
                row["max_dloss_compile"] = 0.0 if v == COMPILED_EAGER and ok else d
                row["dloss_compile_rounds"] = per
            res["variants"][v] = row
        for v, row in res["variants"].items():
            ref = res["variants"].get(VARIANTS[v].reference)
            row["peak_over_reference"] = (row["peak_gib"] / ref["peak_gib"]
                                          if VARIANTS[v].graphs and ref and ref["peak_gib"] and row["peak_gib"]
                                          else None)
        eager_events = res["variants"].get(EAGER, {}).get("device_events_per_step")
        for v, row in res["variants"].items():
            ev = row["device_events_per_step"]
            if VARIANTS[v].ours and ev and eager_events and ev < 0.5 * eager_events:
                row["notes"].append(f"the profiler saw {ev:.0f} device events per step against eager's "
                                    f"{eager_events:.0f}: it may not trace every kernel inside a graph replay")
        results.append(res)
    return results


def _mfu(flops: Optional[float], ms: Optional[float]) -> Optional[float]:
    if not flops or not ms:
        return None
    return flops / (ms / 1e3) / (PEAK_BF16_TFLOPS * 1e12)


# label -> (bound or "any", variant, key, op, want): the goals of the table, reported met or missed, never asserted.
GOALS: dict[str, tuple[str, str, str, str, float]] = {
    "compile + ours / reduce-overhead, host-bound": ("host", "compile_ours", "vs_ro", "<=", 0.75),
    "compile + ours / its kernel floor, host-bound": ("host", "compile_ours", "over_floor", "<=", 1.05),
    "compile + ours / reduce-overhead, GPU-bound": ("gpu", "compile_ours", "vs_ro", "<=", 0.98),
    "peak memory, ours / eager": ("any", "ours", "peak_over_reference", "<=", 1.05),
    "peak memory, compile + ours / compile": ("any", "compile_ours", "peak_over_reference", "<=", 1.05),
    "max |Δloss|, compile + ours against compile, optimizer prepared": ("any", "compile_ours", "max_dloss_ref", "<=",
                                                                        0.0),
    "max |Δloss|, ours against eager, optimizer prepared": ("any", "ours", "max_dloss_ref", "<=", 0.0),
}

#: (variant, against): the floor differences the page lists per workload, where both ran with a kernel profile
FLOOR_PAIRS = [("compile_ours", "compile_ro"), ("ours", "reference"), ("ours", "ours_capturable"),
               ("compile_ours", "compile_ours_torch_adam")]
FLOOR_TOP = 8


def _vs_ro(res: dict, v: str) -> Optional[float]:
    """Median over rounds of the variant's ms over reduce-overhead's in the same round."""
    row, ro = res["variants"].get(v), res["variants"].get("compile_ro")
    if not row or not ro:
        return None
    pairs = [row["ms_rounds"][k] / ro["ms_rounds"][k] for k in row["ms_rounds"] if k in ro["ms_rounds"]]
    return median(pairs)


def goals(results: list[dict]) -> list[dict]:
    """Each goal per workload it applies to: the measured figure and whether it is met."""
    out = []
    for label, (bound, v, key, op, want) in GOALS.items():
        for res in results:
            if bound != "any" and res.get("bound") != bound or v not in res["variants"]:
                continue
            got = _vs_ro(res, v) if key == "vs_ro" else res["variants"][v].get(key)
            met = None if got is None else {"<=": got <= want, ">=": got >= want}[op]
            out.append({"goal": label, "workload": res["workload"], "value": got, "op": op, "target": want,
                        "met": met})
    return out


# ---------------------------------------------------------------------------------------------------- markdown


def _f(x: Optional[float], fmt: str, none: str = "–") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, fmt)


def _pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{100 * x:.0f} %"


def _dloss(d: Optional[float]) -> str:
    if d is None:
        return "–"
    return "0 (bitwise)" if d == 0 else f"{d:.3g}"


def _dloss_ref(row: dict) -> str:
    """The cell of max |Δloss| against the row's own loss reference, naming it."""
    if row["loss_reference"] is None:
        return ""
    return f"{_dloss(row['max_dloss_ref'])} vs {VARIANTS[row['loss_reference']].label}"


def _state(row: dict) -> Optional[str]:
    """Why a row has no timing: skipped or failed; None when it has one."""
    if row["ms_per_step"] is not None:
        return None
    if row["skipped"] and not row["errors"]:
        return "skipped (budget)"
    return "failed: " + "; ".join(row["errors"])[:240]


def wrap(text: str, bullet: bool = False) -> str:
    """``text`` wrapped at 118 characters (a bullet's continuation lines indented by two)."""
    return textwrap.fill(text, width=118, subsequent_indent="  " if bullet else "", break_on_hyphens=False,
                         break_long_words=False)


def setup_lines(data: dict) -> list[str]:
    """The page's date, versions and setup bullets."""
    s, env, ceiling = data["settings"], data.get("env") or {}, data.get("ceiling") or {}
    vers = ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "lightning", "transformers", "cuda") if env.get(k))
    det = ("`torch.use_deterministic_algorithms(True, warn_only=True)`" if s.get("deterministic")
           else "torch's default (non-deterministic) algorithms")
    ceil = (f"; measured bf16 matmul ceiling on this GPU: {ceiling['matmul_tflops']:.0f} TFLOP/s "
            f"({ceiling['matmul_n']}³ matmuls)" if ceiling.get("matmul_tflops") else "")
    return [
        f"- **Date:** {env.get('date', '–')}",
        f"- **Versions:** {env.get('gpu') or 'CPU'}, {vers or '–'}; NeMo 3.0.0's callback from its wheel.",
        f"- **Setup:** `{s['precision']}`, AdamW ({'fused' if s['optim'] == 'fused_adamw' else 'foreach'}, weight "
        f"decay 0.1 on >= 2-D weights), linear warm-up over the first tenth of the steps then cosine to 0.1 "
        f"(`LambdaLR` stepped every step; NeMo's variant: the same schedule as a `_LRScheduler`, the only kind its "
        f"callback accepts), gradient clipping {s['clip'] or 'off'}, seed {s['seed']}, {det}. One "
        f"process per variant and round, the variants alternating within each round; rounds: {s['rounds']}"
        f"{_lanes(s)}. "
        "ms/step: the timed window's wall time per step (a host sync at its two edges only), median over rounds.",
        f"- **MFU:** model FLOPs per step ({FLOPS_FORMULA}) over the H200's dense bf16 peak, {PEAK_BF16_TFLOPS} "
        f"TFLOP/s (datasheet){ceil}.",
        "- **Kernel floor:** the summed device time (kernels, copies, memsets) of one step of the variant's own "
        "kernels, from `torch.profiler` over the run's last steps; no schedule of those kernels beats it. Floor "
        "differences: per kernel name (cut to 120 characters) the time per step of each side; inductor numbers its "
        "kernels per compile, so one fused kernel may carry other names in two compiled runs.",
        "- **GPU waited for the host:** the share of timed steps at whose start the GPU had already finished the "
        "previous step (an event polled, never waited on): near 100 % the step is host-bound, and its time over the "
        "kernel floor is the host's per-step path (Lightning's loop, hooks, the replay's launches), not the graph.",
        "- **Peak memory:** `torch.cuda.max_memory_allocated()` of the run; '/ without graphs': over the same run "
        "without CUDA graphs (ours and NeMo's over eager, compile + ours and `reduce-overhead` over compile); "
        "`peak_over_eager`: the plugin's own figure, the graphed run's peak over its eager warm-up's. A graph replay "
        "(ours, NeMo's, cudagraph trees') takes its memory from its graph's pool without the allocator, so the "
        "allocated peak misses what replays use (cudagraph trees' replayed activations and gradients): 'peak reserved "
        "GiB', `torch.cuda.max_memory_reserved()`, is what the process held from the GPU, the fair comparison of "
        "graphed runs.",
        "- **Δloss:** max |loss − reference| over every step, against the reference's run in the same round: eager "
        "Lightning, and each row's own reference, named in the cell: for ours (and NeMo's) eager with the optimizer "
        "prepared as ours prepares it (`OptimizerPrep`: capturable AdamW, whose bias correction runs on the device, "
        "and the learning rate a device tensor), for compile + ours `torch.compile` with that optimizer, for "
        "`reduce-overhead` `torch.compile`. A row and its reference run the same kernels: 0 (bitwise) expected, "
        "except NeMo's (its schedule writes its own fp32 learning-rate tensor).",
    ]


def _lanes(s: dict) -> str:
    if s.get("lanes", 1) <= 1:
        return ""
    return (f"; {s['lanes']} GPUs of one host, each round of a workload on one GPU (the ratios within a round compare "
            "runs on the same GPU; runs on the other GPUs share the host's CPUs)")


def workload_table(res: dict) -> list[str]:
    """One workload's table and the notes under it."""
    base_label = VARIANTS[res["baseline"]].label
    head = (f"## {res['title']}", "",
            f"{_f(res['n_params'] and res['n_params'] / 1e6, '.1f')} M parameters "
            f"({_f(res['n_matmul_params'] and res['n_matmul_params'] / 1e6, '.1f')} M in matmuls), "
            f"{res['tokens']:,} tokens per step, {_f(res['flops_per_step'] and res['flops_per_step'] / 1e12, '.3f')} "
            f"TFLOP per step; {res['why']}.", "",
            f"| variant | ms/step | rounds (ms) | / {base_label} (per round) | MFU | kernel floor (ms) | / floor "
            "| GPU waited for the host | max \\|Δloss\\| vs eager | vs its reference | peak GiB | / without graphs "
            "| `peak_over_eager` | peak reserved GiB | replays |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = list(head)
    for _v, row in res["variants"].items():
        why = _state(row)
        if why:
            lines.append(f"| {row['label']} | {why} |" + " |" * 13)
            continue
        rounds = ", ".join(f"{row['ms_rounds'][k]:.2f}" for k in sorted(row["ms_rounds"]))
        ratio = ", ".join(f"{x:.3f}" for x in row["ratio_rounds"]) or "–"
        lines.append(
            f"| {row['label']} | {row['ms_per_step']:.2f} | {rounds} | {ratio} | {_f(row['mfu'] and 100 * row['mfu'], '.1f')} % | "
            f"{_f(row['floor_ms'], '.2f')} | {_f(row['over_floor'], '.3f')} | "
            f"{_pct(row['gpu_idle_at_step_start'])} | {_dloss(row['max_dloss_eager'])} | "
            f"{_dloss_ref(row)} | "
            f"{_f(row['peak_gib'], '.2f')} | {_f(row['peak_over_reference'], '.3f')} | "
            f"{_f(row['peak_over_eager'], '.3f')} | {_f(row.get('peak_reserved_gib'), '.2f')} | "
            f"{_f(row['replays'], '.0f')} |")
    lines.append("")
    for _v, row in res["variants"].items():
        if row["self_noise"] is not None and row["ok_rounds"] > 1:
            lines.append(f"- {row['label']}: against itself across rounds max |Δloss| {_dloss(row['self_noise'])}"
                         f"{'; first Δ vs eager at step ' + str(row['first_diff_step']) if row['first_diff_step'] is not None else ''}")
        if row["first_diff_ref"] is not None:
            lines.append(f"- {row['label']}: first Δ vs {VARIANTS[row['loss_reference']].label} at step "
                         f"{row['first_diff_ref']}")
        lines += [f"- {row['label']}: {n}" for n in row["notes"]]
        if row["loss_aliased"]:
            lines.append(f"- {row['label']}: the loss Lightning returned aliased an earlier step's (copied per step)")
    return lines + [""]


def floor_diff(res: dict, v: str, against: str, top: int = FLOOR_TOP) -> Optional[dict]:
    """The kernels whose time per step differs most between two variants of a workload (median over rounds of each
    name's time), ``top`` of them by |Δ|; None unless both kept every kernel's time."""
    a, b = res["variants"].get(v), res["variants"].get(against)
    if not a or not b or not a.get("kernels_us") or not b.get("kernels_us"):
        return None
    ka, kb = a["kernels_us"], b["kernels_us"]
    rows = [(n, ka.get(n, 0.0), kb.get(n, 0.0)) for n in set(ka) | set(kb)]
    rows.sort(key=lambda t: (-abs(t[1] - t[2]), t[0]))
    return {"variant": v, "against": against, "sum_us": (sum(ka.values()), sum(kb.values())), "names": len(rows),
            "kernels": [{"name": n, "us": x, "us_against": y, "delta_us": x - y} for n, x, y in rows[:top]]}


def floor_diff_lines(res: dict) -> list[str]:
    """The page's floor-difference section of one workload (nothing where no pair ran with a kernel profile)."""
    lines: list[str] = []
    for v, against in FLOOR_PAIRS:
        fd = floor_diff(res, v, against)
        if fd is None:
            continue
        la, lb = VARIANTS[v].label, VARIANTS[against].label
        (sa, sb), n = fd["sum_us"], fd["names"]
        lines += [f"### Floor difference, {la} against {lb}", "",
                  f"Device time per step (median over rounds per kernel name): {sa / 1e3:.3f} ms against "
                  f"{sb / 1e3:.3f} ms, Δ {(sa - sb) / 1e3:+.3f} ms over {n} kernel names; the {len(fd['kernels'])} "
                  "largest |Δ|:", "",
                  f"| kernel | {la} (µs/step) | {lb} (µs/step) | Δ (µs/step) |", "|---|---|---|---|"]
        for k in fd["kernels"]:
            name = k["name"].replace("|", "\\|").replace("`", "'")
            lines.append(f"| `{name}` | {k['us']:.1f} | {k['us_against']:.1f} | {k['delta_us']:+.1f} |")
        lines.append("")
    return lines


def goal_lines(rows: list[dict]) -> list[str]:
    out = []
    for g in rows:
        verdict = "not measured" if g["met"] is None else ("met" if g["met"] else "**missed**")
        out.append(f"- {g['goal']} ({g['workload']}): {_f(g['value'], '.4g')} (goal {g['op']} {g['target']}): {verdict}")
    return out


def page_block(data: dict, command: str) -> str:
    """The generated part of ``docs/results/step-time.md``: setup, command, every workload's table, the goals."""
    results = aggregate(data["runs"], data["settings"].get("baseline", "compile_ro"))
    lines = setup_lines(data)
    lines += [f"- **Raw data:** `{data['settings'].get('raw_name', 'step-time.json')}` (every run's record, per-step "
              "losses included).", f"- **Command:** `{command}`", ""]
    if data["settings"].get("dry_run"):
        lines += ["**DRY RUN on CPU**: every variant trained eagerly for three steps; no figure here is a measurement.",
                  ""]
    if not data["settings"].get("complete", True):
        skipped = [r["key"] for r in data["runs"] if r.get("skipped")]
        if skipped:
            lines += [wrap(f"**Partial:** {len(skipped)} run(s) did not fit `--budget-s` and are marked skipped "
                           f"({', '.join(skipped)}); `--resume` with this page's `step-time.json` runs them."), ""]
        else:
            lines += ["**INCOMPLETE**: written while the run was going, or it was stopped.", ""]
    for res in results:
        lines += workload_table(res)
        lines += floor_diff_lines(res)
    lines += ["## Goals (measured, not asserted)", "", *goal_lines(goals(results)), ""]
    return "\n".join(x if x.startswith(("|", "#")) or "\n" in x else wrap(x, bullet=x.startswith("- "))
                     for x in lines)


def readme_block(data: dict) -> str:
    """The README's results table: ms/step per workload and variant, MFU of the fastest, peak memory ratios."""
    results = aggregate(data["runs"], data["settings"].get("baseline", "compile_ro"))
    env, s = data.get("env") or {}, data["settings"]
    cols = ["eager", "ours", "compile", "compile_ro", "compile_ours", "nemo"]
    cols = [c for c in cols if any(c in r["variants"] for r in results)]
    lines = [wrap(f"ms/step on one {env.get('gpu') or 'CPU'} ({env.get('date', '–')}; torch {env.get('torch', '–')}, "
                  f"{s['precision']}, AdamW, warm-up + cosine, clip {s['clip'] or 'off'}; median over rounds: "
                  f"{s['rounds']}, one process per variant and round). MFU: model FLOPs over the dense bf16 peak "
                  f"({PEAK_BF16_TFLOPS} TFLOP/s). Peak memory: ours over eager, compile + ours over compile."), "",
             "| workload | " + " | ".join(VARIANTS[c].label for c in cols)
             + " | compile + ours / reduce-overhead | best MFU | peak memory, graphed / without |",
             "|---|" + "---|" * (len(cols) + 3)]
    for res in results:
        cells = []
        for c in cols:
            row = res["variants"].get(c)
            if row is None:
                cells.append("")
            elif row["ms_per_step"] is None:
                cells.append("skipped" if row["skipped"] and not row["errors"] else "failed")
            else:
                cells.append(f"{row['ms_per_step']:.2f}")
        best = max((r["mfu"] for r in res["variants"].values() if r["mfu"]), default=None)
        peaks = [res["variants"][v]["peak_over_reference"] for v in ("ours", "compile_ours")
                 if v in res["variants"] and res["variants"][v]["peak_over_reference"]]
        lines.append(f"| {res['title'].split(' (')[0]} | " + " | ".join(cells) + f" | {_f(_vs_ro(res, 'compile_ours'), '.3f')} | "
                     f"{_f(best and 100 * best, '.1f')} % | {' / '.join(f'{p:.2f}' for p in peaks) or '–'} |")
    if s.get("dry_run"):
        lines.insert(0, "**DRY RUN on CPU**: tiny shapes, three eager steps; no figure here is a measurement.\n")
    lines += ["", wrap("Losses against eager and against each variant's reference without graphs, kernel floors "
                       "and the kernels that make them differ, per-round figures and the command that regenerates "
                       "this: [docs/results/step-time.md](docs/results/step-time.md).")]
    return "\n".join(lines)


def replace_between(text: str, begin: str, end: str, body: str) -> str:
    """``text`` with what lies between the ``begin`` and ``end`` markers replaced by ``body``; each marker must occur
    exactly once, ``begin`` first."""
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"expected one {begin!r} before one {end!r}")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body.strip()}\n{end}{tail}"


def short_table(data: dict) -> str:
    """The lines printed at the end of a run."""
    out = []
    for res in aggregate(data["runs"], data["settings"].get("baseline", "compile_ro")):
        out.append(f"{res['workload']}: baseline {res['baseline']}")
        for _v, row in res["variants"].items():
            why = _state(row)
            if why:
                out.append(f"  {row['label']:28s} {why[:120]}")
                continue
            out.append(f"  {row['label']:28s} {row['ms_per_step']:9.3f} ms  x{_f(row['ratio'], '.3f')}  MFU "
                       f"{_f(row['mfu'] and 100 * row['mfu'], '.1f')} %  floor {_f(row['floor_ms'], '.3f')} ms  "
                       f"|dloss| {_dloss(row['max_dloss_eager'])}"
                       + (f" (vs {row['loss_reference']}: {_dloss(row['max_dloss_ref'])})" if row["loss_reference"]
                          else "")
                       + f"  peak {_f(row['peak_gib'], '.2f')} GiB, reserved {_f(row.get('peak_reserved_gib'), '.2f')} GiB")
    return "\n".join(out)
