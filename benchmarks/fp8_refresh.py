"""FP8 transpose refresh with real TransformerEngine on one GPU: the stale-transpose reproduction.

What it measures that the harness cannot: TransformerEngine's FP8 weights read through a stale transpose inside a
graph, against eager and BF16 references (the harness trains no FP8 model).

The stale-transpose reproduction, docs/results/fp8.md result 1 (run on a Hopper GPU with TE >= 2.x installed)::

    python -m benchmarks.fp8_refresh --out fp8_refresh.json

* ``repro``: a ``te.Linear`` with FP8 primary weights, forward+backward captured in a
  ``torch.cuda.graph`` while the transpose cache is valid. New FP8 bytes are then written into the
  weight in place (plus ``_reset_caches()``), as a distributed optimizer does. Input-gradient
  relative error of the replay against eager TE: without refresh (stale) and after
  ``refresh_fp8_transposes`` (same ``_transpose`` address).
* ``te_fused_adam`` (information): whether TE's own ``FusedAdam(master_weights=True)`` leaves
  stale transposes after a step on delayed-scaling FP8 parameters, and whether the refresh fixes them.

Also home of the benchmarks' :class:`MasterWeightAdamW` (the product's, with a ``mark_stale=False`` arm), which
``python -m benchmarks.fp8_lightning`` (training parity and refresh overhead under the Lightning engine: results 2 and
3) and ``benchmarks.fp8_scale`` train with.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

# Before TE/cuBLAS initialise: deterministic attention backward and cuBLAS, so eager and graphed
# runs can be compared closely.
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

from nemo_cudagraph_plugin.fp8 import MasterWeightAdamW as _MasterWeightAdamW  # noqa: E402
from nemo_cudagraph_plugin.fp8 import _te_compat as te_compat  # noqa: E402
from nemo_cudagraph_plugin.fp8 import (  # noqa: E402
    refresh_fp8_transposes,
    verify_fp8_transposes,
)

# Stated tolerances (the GPU tests assert them).
REPRO_STALE_MIN = 0.5  # stale replay vs eager: independent new weights give ~sqrt(2)
REPRO_FRESH_MAX = {"current": 1e-3, "delayed": 2e-2}


# --------------------------------------------------------------------------------------------
# TransformerEngine access (public API, with fallbacks for older 2.x names)
# --------------------------------------------------------------------------------------------


def import_te() -> tuple[Any, Any, Any]:
    """``(transformer_engine.pytorch, transformer_engine.common.recipe, transformer_engine_torch)``."""
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    from transformer_engine.common import recipe

    return te, recipe, tex


def make_recipe(name: str) -> Any:
    _, recipe, _ = import_te()
    if name == "current":
        return recipe.Float8CurrentScaling()
    if name == "delayed":
        return recipe.DelayedScaling()
    raise ValueError(f"recipe {name!r}: use 'current' or 'delayed'")


def autocast(rec: Any) -> Any:
    te, _, _ = import_te()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=rec)
    return te.fp8_autocast(enabled=True, fp8_recipe=rec)


def quantized_init(rec: Any) -> Any:
    te, _, _ = import_te()
    if hasattr(te, "quantized_model_init"):
        return te.quantized_model_init(enabled=True, recipe=rec, preserve_high_precision_init_val=True)
    return te.fp8_model_init(enabled=True, recipe=rec, preserve_high_precision_init_val=True)


def fp8_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        te, _, _ = import_te()
    except Exception as exc:  # ImportError, or a broken build
        return False, f"transformer_engine.pytorch does not import: {type(exc).__name__}: {exc}"
    ok = te.is_fp8_available(return_reason=True)
    return (bool(ok[0]), str(ok[1])) if isinstance(ok, tuple) else (bool(ok), "")


def env_info() -> dict[str, Any]:
    te, _, _ = import_te()
    import transformer_engine

    return {
        "gpu": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformer_engine": getattr(transformer_engine, "__version__", "?"),
        "python": sys.version.split()[0],
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


def transposes_cached(params: list[torch.Tensor]) -> bool:
    """True when TE keeps transposes at all (False on GPUs with non-TN FP8 GEMMs, e.g. Blackwell)."""
    return any(te_compat.transpose_buffer(p) is not None for p in params)


# --------------------------------------------------------------------------------------------
# The optimizer that writes FP8 bytes in place
# --------------------------------------------------------------------------------------------


def write_fp8_in_place(param: torch.Tensor, master: torch.Tensor, *, mark_stale: bool = True) -> None:
    """Write ``master`` into FP8 parameter ``param`` as :class:`MasterWeightAdamW` does (per-tensor current scaling,
    bytes and ``scale_inv`` in place, device ops only). ``mark_stale=False`` skips ``_reset_caches()``: the bytes
    only, as a distributed optimizer's all-gather into its parameter buffer writes them, so nothing tells TE the
    transpose is stale; the refresh must fix it."""
    te_compat.write_per_tensor_fp8(param, master, te_compat.fp8_element_format(param), reset=mark_stale)


class MasterWeightAdamW(_MasterWeightAdamW):
    """The product's :class:`~nemo_cudagraph_plugin.fp8.MasterWeightAdamW` with the benchmarks' settings (betas
    0.9/0.95, no weight decay by default), and ``mark_stale=False`` for the arm whose writes skip
    ``_reset_caches()``."""

    def __init__(
        self, params: list[torch.nn.Parameter], lr: float, weight_decay: float = 0.0, *, mark_stale: bool = True
    ) -> None:
        super().__init__(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
        self.mark_stale = mark_stale

    def _write_fp8(self, p: torch.Tensor, m: torch.Tensor, fmt: Any) -> None:
        te_compat.write_per_tensor_fp8(p, m, fmt, reset=self.mark_stale)


# --------------------------------------------------------------------------------------------
# 1. Stale-transpose reproduction with one te.Linear
# --------------------------------------------------------------------------------------------


def stale_transpose_repro(
    recipe_name: str = "current", n: int = 1024, tokens: int = 512, seed: int = 7
) -> dict:
    """Graph a te.Linear fwd+bwd, write new FP8 weight bytes in place, replay before/after refresh."""
    te, _, _ = import_te()
    torch.manual_seed(seed)
    rec = make_recipe(recipe_name)
    with quantized_init(rec):
        layer = te.Linear(n, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    w = layer.weight
    if not te_compat.is_fp8_tensor(w) or te_compat.transpose_buffer(w) is None:
        raise RuntimeError("te.Linear weight has no cached FP8 transpose here (non-TN FP8 GEMM GPU?)")
    x = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gout = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd() -> torch.Tensor:
        with autocast(rec):
            y = layer(x)
        (dx,) = torch.autograd.grad(y, (x,), gout)
        return dx

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fwd_bwd()
    torch.cuda.current_stream().wait_stream(side)
    flag_clear_at_capture = not te_compat.transpose_flagged_invalid(w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dx_static = fwd_bwd()
    ptr0 = te_compat.transpose_buffer(w).data_ptr()

    with torch.no_grad():
        w_old = w.dequantize(dtype=torch.float32)
        master = 0.02 * torch.randn(n, n, device="cuda")  # independent new weights, init-like scale
        write_fp8_in_place(w, master)
        w_new = w.dequantize(dtype=torch.float32)
    ptr_after_write = te_compat.transpose_buffer(w).data_ptr()
    verify_before = verify_fp8_transposes(layer)

    graph.replay()
    dx_stale = dx_static.detach().clone()
    n_refreshed = refresh_fp8_transposes(layer)
    ptr_after_refresh = te_compat.transpose_buffer(w).data_ptr()
    verify_after = verify_fp8_transposes(layer)
    graph.replay()
    dx_fresh = dx_static.detach().clone()

    # Eager reference, with TE rebuilding the transpose itself (no more replays after this).
    te_compat.reset_caches(w)
    dx_eager = fwd_bwd().detach().clone()
    torch.cuda.synchronize()
    g32 = gout.float()
    return {
        "recipe": recipe_name,
        "shape": [tokens, n, n],
        "flag_clear_at_capture": flag_clear_at_capture,
        "rel_err_stale": rel(dx_stale, dx_eager),
        "rel_err_refreshed": rel(dx_fresh, dx_eager),
        "rel_err_eager_vs_bf16_new_weight": rel(dx_eager, g32 @ w_new),
        "rel_err_stale_vs_bf16_old_weight": rel(dx_stale, g32 @ w_old),
        "transpose_address_same": ptr0 == ptr_after_write == ptr_after_refresh,
        "stale_before_refresh": len(verify_before.stale),
        "stale_after_refresh": len(verify_after.stale),
        "refreshed": n_refreshed,
    }


# --------------------------------------------------------------------------------------------
# Information: TE's own FusedAdam with FP8 parameters
# --------------------------------------------------------------------------------------------


def te_fused_adam_check(n: int = 512, seed: int = 3) -> dict:
    """Does ``te.optimizers.FusedAdam(master_weights=True)`` leave FP8 transposes stale after a step?"""
    te, _, _ = import_te()
    torch.manual_seed(seed)
    rec = make_recipe("delayed")
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam

        with quantized_init(rec):
            layer = te.Linear(n, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
        opt = FusedAdam(layer.parameters(), lr=1e-2, master_weights=True)
        x = torch.randn(256, n, device="cuda", dtype=torch.bfloat16)
        with autocast(rec):
            layer(x).float().pow(2).mean().backward()
        opt.step()
        torch.cuda.synchronize()
        before = verify_fp8_transposes(layer)
        flagged = bool(before.flagged)
        refreshed = refresh_fp8_transposes(layer)
        after = verify_fp8_transposes(layer)
        return {
            "stale_after_step": len(before.stale),
            "stale_flagged_invalid": flagged,
            "refreshed": refreshed,
            "stale_after_refresh": len(after.stale),
        }
    except Exception as exc:  # information only
        return {"error": f"{type(exc).__name__}: {exc}"}


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _table(results: dict) -> str:
    lines = [""]
    if results.get("repro"):
        lines.append("== 1. stale-transpose reproduction (te.Linear, graphed fwd+bwd) ==")
        lines.append(
            f"{'recipe':<8} {'rel err stale':>14} {'rel err refreshed':>18} {'same address':>13} {'stale->after':>13}"
        )
    for r in results.get("repro", {}).values():
        if "error" in r:
            lines.append(f"{r.get('recipe', '?'):<8} ERROR {r['error']}")
            continue
        lines.append(
            f"{r['recipe']:<8} {r['rel_err_stale']:>14.4f} {r['rel_err_refreshed']:>18.3e} "
            f"{str(r['transpose_address_same']):>13} {r['stale_before_refresh']:>6}->{r['stale_after_refresh']:<6}"
        )
    fa = results.get("te_fused_adam")
    if fa:
        lines.append(f"\n== info: te.optimizers.FusedAdam(master_weights=True), delayed scaling: {fa}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON to this file")
    p.add_argument("--skip", nargs="*", default=[], choices=["repro", "fused_adam"])
    args = p.parse_args(argv)
    ok, why = fp8_available()
    if not ok:
        print(f"FP8 not available: {why}")
        return 2
    results: dict[str, Any] = {"env": env_info()}
    if "repro" not in args.skip:
        results["repro"] = {name: stale_transpose_repro(name) for name in ("current", "delayed")}
    if "fused_adam" not in args.skip:
        results["te_fused_adam"] = te_fused_adam_check()
    print(json.dumps(results["env"]))
    print(_table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
