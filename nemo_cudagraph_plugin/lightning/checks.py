"""Can this fit be graphed? One definition of every refusal, checked as early as it can be.

What needs no GPU (strategy, automatic optimization, precision, the optimizers) is checked on any
machine — a user learns on a laptop that their module cannot be graphed — and only then whether a
CUDA device is there. Each refusal has a short ``label`` (the key in ``stats.eager_reasons``) and
a message that says what to change.

FP8 weights that would train wrongly with or without graphs (:func:`fp8_refusal`: a format the GPU does not run, an
optimizer without FP32 master weights for them) are refused whatever ``on_capture_error`` says (``Refusal.eager_too``):
training them eagerly is no way out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..core import compiled_runs_under_modes, compiled_submodule, compiled_with_cuda_graphs
from ..core.config import CaptureConfig
from ..core.optim import built_capturable, check_optimizer_supported
from ..fp8 import formats, is_te_module

__all__ = ["Refusal", "REFUSED_STRATEGIES", "setup_refusal", "fp8_refusal", "optimizer_refusal", "device_refusal"]

REFUSED_STRATEGIES = {
    "FSDPStrategy": "FSDP re-shards parameters and allocates gradient buffers inside every step",
    "DeepSpeedStrategy": "DeepSpeed's engine owns the optimizer step and synchronises with the host",
    "ModelParallelStrategy": "DTensor/FSDP2 collectives and re-sharding are not captured by this plugin",
    "XLAStrategy": "CUDA graphs need a CUDA device",
    "MegatronStrategy": (
        "NeMo's MegatronStrategy drives the step with Megatron's pipeline schedules (a dataloader_iter training step), "
        "not Lightning's closure; use nemo_cudagraph_plugin.integrations.nemo.with_cuda_graph(recipe), which turns on "
        "Megatron-core's own CUDA graphs and keeps our FP8 transpose care"
    ),
}


@dataclass(frozen=True)
class Refusal:
    """Why a fit is not graphed.

    Attributes:
        label: short reason, the key counted in ``stats.eager_reasons``.
        message: what is wrong and what to change.
        soft: train eagerly with one warning even with ``on_capture_error="raise"`` (the user chose
            it, or the machine has no GPU); otherwise a :class:`CaptureError` unless
            ``on_capture_error="eager"``.
        eager_too: training without graphs would be as wrong: a :class:`CaptureError` whatever
            ``on_capture_error`` says.
    """

    label: str
    message: str
    soft: bool = False
    eager_too: bool = False


def _mro_names(obj: Any) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def _submodule_name(pl_module: Any, name: str) -> str:
    """A submodule as the user reaches it: ``MyModule.model`` (``MyModule`` for the module itself)."""
    return f"{type(pl_module).__name__}.{name}" if name else type(pl_module).__name__


def setup_refusal(config: CaptureConfig, trainer: Any, pl_module: Any, owner: str) -> Optional[Refusal]:
    """Refusals known at ``setup`` on any machine: options, strategy, optimization mode, precision."""
    if not config.enabled:
        return Refusal("disabled", "disabled by the user (enabled=False)", soft=True)
    strategy = trainer.strategy
    names = _mro_names(strategy)
    for refused, why in REFUSED_STRATEGIES.items():
        if refused in names:
            return Refusal(
                "unsupported strategy",
                f"{type(strategy).__name__} is not supported: {why}. Use a single device or CudaGraphStrategy('ddp')",
            )
    if owner == "CudaGraphCallback" and "DDPStrategy" in names:
        return Refusal(
            "callback with DDP",
            f"CudaGraphCallback does not capture {type(strategy).__name__}: DDP capture needs NCCL async error handling "
            "off before the process group is created and >= 11 x accumulate_grad_batches + 1 eager warm-up steps, "
            "which only a strategy can arrange. Use Trainer(strategy=CudaGraphStrategy('ddp'), ...) (or "
            "CudaGraphStrategy(DDPStrategy(...)) with your DDP settings) instead of the callback",
        )
    if config.scope == "modules" and "DDPStrategy" in names:
        # DDP's reducer fires its gradient hooks and all-reduce from autograd; the partial tier's backward graphs sit
        # behind an autograd.Function whose structure changes at capture, which DDP's static graph does not expect.
        return Refusal(
            "partial graphs with DDP",
            f"{owner}(scope='modules') is not supported with {type(strategy).__name__}: partial graphs are not proven "
            "under DDP yet. Use scope='step' (the whole step, all-reduce included) or a single device",
        )
    if config.scope == "modules":
        te = next(((n, m) for n, m in pl_module.named_modules() if is_te_module(m)), None)
        if te is not None:
            # The TransformerEngine hazard checks (is_first_microbatch, delayed scaling) and the FP8 refresh's
            # ordering are proven for whole-step captures; module graphs would bake what those checks refuse.
            return Refusal(
                "partial graphs with TransformerEngine",
                f"{owner}(scope='modules') is not supported with TransformerEngine modules ({te[0] or 'the module'}: "
                f"{type(te[1]).__name__}): partial graphs do not run TransformerEngine's hazard checks on the modules "
                "they graph. Use scope='step' (or 'auto', which keeps whole steps for such models)",
            )
    if config.verify_steps and not compiled_runs_under_modes():
        compiled = compiled_submodule(pl_module)
        if compiled is not None:
            where = _submodule_name(pl_module, compiled)
            return Refusal(
                "verify_steps with torch.compile",
                f"{owner}(verify_steps={config.verify_steps}) runs each verified step once more under a dispatch mode "
                f"that records its writes, and torch {torch.__version__} (before 2.9) runs {where}, compiled with "
                "torch.compile, uncompiled under it and from then on. Use verify_steps=0, or torch >= 2.9",
            )
    if not pl_module.automatic_optimization:
        return Refusal(
            "manual optimization",
            "manual optimization (automatic_optimization=False) is not captured: the step's structure is your "
            "code, so the plugin cannot see where it begins and ends. Capture your own step with "
            "nemo_cudagraph_plugin.core.CaptureEngine, or use automatic optimization",
        )
    precision = str(trainer.precision)
    if precision.startswith("16") or precision in ("fp16", "half"):
        return Refusal(
            "fp16 precision",
            f"precision={precision!r} uses a GradScaler, whose step reads found_inf on the host every step; use "
            "precision='bf16-mixed' (or '32-true')",
        )
    compiled = compiled_with_cuda_graphs(pl_module)
    if compiled is not None:
        where = _submodule_name(pl_module, compiled)
        return Refusal(
            "torch.compile with CUDA graphs",
            f"{where} is compiled with torch.compile's own CUDA graphs (mode='reduce-overhead' or 'max-autotune'), "
            f"which capture and replay themselves when the compiled code runs and cannot run inside {owner}'s "
            "whole-step graph. Compile with mode='default' or mode='max-autotune-no-cudagraphs' (the whole-step "
            f"graph removes the launch overhead those modes target), or drop {owner} to keep torch.compile's graphs",
        )
    return None


def optimizer_refusal(trainer: Any) -> Optional[Refusal]:
    """Refusals known once the optimizers exist (``on_train_start``), on any machine."""
    n = len(trainer.optimizers)
    if n != 1:
        return Refusal(
            "optimizers", f"automatic optimization with {n} optimizers is not captured; use one optimizer"
        )
    try:
        check_optimizer_supported(trainer.optimizers[0])
    except TypeError as exc:
        return Refusal("optimizer", str(exc).rstrip("."))
    return None


def device_refusal(pl_module: Any) -> Optional[Refusal]:
    """Last: is there a CUDA device the model is on?"""
    if not torch.cuda.is_available():
        return Refusal("no CUDA device", "no CUDA device is available", soft=True)
    if pl_module.device.type != "cuda":
        return Refusal(
            "model not on CUDA",
            f"the model is on {pl_module.device}, not on a CUDA device (Trainer(accelerator='gpu'))",
            soft=True,
        )
    return None


def _more(n: int, what: str) -> str:
    return f" (and {n} more {what}{'s' if n != 1 else ''})" if n else ""


def _recipes_phrase(gpu: formats.Gpu) -> str:
    names = [f"{r}()" for r in formats.recipes_it_runs(gpu)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}" if names else ""


def _recipe_fix(gpu: formats.Gpu, use: str) -> str:
    """``use`` followed by the recipes ``gpu`` runs, or what to do when it runs none."""
    recipes = _recipes_phrase(gpu)
    if recipes:
        return f"{use}: {recipes}"
    return (f"{gpu.name} runs no FP8 format of TransformerEngine: train without FP8 (no te.quantized_model_init, "
            "no te.autocast; precision='bf16-mixed'), or on a GPU of compute capability 8.9 or higher")


def fp8_refusal(trainer: Any, pl_module: Any) -> Optional[Refusal]:
    """FP8 weights this fit cannot train right (``on_train_start``; before the optimizers are prepared).

    In order: an optimizer that updates TE quantized parameters without FP32 master weights (any machine); TE's
    ``FusedAdam`` holding them (it cannot step them inside a graph); parameters of a format their GPU does not run,
    and the recipe of Lightning's ``TransformerEnginePrecision`` (on a GPU).
    """
    names = {id(p): n for n, p in pl_module.named_parameters()}
    for opt in trainer.optimizers:
        masterless = formats.masterless_params(opt, names)
        if masterless is not None:
            (name, kind), n = masterless.params[0], len(masterless.params) - 1
            return Refusal(
                "FP8 weights without master weights",
                f"configure_optimizers returns {type(opt).__name__}, and parameter {name!r} is a TransformerEngine "
                f"{kind} (a quantized primary weight, from te.quantized_model_init){_more(n, 'quantized parameter')}"
                f": {masterless.how}. Use an optimizer that keeps FP32 master weights and writes the quantized "
                "weights from them in its step: nemo_cudagraph_plugin.fp8.MasterWeightAdamW (per-tensor FP8 weights; "
                "its step is captured with the rest), or TransformerEngine's FusedAdam(master_weights=True) without "
                "CUDA graphs (TE refuses capturable=True with FP8 weights); or keep high-precision weights (build the "
                "model without te.quantized_model_init) and let te.autocast quantize them for each GEMM",
                eager_too=True,
            )
        held = formats.quantized_params(opt, names) if formats.is_te_fused_adam(opt) else []
        if held:
            (name, kind), n = held[0], len(held) - 1
            mode = "capturable=True" if built_capturable(opt) else "capturable=False"
            return Refusal(
                "TE FusedAdam with FP8 weights",
                f"configure_optimizers returns TransformerEngine's FusedAdam ({mode}), and parameter {name!r} is a "
                f"{kind}{_more(n, 'quantized parameter')}: FusedAdam cannot update quantized weights inside a CUDA "
                "graph (with capturable=True TE refuses them at its first step: 'FusedAdam does not support FP8 "
                "model weights with capturable=True', and for block-scaled ones its write-back 'cannot be captured in "
                "a CUDA graph'; with capturable=False its step count and learning rate live on the host, where a "
                "replay would repeat the captured step's values). Train this model without CUDA graphs "
                "(FusedAdam(master_weights=True) is right eagerly), or keep high-precision weights (no "
                "te.quantized_model_init; te.autocast quantizes them for each GEMM) with FusedAdam(capturable=True) "
                "or torch.optim.AdamW",
            )
    bad = formats.unsupported_params(pl_module.named_parameters())
    if bad is not None:
        return Refusal(
            "FP8 format the GPU does not run",
            f"parameter {bad.name!r} is a TransformerEngine {bad.kind} ({bad.format}: te.quantized_model_init with "
            f"{bad.recipe}){_more(bad.others, 'such parameter')}, which "
            f"{bad.gpu} cannot run: {bad.reason}. "
            + _recipe_fix(bad.gpu, "Build the model under te.quantized_model_init with a recipe this GPU runs, and "
                                   "pass the same recipe to te.autocast"),
            eager_too=True,
        )
    plugin = getattr(trainer, "precision_plugin", None)
    recipe = getattr(plugin, "recipe", None)
    bad = formats.unsupported_recipe(recipe, pl_module.device) if recipe is not None else None
    if bad is not None:
        where = f"{type(plugin).__name__}(recipe={bad.recipe})"
        return Refusal(
            "FP8 recipe the GPU does not run",
            f"Trainer(plugins={where}) asks for {bad.format}, which {bad.gpu} cannot run: {bad.reason}. "
            + _recipe_fix(bad.gpu, f"Pass {type(plugin).__name__}(recipe=...) a recipe this GPU runs"),
            eager_too=True,
        )
    return None
