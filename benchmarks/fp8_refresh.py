"""FP8 transpose refresh with real TransformerEngine on one GPU: staleness, training parity, overhead.

Evidence for issue 4 (run on a Hopper GPU with TE >= 2.x installed)::

    python3 benchmarks/fp8_refresh.py --out docs/gpu-evidence/fp8_refresh.json

Three measurements (the GPU tests in ``tests/gpu/test_fp8_te.py`` call the same functions and assert):

1. ``repro``: a ``te.Linear`` with FP8 primary weights, forward+backward captured in a
   ``torch.cuda.graph`` while the transpose cache is valid. New FP8 bytes are then written into the
   weight in place (plus ``_reset_caches()``), as a distributed optimizer does. Input-gradient
   relative error of the replay against eager TE: without refresh (stale) and after
   ``refresh_fp8_transposes`` (same ``_transpose`` address).
2. ``training``: a small GPT of ``te.TransformerLayer`` (FP8 primary weights, current scaling),
   ``steps`` steps of a learnable task with an FP32-master AdamW that writes the new FP8 bytes into
   the parameters in place inside ``optimizer.step()``. Variants:

   - ``eager``: no graph, no refresh (TE rebuilds stale transposes itself): the reference.
   - ``graphed+refresh``: whole-step ``torch.cuda.graph`` with ``install_fp8_refresh``.
   - ``graphed-no-refresh``: the same graph without the refresh.
   - ``graphed-no-refresh-stale-flags``: (information) captured right after an optimizer step,
     with TE's stale flags still set, so TE's own rebuild in the forward is captured.

   In the first three an eager forward+backward (a "probe", as a parity or sanity check does)
   runs between the last warm-up step and the capture, so the capture starts with clean caches:
   the situation of the measured bug. Reported: per-step loss, max relative loss deviation from
   eager (``|dl| / max(l_eager, 0.5)``), relative parameter deviation ``||W - W_eager|| / ||W_eager - W_init||`` over the FP8
   weights, and how many transposes ``verify_fp8_transposes`` finds stale at the end.
3. ``overhead``: median replay time of the whole-step graph with and without the refresh (larger
   model), and the replay time of a graph holding only the refresh kernels.

Plus ``te_fused_adam`` (information): whether TE's own ``FusedAdam(master_weights=True)`` leaves
stale transposes after a step on delayed-scaling FP8 parameters, and whether the refresh fixes them.

"graphed" here is a plain whole-step ``torch.cuda.graph`` written in this file (warm-up steps on a
side stream, ``zero_grad(set_to_none=False)``, capturable AdamW), independent of the Lightning engine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

# Before TE/cuBLAS initialise: deterministic attention backward and cuBLAS, so eager and graphed
# runs can be compared closely.
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_cudagraph_plugin.fp8 import (  # noqa: E402
    Fp8RefreshPlan,
    install_fp8_refresh,
    iter_fp8_params,
    refresh_fp8_transposes,
    verify_fp8_transposes,
)
from nemo_cudagraph_plugin.fp8 import _te_compat as te_compat  # noqa: E402

# Stated tolerances (the GPU tests assert them).
REPRO_STALE_MIN = 0.5  # stale replay vs eager: independent new weights give ~sqrt(2)
REPRO_FRESH_MAX = {"current": 1e-3, "delayed": 2e-2}
TRAIN_LOSS_DEV_MAX = 2e-2  # graphed+refresh vs eager, max over all steps of |dl| / max(l_eager, LOSS_FLOOR)
LOSS_FLOOR = 0.5  # nats: keeps the relative loss deviation meaningful once the loss is near 0
TRAIN_PARAM_DEV_MAX = 5e-2  # graphed+refresh vs eager, ||W - W_e|| / ||W_e - W_0||
NO_REFRESH_PARAM_DEV_MIN = 0.25  # graphed without refresh must be at least this far off
OVERHEAD_MAX_PCT = 1.0


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


def write_fp8_in_place(param: torch.Tensor, master: torch.Tensor, quantizer: Any = None) -> None:
    """Write ``master`` into FP8 parameter ``param`` the way a distributed optimizer does.

    Marks the caches stale (``_reset_caches()``, as TE's ``quantize_master_weights`` does) and then
    writes only the row-wise FP8 bytes and ``scale_inv`` in place, with device ops (current
    scaling: scale = 448 / amax(master)). The transpose is left stale, which is what the refresh
    must fix. (Measured on TE 2.20.2: quantizing through a TE quantizer object *inside* a CUDA graph
    capture records a host-memory copy that crashes on replay, so the write is done with torch ops.)
    """
    te_compat.reset_caches(param)
    data = te_compat.rowwise_data(param)
    scale = 448.0 / master.detach().abs().amax().float().clamp_min(1e-12)
    q = (master.detach().float() * scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    data.copy_(q.view(torch.uint8).view(data.shape))
    param._scale_inv.copy_(scale.reciprocal().reshape(param._scale_inv.shape))  # TE 2.x Float8Tensor field


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW on FP32 master copies whose ``step()`` writes the parameters back in place.

    FP8 parameters get new FP8 bytes via :func:`write_fp8_in_place`; others a plain ``copy_``.
    The inner AdamW is ``capturable`` so the whole step can be captured into a CUDA graph.
    """

    def __init__(self, params: list[torch.nn.Parameter], lr: float, weight_decay: float = 0.0) -> None:
        te, _, tex = import_te()
        super().__init__(params, {"lr": lr})
        self.model_params = [p for g in self.param_groups for p in g["params"]]
        self.masters: list[torch.Tensor] = []
        with torch.no_grad():
            for p in self.model_params:
                hp = getattr(p, "get_high_precision_init_val", None)
                init = hp() if callable(hp) else None
                if init is None:
                    init = p.dequantize(dtype=torch.float32) if te_compat.is_fp8_tensor(p) else p
                m = init.detach().to(device=p.device, dtype=torch.float32).clone()
                m.grad = torch.zeros_like(m)
                self.masters.append(m)
                clear = getattr(p, "clear_high_precision_init_val", None)
                if callable(clear):
                    clear()
        self.is_fp8 = [te_compat.is_fp8_tensor(p) for p in self.model_params]
        self.inner = torch.optim.AdamW(
            self.masters, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, capturable=True, foreach=True
        )
        self.quantizer = te.Float8CurrentScalingQuantizer(
            tex.DType.kFloat8E4M3, device=self.model_params[0].device, rowwise=True, columnwise=False
        )

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        for p, m in zip(self.model_params, self.masters):
            if p.grad is not None:
                m.grad.copy_(p.grad)
        self.inner.step()
        for p, m, fp8 in zip(self.model_params, self.masters, self.is_fp8):
            if fp8:
                write_fp8_in_place(p, m, self.quantizer)
            else:
                p.copy_(m)
        return None


# --------------------------------------------------------------------------------------------
# Model and data
# --------------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    vocab: int = 128
    hidden: int = 256
    ffn: int = 1024
    heads: int = 8
    layers: int = 4
    seq: int = 64
    batch: int = 32
    lr: float = 2e-3
    recipe: str = "current"


SMALL = GPTConfig()
OVERHEAD = GPTConfig(vocab=32000, hidden=2048, ffn=8192, heads=16, layers=4, seq=2048, batch=8, lr=1e-4)


class TinyGPT(torch.nn.Module):
    """Embedding + ``te.TransformerLayer`` stack (FP8 primary weights) + LM head."""

    def __init__(self, cfg: GPTConfig, rec: Any) -> None:
        te, _, _ = import_te()
        super().__init__()
        dt = torch.bfloat16
        self.cfg = cfg
        self.emb = torch.nn.Embedding(cfg.vocab, cfg.hidden, device="cuda", dtype=dt)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(cfg.seq, cfg.hidden, device="cuda", dtype=dt))
        with quantized_init(rec):
            self.layers = torch.nn.ModuleList(
                te.TransformerLayer(
                    cfg.hidden,
                    cfg.ffn,
                    cfg.heads,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                    self_attn_mask_type="causal",
                    fuse_qkv_params=True,  # TE 2.20 cannot split one FP8 (quantized) weight into q/k/v params
                    layer_number=i + 1,
                    params_dtype=dt,
                    device="cuda",
                )
                for i in range(cfg.layers)
            )
        self.norm = torch.nn.LayerNorm(cfg.hidden, device="cuda", dtype=dt)
        self.head = torch.nn.Linear(cfg.hidden, cfg.vocab, bias=False, device="cuda", dtype=dt)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = (self.emb(tokens) + self.pos).transpose(0, 1).contiguous()  # [s, b, h] ("sbhd")
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)).float()  # [s, b, vocab]


def make_batches(cfg: GPTConfig, steps: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets; target = previous token (needs attention to learn)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randint(0, cfg.vocab, (steps, cfg.batch, cfg.seq), device="cuda", generator=g)
    y = torch.roll(x, shifts=1, dims=2)
    y[:, :, 0] = 0
    return x, y


class Trainer:
    """Everything one training variant needs: model, optimizer, static inputs, the step."""

    def __init__(self, cfg: GPTConfig, seed: int, refresh: bool) -> None:
        torch.manual_seed(seed)
        self.cfg = cfg
        self.recipe = make_recipe(cfg.recipe)
        self.model = TinyGPT(cfg, self.recipe)
        self.fp8 = list(iter_fp8_params(self.model))
        self.opt = MasterWeightAdamW(list(self.model.parameters()), lr=cfg.lr)
        self.handle = install_fp8_refresh(self.opt, self.model) if refresh else None
        self.x = torch.zeros(cfg.batch, cfg.seq, dtype=torch.long, device="cuda")
        self.y = torch.zeros_like(self.x)
        self.loss = torch.zeros((), device="cuda")
        with torch.no_grad():
            self.w0 = [p.dequantize(dtype=torch.float32).clone() for p in self.fp8]

    def load(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x.copy_(x)
        self.y.copy_(y)

    def forward_backward(self) -> torch.Tensor:
        with autocast(self.recipe):
            logits = self.model(self.x)
        loss = F.cross_entropy(logits.reshape(-1, self.cfg.vocab), self.y.t().reshape(-1))
        loss.backward()
        return loss

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        loss = self.forward_backward()
        self.opt.step()
        self.loss.copy_(loss.detach())

    def probe(self) -> None:
        """Eager forward+backward without an optimizer step (a parity/sanity check does this)."""
        self.forward_backward()

    def fp8_weights(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return [p.dequantize(dtype=torch.float32).clone() for p in self.fp8]


def run_training(
    variant: str, cfg: GPTConfig = SMALL, steps: int = 200, warmup: int = 3, seed: int = 1234
) -> dict:
    """One training run; see the module docstring for the variants."""
    graphed = variant.startswith("graphed")
    refresh = variant == "graphed+refresh"
    probe = variant != "graphed-no-refresh-stale-flags"
    t = Trainer(cfg, seed, refresh)
    if not transposes_cached(t.fp8):
        raise RuntimeError("this GPU keeps no FP8 transposes (non-TN FP8 GEMMs): nothing to measure")
    xs, ys = make_batches(cfg, steps, seed + 1)
    losses = torch.zeros(steps, device="cuda")
    if not graphed:
        for i in range(steps):
            if i == warmup and probe:
                t.load(xs[i], ys[i])
                t.probe()
            t.load(xs[i], ys[i])
            t.step()
            losses[i].copy_(t.loss)
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(warmup):
                t.load(xs[i], ys[i])
                t.step()
                losses[i].copy_(t.loss)
        torch.cuda.current_stream().wait_stream(side)
        t.load(xs[warmup], ys[warmup])
        if probe:
            t.probe()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            t.step()
        for i in range(warmup, steps):
            t.load(xs[i], ys[i])
            graph.replay()
            losses[i].copy_(t.loss)
    torch.cuda.synchronize()
    report = verify_fp8_transposes(t.model)
    return {
        "variant": variant,
        "losses": losses.tolist(),
        "weights": t.fp8_weights(),
        "w0": t.w0,
        "stale_after": len(report.stale),
        "flagged_after": len(report.flagged),
        "fp8_params": len(t.fp8),
        "refresh_hook_calls": t.handle.calls if t.handle else 0,
    }


def param_dev(run: dict, ref: dict) -> float:
    num = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(run["weights"], ref["weights"]))
    den = sum(float((b.double() - w.double()).pow(2).sum()) for b, w in zip(ref["weights"], ref["w0"]))
    return math.sqrt(num / max(den, 1e-30))


def loss_dev(run: dict, ref: dict) -> float:
    return max(abs(a - b) / max(abs(b), LOSS_FLOOR) for a, b in zip(run["losses"], ref["losses"]))


TRAIN_VARIANTS = ("eager", "graphed+refresh", "graphed-no-refresh", "graphed-no-refresh-stale-flags")


def train_comparison(
    cfg: GPTConfig = SMALL, steps: int = 200, variants: tuple[str, ...] = TRAIN_VARIANTS
) -> dict:
    """Run the variants and compare each with eager."""
    runs = {v: run_training(v, cfg, steps) for v in variants}
    ref = runs["eager"]
    out: dict[str, Any] = {"config": asdict(cfg), "steps": steps, "runs": {}}
    for v, r in runs.items():
        losses = r["losses"]
        out["runs"][v] = {
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "loss_at": {
                str(i): losses[i] for i in sorted({0, steps // 4, steps // 2, 3 * steps // 4, steps - 1})
            },
            "loss_dev_max": 0.0 if v == "eager" else loss_dev(r, ref),
            "param_dev": 0.0 if v == "eager" else param_dev(r, ref),
            "stale_after": r["stale_after"],
            "flagged_after": r["flagged_after"],
            "refresh_hook_calls": r["refresh_hook_calls"],
            "fp8_params": r["fp8_params"],
            "finite": all(math.isfinite(x) for x in losses),
            "losses": losses,
        }
    out["tolerance"] = {
        "loss_dev_max": TRAIN_LOSS_DEV_MAX,
        "param_dev_max": TRAIN_PARAM_DEV_MAX,
        "no_refresh_param_dev_min": NO_REFRESH_PARAM_DEV_MIN,
    }
    return out


# --------------------------------------------------------------------------------------------
# 1. Stale-transpose reproduction with one te.Linear
# --------------------------------------------------------------------------------------------


def stale_transpose_repro(
    recipe_name: str = "current", n: int = 1024, tokens: int = 512, seed: int = 7
) -> dict:
    """Graph a te.Linear fwd+bwd, write new FP8 weight bytes in place, replay before/after refresh."""
    te, _, tex = import_te()
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
        quantizer = te.Float8CurrentScalingQuantizer(
            tex.DType.kFloat8E4M3, device=w.device, rowwise=True, columnwise=False
        )
        write_fp8_in_place(w, master, quantizer)
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
# 3. Overhead
# --------------------------------------------------------------------------------------------


def _capture_trainer(t: Trainer, x: torch.Tensor, y: torch.Tensor, warmup: int = 3) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        t.load(x, y)
        for _ in range(warmup):
            t.step()
    torch.cuda.current_stream().wait_stream(side)
    t.probe()  # clean caches at capture: the no-refresh graph then holds no transpose kernel at all
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t.step()
    return graph


def _time_replays(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def measure_overhead(cfg: GPTConfig = OVERHEAD, iters: int = 10, rounds: int = 7, seed: int = 99) -> dict:
    """Median ms per replay: step graph with refresh, without, and the refresh kernels alone."""
    with_r = Trainer(cfg, seed, refresh=True)
    without = Trainer(cfg, seed, refresh=False)
    if not transposes_cached(with_r.fp8):
        raise RuntimeError("this GPU keeps no FP8 transposes (non-TN FP8 GEMMs): nothing to measure")
    xs, ys = make_batches(cfg, 1, seed)
    g_with = _capture_trainer(with_r, xs[0], ys[0])
    g_without = _capture_trainer(without, xs[0], ys[0])
    plan = Fp8RefreshPlan(with_r.model, require_stable_address=True)
    g_refresh = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.refresh()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g_refresh):
        plan.refresh()
    for g in (g_with, g_without, g_refresh):  # settle clocks and caches
        _time_replays(g, 3)
    t_with, t_without, t_ref = [], [], []
    for r in range(rounds):  # interleaved, alternating order
        pair = [(g_with, t_with), (g_without, t_without)]
        for g, acc in pair if r % 2 == 0 else pair[::-1]:
            acc.append(_time_replays(g, iters))
        t_ref.append(_time_replays(g_refresh, iters))
    mw, mo, mr = statistics.median(t_with), statistics.median(t_without), statistics.median(t_ref)
    return {
        "config": asdict(cfg),
        "fp8_params": len(with_r.fp8),
        "fp8_weight_bytes": sum(p.numel() for p in with_r.fp8),
        "ms_step_with_refresh": mw,
        "ms_step_without_refresh": mo,
        "ms_refresh_only": mr,
        "overhead_pct": 100.0 * (mw - mo) / mo,
        "refresh_only_pct": 100.0 * mr / mo,
        "samples_with": t_with,
        "samples_without": t_without,
        "iters_per_sample": iters,
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
    tr = results.get("training")
    if tr:
        lines.append(
            f"\n== 2. {tr['steps']}-step GPT ({tr['config']['layers']} x te.TransformerLayer, FP8 primary weights) =="
        )
        steps = list(next(iter(tr["runs"].values()))["loss_at"])
        head = f"{'variant':<32}" + "".join(f"{'loss@' + s:>11}" for s in steps)
        lines.append(head + f"{'max dloss':>11}{'param dev':>11}{'stale/flagged':>15}")
        for v, r in tr["runs"].items():
            row = f"{v:<32}" + "".join(f"{r['loss_at'][s]:>11.4f}" for s in steps)
            sf = f"{r['stale_after']}/{r['flagged_after']}"
            lines.append(row + f"{r['loss_dev_max']:>11.2e}{r['param_dev']:>11.3f}{sf:>15}")
        lines.append(
            "  (stale/flagged: transposes that differ from their FP8 bytes after the last step / of those, how many TE "
            "has flagged invalid. Flagged ones are rebuilt by eager TE before use; a graph captured with clean flags "
            "never rebuilds them.)"
        )
    ov = results.get("overhead")
    if ov and "error" not in ov:
        lines.append("\n== 3. refresh overhead (whole-step graph replay) ==")
        lines.append(
            f"step with refresh {ov['ms_step_with_refresh']:.3f} ms, without {ov['ms_step_without_refresh']:.3f} ms "
            f"-> overhead {ov['overhead_pct']:+.3f} %; refresh kernels alone {ov['ms_refresh_only']:.3f} ms "
            f"= {ov['refresh_only_pct']:.3f} % of the step ({ov['fp8_params']} FP8 weights, "
            f"{ov['fp8_weight_bytes'] / 2**20:.0f} MiB)"
        )
    fa = results.get("te_fused_adam")
    if fa:
        lines.append(f"\n== info: te.optimizers.FusedAdam(master_weights=True), delayed scaling: {fa}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON to this file")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--skip", nargs="*", default=[], choices=["repro", "training", "overhead", "fused_adam"])
    args = p.parse_args(argv)
    ok, why = fp8_available()
    if not ok:
        print(f"FP8 not available: {why}")
        return 2
    results: dict[str, Any] = {"env": env_info()}
    if "repro" not in args.skip:
        results["repro"] = {name: stale_transpose_repro(name) for name in ("current", "delayed")}
    if "training" not in args.skip:
        results["training"] = train_comparison(SMALL, args.steps)
    if "overhead" not in args.skip:
        results["overhead"] = measure_overhead()
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
