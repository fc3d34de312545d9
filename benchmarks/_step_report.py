"""Aggregation and reports of ``benchmarks/step_time.py`` (pure Python: no torch, no GPU).

Input: the per-process run records the children of ``step_time.py`` write (one per variant, preset and round).
Output: per-preset results (medians over rounds, ratios, loss differences against Lightning eager), the
markdown table, the TARGETS report, the PNG and the kernel-profile text. Everything here measures and reports;
nothing asserts.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

EAGER = "lightning_eager"
OURS = "callback"
NEMO = "nemo_callback"


def _median(xs: Iterable[Optional[float]]) -> Optional[float]:
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


def aggregate(runs: list[dict], variant_order: list[str]) -> list[dict]:
    """Per-preset results from the run records (see ``step_time.py``'s ``--one`` output)."""
    by_preset: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        if not r.get("profile_only"):
            by_preset[r["preset"]].append(r)
    results = []
    for preset, prs in by_preset.items():
        eager_by_round = {r["round"]: r for r in prs if r["variant"] == EAGER and r.get("ok") and r.get("losses")}
        any_eager = next(iter(eager_by_round.values()), None)
        floors = [r.get("floor_ms") for r in prs if r.get("floor_ms") is not None]
        floors_inplace = [r.get("floor_inplace_ms") for r in prs if r.get("floor_inplace_ms") is not None]
        res: dict[str, Any] = {
            "preset": preset,
            "config": next((r["config"] for r in prs if r.get("config")), None),
            "tokens_per_step": next((r["tokens_per_step"] for r in prs if r.get("tokens_per_step")), None),
            "floor_ms": _median(floors), "floor_ms_rounds": floors,
            "floor_inplace_ms": _median(floors_inplace),
        }
        # Eager against eager across rounds: what "equal to eager" can mean on this machine.
        eager_runs = list(eager_by_round.values())
        noise = [max_abs_diff(a["losses"], b["losses"])[0] for i, a in enumerate(eager_runs) for b in eager_runs[i + 1:]]
        res["eager_noise"] = max(noise) if noise else None
        variants: dict[str, dict] = {}
        names = [v for v in variant_order if any(r["variant"] == v for r in prs)]
        names += sorted({r["variant"] for r in prs} - set(names) - {"floor"})
        for name in names:
            vr = sorted((r for r in prs if r["variant"] == name), key=lambda r: r["round"])
            ok = [r for r in vr if r.get("ok") and r.get("ms_per_step") is not None]
            v: dict[str, Any] = {
                "rounds": len(vr), "ok_rounds": len(ok),
                "errors": sorted({r.get("error") or f"exit {r.get('rc')}" for r in vr if not r.get("ok")}),
                "ms_rounds": [r["ms_per_step"] for r in ok],
                "ms_per_step": _median(r["ms_per_step"] for r in ok),
                "peak_mem_gib": max((r["peak_mem_gib"] for r in ok if r.get("peak_mem_gib") is not None), default=None),
                "capture_s": _median(r.get("capture_s") for r in ok),
                "host_in_step_us": _median(r.get("host_in_step_us") for r in ok),
                "host_between_us": _median(r.get("host_between_us") for r in ok),
                "final_loss": next((r["losses"][-1] for r in reversed(ok) if r.get("losses")), None),
                "loss_aliased": any(r.get("loss_aliased") for r in ok),
                "stats": next((r["stats"] for r in reversed(ok) if r.get("stats")), None),
                "notes": sorted({n for r in vr for n in r.get("notes", [])}),
            }
            syncs = [r["syncs_in_sync_window"] / r["sync_window_steps"] for r in ok
                     if r.get("syncs_in_sync_window") is not None and r.get("sync_window_steps")]
            v["syncs_per_step"] = max(syncs) if syncs else None
            diffs, firsts = [], []
            for r in ok:
                ref = eager_by_round.get(r["round"], any_eager)
                if ref is None or r is ref:
                    continue
                d, f = max_abs_diff(r.get("losses"), ref["losses"])
                if d is not None:
                    diffs.append(d)
                    firsts.append(f)
            # Per round, and this variant against itself across rounds: a difference from eager that only some rounds
            # show is the run-to-run nondeterminism of a kernel, not a systematic change of training.
            v["dloss_rounds"] = diffs
            self_diffs = [max_abs_diff(a.get("losses"), b.get("losses"))[0] for i, a in enumerate(ok) for b in ok[i + 1:]]
            v["self_noise"] = max((d for d in self_diffs if d is not None), default=None)
            if name == EAGER:
                v["max_dloss"] = 0.0 if ok else None
                v["first_diff_step"] = None
            else:
                v["max_dloss"] = max(diffs) if diffs else None
                fs = [f for f in firsts if f is not None]
                v["first_diff_step"] = min(fs) if fs else None
            if v["max_dloss"] is not None:
                v["dloss_excess"] = v["max_dloss"] - (res["eager_noise"] or 0.0)
            variants[name] = v
        base = variants.get(EAGER, {}).get("ms_per_step")
        nemo = variants.get(NEMO, {}).get("ms_per_step")
        nemo_nolog = variants.get(NEMO + "_nolog", {}).get("ms_per_step")
        for name, v in variants.items():
            ms = v["ms_per_step"]
            if ms is None:
                continue
            v["speedup"] = base / ms if base else None
            v["floor_ratio"] = ms / res["floor_ms"] if res["floor_ms"] else None
            v["floor_inplace_ratio"] = ms / res["floor_inplace_ms"] if res["floor_inplace_ms"] else None
            # A module that does not log is compared with NeMo on the same module (NeMo's replays never log).
            ref = nemo_nolog if name.endswith("_nolog") else nemo
            v["vs_nemo"] = ms / ref if ref else None
            if res["tokens_per_step"]:
                v["tokens_per_s"] = res["tokens_per_step"] / (ms / 1e3)
        ours, noguard = variants.get(OURS, {}).get("ms_per_step"), variants.get("callback_noguard", {}).get("ms_per_step")
        res["nemo_over_ours"] = nemo / ours if nemo and ours else None
        # Ours / NeMo within each round (adjacent processes): a slow-host phase that hits one round hits both there.
        # Information next to the ratio of the medians, which the targets use.
        by_round = {n: {r["round"]: r["ms_per_step"] for r in prs if r["variant"] == n and r.get("ok")
                        and r.get("ms_per_step") is not None} for n in (OURS, NEMO)}
        res["ours_over_nemo_rounds"] = [by_round[OURS][k] / by_round[NEMO][k] for k in sorted(by_round[OURS])
                                        if k in by_round[NEMO]]
        res["guard_share"] = (ours - noguard) / ours if ours and noguard else None
        if OURS in variants:
            variants[OURS]["guard_share"] = res["guard_share"]
        res["variants"] = variants
        results.append(res)
    return results


def _f(x: Optional[float], fmt: str, none: str = "–") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, fmt)


def _dloss(v: dict) -> str:
    d = v.get("max_dloss")
    if d is None:
        return "–"
    return "0 (bitwise)" if d == 0 else f"{d:.3g}"


def describe_preset(res: dict) -> str:
    c = res.get("config") or {}
    if not c:
        return res["preset"]
    return (f"{res['preset']} ({c['n_layer']} layers, d {c['n_embd']}, seq {c['seq_len']}, batch {c['batch_size']}; "
            f"{res.get('tokens_per_step')} tokens/step)")


def markdown(results: list[dict], setup: dict, env: dict, descriptions: dict[str, str], target_rows: list[str]) -> str:
    """The results table (one section per preset), ms/step and max |Δloss| side by side."""
    lines = [f"# step_time — {env}", ""]
    if not setup.get("complete", True):
        lines += ["**INCOMPLETE**: written while the run was still going (or it was stopped).", ""]
    if setup.get("dry_run"):
        lines += ["**DRY RUN on CPU** (every variant trains eagerly; checks the harness, says nothing about speed).", ""]
    lines += [
             f"Setup: {setup['precision']}, optimizer {setup['optim']}, "
             f"gradient clipping {('by norm at ' + str(setup['clip'])) if setup.get('clip') else 'off'}, "
             f"{setup['steps']} steps, timed over steps "
             f"{setup['measure_from']}–{setup['steps'] - 1} (host sync at the window edges only), {_sync_window(setup)}, "
             f"{setup['rounds']} round(s) alternating the "
             f"variants, one process per variant and round, seed {setup['seed']}. ms/step: median over rounds. "
             "max |Δloss|: largest difference of any step's loss from Lightning eager's in the same round.", ""]
    for res in results:
        lines += [f"## {describe_preset(res)}", "",
                  "| variant | ms/step | rounds (ms) | speedup vs eager | / floor | / floor (zeroed in place) | vs NeMo | max \\|Δloss\\| vs eager | first Δ step "
                  "| host syncs/step | host µs in step / between | capture (s) | peak GiB | final loss |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, v in res["variants"].items():
            if v["ms_per_step"] is None:
                lines.append(f"| {name} | failed: {'; '.join(v['errors'])[:300]} |" + " |" * 12)
                continue
            speed = _f(v.get("speedup"), ".2f") + ("x" if v.get("speedup") else "")
            lines.append(
                f"| {name} | {v['ms_per_step']:.3f} | {', '.join(f'{x:.3f}' for x in v['ms_rounds'])} | {speed} | "
                f"{_f(v.get('floor_ratio'), '.3f')} | {_f(v.get('floor_inplace_ratio'), '.3f')} | {_f(v.get('vs_nemo'), '.3f')} | {_dloss(v)} | "
                f"{_f(v.get('first_diff_step'), 'd', '–')} | {_f(v.get('syncs_per_step'), '.2f')} | "
                f"{_f(v.get('host_in_step_us'), '.0f')} / {_f(v.get('host_between_us'), '.0f')} | "
                f"{_f(v.get('capture_s'), '.3f')} | {_f(v.get('peak_mem_gib'), '.2f')} | {_f(v.get('final_loss'), '.4f')} |")
        lines.append(f"| kernel floor (grads set to None) | {_f(res['floor_ms'], '.3f')} | "
                     f"{', '.join(f'{x:.3f}' for x in res['floor_ms_rounds'])} | | 1.000 | | " + " |" * 8)
        lines.append(f"| kernel floor (grads zeroed in place) | {_f(res['floor_inplace_ms'], '.3f')} | |"
                     f" | {_f(_div(res['floor_inplace_ms'], res['floor_ms']), '.3f')} | 1.000 |" + " |" * 8)
        lines += ["",
                  f"- NeMo / ours (`{NEMO}` ms ÷ `{OURS}` ms): {_f(res['nemo_over_ours'], '.3f')}; NaN guard cost "
                  f"(`{OURS}` − `callback_noguard`) / `{OURS}`: {_f(_pct(res['guard_share']), '.2f')} %",
                  f"- eager against eager (across rounds) max |Δloss|: {_f(res['eager_noise'], '.3g', 'one round only')}",
                  *([f"- ours / NeMo within each round (`{OURS}` ÷ `{NEMO}`, adjacent processes): "
                     f"{', '.join(f'{x:.3f}' for x in res['ours_over_nemo_rounds'])}; median "
                     f"{_median(res['ours_over_nemo_rounds']):.3f} (information; the targets use the medians' ratio)"]
                    if res.get("ours_over_nemo_rounds") else []),
                  ""]
        for name, v in res["variants"].items():
            if name != EAGER and len(v.get("dloss_rounds") or []) > 1:
                lines.append(f"- {name}: max |Δloss| vs eager by round: {', '.join(_f(d, '.3g') for d in v['dloss_rounds'])}; "
                             f"against itself across rounds: {_f(v.get('self_noise'), '.3g')}")
            if v.get("loss_aliased"):
                lines.append(f"- {name}: the loss Lightning returned aliased an earlier step's tensor (copied per step)")
            for n in v["notes"]:
                lines.append(f"- {name}: {n}")
        lines.append("")
    lines += ["## Targets (measured, not asserted)", "", *target_rows, "", "## Variants", ""]
    lines += [f"- `{k}`: {d}" for k, d in descriptions.items()]
    lines += ["- kernel floor: summed device time of the kernels (and copies/memsets) of one eager step with the "
              "same model, precision and optimizer (capturable), gradients set to None each step (no memset, backward "
              "writes fresh gradients); 'zeroed in place': the same step with `zero_grad(set_to_none=False)`, i.e. "
              "plus the memsets and the accumulating adds that in-place zeroing costs",
              "- host syncs/step: `torch.cuda.set_sync_debug_mode('warn')` warnings counted over the sync window "
              "(after every capture, before the timed window; no NaN check of the callback falls in it)",
              "- host µs in step / between: median wall time from on_train_batch_start to on_train_batch_end, and "
              "from there to the next step's start, in the timed window (no sync; includes any wait on the device)"]
    return "\n".join(lines) + "\n"


def _sync_window(setup: dict) -> str:
    if setup["sync_from"] < 0:
        return "host syncs not counted"
    return f"host syncs counted over steps {setup['sync_from']}–{setup['measure_from'] - 1}"


def _div(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _pct(x: Optional[float]) -> Optional[float]:
    return None if x is None else 100 * x


def targets(results: list[dict], table: dict[str, tuple]) -> list[str]:
    """``table``: label -> (preset, variant, key, op, want); each reported MET / MISSED / not measured."""
    by = {r["preset"]: r for r in results}
    rows = []
    for label, (preset, variant, key, op, want) in table.items():
        v = by.get(preset, {}).get("variants", {}).get(variant, {})
        got = v.get(key)
        if got is None or (isinstance(got, float) and math.isnan(got)):
            rows.append(f"- {label}: not measured")
            continue
        ok = {"<=": got <= want, ">=": got >= want, "<": got < want, "==": got == want}[op]
        rows.append(f"- {label}: {got:.4g} (target {op} {want}) -> {'MET' if ok else 'MISSED'}")
    return rows


def short_table(results: list[dict], dry_run: bool = False) -> str:
    """The few lines printed last: ms/step and max |Δloss| per variant."""
    out = ["DRY RUN on CPU: every variant trained eagerly; no speed claims"] if dry_run else []
    for res in results:
        out.append(f"{res['preset']}: floor {_f(res['floor_ms'], '.3f')} ms, eager-vs-eager "
                   f"{_f(res['eager_noise'], '.3g', 'n/a')}, NeMo/ours {_f(res['nemo_over_ours'], '.3f')}, "
                   f"guard {_f(_pct(res['guard_share']), '.2f')} %")
        for name, v in res["variants"].items():
            if v["ms_per_step"] is None:
                out.append(f"  {name:26s} failed: {'; '.join(v['errors'])[:150]}")
                continue
            out.append(f"  {name:26s} {v['ms_per_step']:8.3f} ms  x{_f(v.get('floor_ratio'), '.3f')} floor  "
                       f"|dloss| {_dloss(v):>12s}  syncs/step {_f(v.get('syncs_per_step'), '.2f')}")
    return "\n".join(out)


def plot(results: list[dict], path: Path) -> Optional[str]:
    """Bars of ms/step (log scale) with max |Δloss| written next to each; returns why not, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no PNG"
    if not results:
        return "no results: no PNG"
    fig, axes = plt.subplots(1, len(results), figsize=(7.5 * len(results), 0.45 * max(
        len(r["variants"]) for r in results) + 2), squeeze=False)
    for ax, r in zip(axes[0], results):
        names = [n for n, v in r["variants"].items() if v["ms_per_step"] is not None]
        vals = [r["variants"][n]["ms_per_step"] for n in names]

        def color(n: str) -> str:
            if n == EAGER:
                return "#888888"
            if n.startswith("nemo"):
                return "#e08a2c"
            if n.startswith(("callback", "strategy", "compile_plus")):
                return "#3a9a5b"
            return "#4a78b8"

        ax.barh(names, vals, color=[color(n) for n in names])
        ax.invert_yaxis()
        ax.set_xscale("log")
        noise = r.get("eager_noise") or 0.0
        for i, n in enumerate(names):
            v = r["variants"][n]
            d = v.get("max_dloss")
            bad = d is not None and d > max(10 * noise, 1e-3)
            ax.text(vals[i] * 1.03, i, f"{vals[i]:.3f} ms  |Δloss| {_dloss(v)}", va="center", fontsize=7,
                    color="#c0392b" if bad else "black")
        if r.get("floor_ms"):
            ax.axvline(r["floor_ms"], color="r", ls="--", lw=1, label=f"kernel floor {r['floor_ms']:.3f} ms")
            ax.legend(loc="lower right", fontsize=7)
        ax.set_xlim(min(vals + [r.get("floor_ms") or min(vals)]) * 0.8, max(vals) * 4)
        ax.set_title(f"{describe_preset(r)}\nms/step (log scale; red text: loss differs from eager)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------------------- kernel profiles

_CATEGORIES = (
    ("memset", ("memset",)),
    ("memcpy", ("memcpy",)),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("optimizer", ("adam", "fused_sgd")),
    ("foreach / multi-tensor", ("foreach", "multi_tensor", "multitensor")),
    ("reduction / norm", ("reduce", "norm", "softmax", "layer_norm", "cross_entropy", "nll")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    for cat, keys in _CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "elementwise / other"


def _per_step(prof: dict) -> dict[str, tuple[float, float]]:
    n = prof["steps"]
    return {k["name"]: (k["count"] / n, k["total_us"] / n) for k in prof["kernels"]}


def _gaps_line(prof: dict) -> Optional[str]:
    """Device span per step split into busy time and idle gaps (``device_gaps``); None for a profile without it."""
    keys = ("span_us_per_step", "busy_us_per_step", "small_gaps_us_per_step", "small_gaps_per_step",
            "large_gaps_us_per_step", "large_gaps_per_step")
    if any(prof.get(k) is None for k in keys):
        return None
    span, busy, su, sn, lu, ln = (prof[k] for k in keys)
    return (f"   device span {span:.1f} µs/step: busy {busy:.1f}, small gaps {su:.1f} ({sn:.1f} gaps), "
            f"large gaps {lu:.1f} ({ln:.1f} gaps)")


def profile_text(profiles: list[dict], top: int = 30) -> str:
    """Per-kernel summaries (per step) of each profiled run, categories, and the diff of the first two runs
    of each preset (e.g. ``callback`` against ``nemo_callback``)."""
    out: list[str] = []
    by_preset: dict[str, list[dict]] = defaultdict(list)
    for p in profiles:
        by_preset[p["preset"]].append(p)
    for preset, ps in by_preset.items():
        for p in ps:
            if p.get("host_profile") and not p.get("profile"):  # a --host-profile run: the host only
                st = p.get("setup", {})
                first = st.get("profile_from", 0)
                out.append(f"== {preset} / {p['variant']}: host (cProfile), steps {first}–{first + st.get('profile_steps', 0) - 1},"
                           " whole loop iterations, per step")
                out.append(f"   {'calls':>7s} {'own µs':>9s} {'incl µs':>9s}  function")
                for r in p["host_profile"]:
                    out.append(f"   {r['calls']:7.1f} {r['own_us']:9.1f} {r['incl_us']:9.1f}  {r['fn'][:110]}")
                out.append("")
                continue
            if not p.get("profile"):
                out.append(f"== {preset} / {p['variant']}: no profile ({p.get('error')})\n")
                continue
            prof = p["profile"]
            per = _per_step(prof)
            if prof["activity"] == "CUDA" and sum(k["count"] for k in prof["kernels"]) < 5 * prof["steps"]:
                out.append(f"   (only {sum(k['count'] for k in prof['kernels'])} CUDA events: this profiler may not trace the "
                           "kernels inside graph replays one by one)")
            out.append(f"== {preset} / {p['variant']}: steps {prof['first_step']}–{prof['first_step'] + prof['steps'] - 1}, "
                       f"{prof['activity']} time {prof['device_us_per_step']:.1f} µs/step, "
                       f"{sum(c for c, _ in per.values()):.1f} kernels/step, wall {prof['wall_ms_per_step']:.3f} ms/step")
            gaps = _gaps_line(prof)
            if gaps:
                out.append(gaps)
            if prof.get("gap_pairs"):
                out.append(f"   gaps over {prof['gap_detail_from_us']:.0f} µs by the events around them: "
                           f"{'n/step':>6s} {'µs/step':>8s} {'mean µs':>8s}  before -> after")
                for g in prof["gap_pairs"]:
                    out.append(f"   {'':44s} {g['per_step']:6.2f} {g['us_per_step']:8.1f} {g['mean_us']:8.1f}  "
                               f"{g['before'][:50]} -> {g['after'][:50]}")
            cats: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
            for name, (c, us) in per.items():
                cats[kernel_category(name)][0] += c
                cats[kernel_category(name)][1] += us
            for cat, (c, us) in sorted(cats.items(), key=lambda kv: -kv[1][1]):
                out.append(f"   {cat:24s} {c:8.1f} /step {us:10.1f} µs/step")
            out.append(f"   {'count/step':>10s} {'µs/step':>10s}  kernel")
            for name, (c, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
                out.append(f"   {c:10.1f} {us:10.1f}  {name[:110]}")
            if p.get("host_profile"):
                out.append(f"   host (cProfile, per step): {'calls':>7s} {'own µs':>9s} {'incl µs':>9s}  function")
                for r in p["host_profile"]:
                    out.append(f"   {'':26s} {r['calls']:7.1f} {r['own_us']:9.1f} {r['incl_us']:9.1f}  {r['fn'][:100]}")
            out.append("")
        ok = [p for p in ps if p.get("profile")]
        if len(ok) >= 2:
            a, b = ok[0], ok[1]
            pa, pb = _per_step(a["profile"]), _per_step(b["profile"])
            out.append(f"== {preset}: {a['variant']} (A) against {b['variant']} (B), per step; sorted by |µs A − µs B|")
            out.append(f"   total µs/step A {a['profile']['device_us_per_step']:.1f}  B {b['profile']['device_us_per_step']:.1f}  "
                       f"kernels/step A {sum(c for c, _ in pa.values()):.1f}  B {sum(c for c, _ in pb.values()):.1f}")
            ga, gb = a["profile"], b["profile"]
            if any(g.get("span_us_per_step") is not None for g in (ga, gb)):
                out.append("   device µs/step  " + "  ".join(
                    f"{label} A {_f(ga.get(k), '.1f')}  B {_f(gb.get(k), '.1f')}"
                    for label, k in (("span", "span_us_per_step"), ("busy", "busy_us_per_step"),
                                     ("small gaps", "small_gaps_us_per_step"),
                                     ("large gaps", "large_gaps_us_per_step"))))
            out.append(f"   {'cnt A':>7s} {'cnt B':>7s} {'µs A':>9s} {'µs B':>9s} {'A−B':>9s}  kernel")
            rows = []
            for name in set(pa) | set(pb):
                ca, ua = pa.get(name, (0.0, 0.0))
                cb, ub = pb.get(name, (0.0, 0.0))
                rows.append((ua - ub, ca, cb, ua, ub, name))
            for d, ca, cb, ua, ub, name in sorted(rows, key=lambda r: -abs(r[0]))[:top + 10]:
                if abs(d) < 1e-9 and ca == cb:
                    continue
                out.append(f"   {ca:7.1f} {cb:7.1f} {ua:9.1f} {ub:9.1f} {d:+9.1f}  {name[:100]}")
            out.append("")
    return "\n".join(out) + "\n"
