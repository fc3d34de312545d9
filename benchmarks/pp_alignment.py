"""One-GPU measurement: first microbatch vs the others, lazy vs aligned FP8 transposes.

What it measures that the harness cannot: pipeline microbatches of FP8 layers, the first microbatch against the
others, with lazy or aligned transposes (the harness runs no pipeline stage).

A pipeline stage is simulated by a stack of ``te.TransformerLayer`` with FP8 primary weights
(``te.quantized_model_init``), trained with several microbatches per step. After every step an
optimizer writes new FP8 bytes into the weights in place, the way distributed optimizers do
(FP32 masters -> TransformerEngine's ``quantize_master_weights``, which also marks the
transposes invalid). Then:

- ``lazy``: nothing else; TransformerEngine computes each transpose inside microbatch 0.
- ``aligned``: ``align_fp8_transposes([model])`` right after the write, before microbatch 0.

Steps alternate between the two modes (each step starts with its own write, so both see the
same state and the same GPU clocks). Per-microbatch forward/backward times come from
``MicrobatchTimer`` (CUDA events); the step time from events around write + refresh + all
microbatches. Prints a table last; ``--out`` writes everything as JSON.

Run (one GPU, TransformerEngine installed)::

    python -m benchmarks.pp_alignment --out build/pp_alignment.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nemo_cudagraph_plugin.diagnostics import MicrobatchTimer
from nemo_cudagraph_plugin.fp8.pipeline import align_fp8_transposes

MODES = ("lazy", "aligned")


def parse(argv: Any = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument(
        "--seq", type=int, default=2048, help="tokens per microbatch; keep the GPU busier than the host"
    )
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="measured steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per mode")
    p.add_argument("--recipe", choices=("current", "delayed"), default="current")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--out", default=None, help="JSON file to write")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _te() -> Any:
    import transformer_engine
    import transformer_engine.pytorch as te

    return transformer_engine, te


def _quantized_init(te: Any, recipe: Any) -> Any:
    if hasattr(te, "quantized_model_init"):  # TE >= 2.x (new name)
        return te.quantized_model_init(enabled=True, recipe=recipe)
    return te.fp8_model_init(enabled=True, recipe=recipe)


def _autocast(te: Any, recipe: Any) -> Any:
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def _float8_tensor_cls() -> Any:
    try:
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor
    except ImportError:  # TE 1.x
        from transformer_engine.pytorch.float8_tensor import Float8Tensor
    return Float8Tensor


class MasterWriter:
    """FP32 master weights -> FP8 primary weights in place, as a distributed optimizer does.

    Default: TransformerEngine's ``quantize_master_weights`` (``cast_master_weights_to_fp8`` on
    older 2.x) over a one-rank process group; it writes the FP8 bytes (row-wise only) and calls
    ``_reset_caches()``, leaving the transposes invalid. If that cannot run here, the same effect
    by hand: ``_reset_caches()``, quantize the master row-wise only, ``copy_`` the FP8 bytes and
    scale into the parameter (TE's ``copy_`` between Float8Tensors skips an invalid transpose).
    """

    def __init__(self, fp8_params: list[torch.Tensor], lr: float) -> None:
        self.params = fp8_params
        with torch.no_grad():
            self.masters = [p.dequantize().float().clone() for p in fp8_params]
        self.lr = lr
        self.kind = "manual: _reset_caches + row-wise quantize + copy_"
        self.group = None
        self.fn = None
        self.quantizer = None
        try:
            try:
                from transformer_engine.pytorch.tensor.utils import quantize_master_weights as fn
            except ImportError:
                from transformer_engine.pytorch.tensor.utils import cast_master_weights_to_fp8 as fn
            if not dist.is_initialized():
                dist.init_process_group(
                    "nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
                )
            self.group = dist.group.WORLD
            self.fn = fn
            self.kind = f"transformer_engine {fn.__name__} (1-rank NCCL group)"
        except Exception as exc:  # measure anyway, and say so
            print(f"[pp_alignment] TE master-weight cast unavailable ({exc!r}); writing FP8 bytes by hand")

    def _manual(self) -> None:
        if self.quantizer is None:
            import transformer_engine.pytorch as te
            import transformer_engine_torch as tex

            self.quantizer = te.Float8CurrentScalingQuantizer(
                tex.DType.kFloat8E4M3, device=self.params[0].device, rowwise=True, columnwise=False
            )
        for p, m in zip(self.params, self.masters):
            p._reset_caches()
            p.copy_(self.quantizer(m.to(p.dtype)))

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            if p.grad is not None:
                m.add_(p.grad.float(), alpha=-self.lr)
        if self.fn is not None:
            try:
                self.fn(self.params, self.masters, [0] * len(self.params), self.group)
                return
            except Exception as exc:
                print(
                    f"[pp_alignment] {self.fn.__name__} failed ({exc!r}); writing FP8 bytes by hand from now on"
                )
                self.fn = None
                self.kind = "manual: _reset_caches + row-wise quantize + copy_"
        self._manual()


def invalid_fraction(fp8_params: list[torch.Tensor]) -> float:
    """Share of FP8 weights whose transpose is marked invalid (TE 2.x ``_transpose_invalid``)."""
    flags = [getattr(p, "_transpose_invalid", None) for p in fp8_params]
    flags = [f for f in flags if f is not None]
    return float(sum(bool(f) for f in flags)) / len(flags) if flags else float("nan")


def main(argv: Any = None) -> dict[str, Any]:
    args = parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("pp_alignment.py needs a CUDA GPU.")
    transformer_engine, te = _te()
    from transformer_engine.common import recipe as te_recipe

    if hasattr(te, "is_fp8_available"):
        ok = te.is_fp8_available(return_reason=True)
        ok, why = ok if isinstance(ok, tuple) else (ok, "")
        if not ok:
            raise SystemExit(f"FP8 not available on this GPU: {why}")
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    recipe = te_recipe.Float8CurrentScaling() if args.recipe == "current" else te_recipe.DelayedScaling()
    dtype = torch.bfloat16

    with _quantized_init(te, recipe):
        model = nn.Sequential(
            *[
                te.TransformerLayer(
                    args.hidden,
                    args.ffn,
                    args.heads,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                    params_dtype=dtype,
                    fuse_qkv_params=True,
                    self_attn_mask_type="causal",
                )
                for _ in range(args.layers)
            ]
        ).cuda()
    f8 = _float8_tensor_cls()
    fp8_params = [p for p in model.parameters() if isinstance(p, f8)]
    if not fp8_params:
        raise SystemExit("no Float8Tensor parameters were created; check te.quantized_model_init")
    writer = MasterWriter(fp8_params, args.lr)
    xs = [
        torch.randn(args.seq, args.micro_batch_size, args.hidden, device="cuda", dtype=dtype)
        for _ in range(args.microbatches)
    ]

    timers = {m: MicrobatchTimer("cuda") for m in MODES}
    step_events: dict[str, list[tuple[Any, Any]]] = {m: [] for m in MODES}
    invalid_before_mb0: dict[str, list[float]] = {m: [] for m in MODES}
    refreshed: dict[str, list[int]] = {m: [] for m in MODES}
    total = (args.warmup + args.steps) * len(MODES)
    t0 = time.perf_counter()
    for i in range(total):
        mode = MODES[i % len(MODES)]
        measured = i // len(MODES) >= args.warmup
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        writer.step()  # new FP8 bytes, transposes marked invalid
        for p in model.parameters():
            p.grad = None
        if mode == "aligned":
            refreshed[mode].append(align_fp8_transposes([model]))
        invalid_before_mb0[mode].append(invalid_fraction(fp8_params))
        timers[mode].start_step()
        for mb, x in enumerate(xs):
            with timers[mode].record("fwd", mb):
                with _autocast(te, recipe):
                    out = model(x)
                loss = out.float().square().mean()
            with timers[mode].record("bwd", mb):
                loss.backward()
        end.record()
        if measured:
            step_events[mode].append((start, end))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0

    results: dict[str, Any] = {}
    for mode in MODES:
        rep = timers[mode].report(skip_steps=args.warmup)
        step_ms = [s.elapsed_time(e) for s, e in step_events[mode]]
        results[mode] = {
            "timing": rep.as_dict(),
            "step_ms_median": statistics.median(step_ms),
            "step_ms": step_ms,
            "transposes_invalid_before_mb0": statistics.mean(invalid_before_mb0[mode][args.warmup :]),
            "refreshed_per_step": refreshed[mode][-1] if refreshed[mode] else 0,
        }
    out = {
        "benchmark": "pp_alignment",
        "config": vars(args),
        "env": {
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "transformer_engine": getattr(transformer_engine, "__version__", "?"),
            "fp8_params": len(fp8_params),
            "writer": writer.kind,
            "wall_s": wall,
        },
        "results": results,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    if dist.is_initialized():
        dist.destroy_process_group()

    e = out["env"]
    print(
        f"pp_alignment: {e['device']}, torch {e['torch']}, TE {e['transformer_engine']}, {args.layers} x "
        f"te.TransformerLayer(h={args.hidden}, ffn={args.ffn}), seq {args.seq}, {args.microbatches} microbatches, "
        f"{args.steps} steps/mode, recipe {args.recipe}, {e['fp8_params']} FP8 weights, writer {e['writer']}"
    )
    print(
        f"{'mode':<8} {'invalid@mb0':>11} {'fwd 1st/med':>11} {'bwd 1st/med':>11} {'mb 1st/med':>10} "
        f"{'1st mb ms':>9} {'med mb ms':>9} {'step ms':>8}"
    )
    for mode in MODES:
        r = results[mode]
        t = r["timing"]
        print(
            f"{mode:<8} {r['transposes_invalid_before_mb0']:>11.2f} {t['ratio']['fwd']:>11.3f} "
            f"{t['ratio']['bwd']:>11.3f} {t['ratio']['total']:>10.3f} {t['first_ms']['total']:>9.3f} "
            f"{t['rest_ms']['total']:>9.3f} {r['step_ms_median']:>8.3f}"
        )
    return out


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
