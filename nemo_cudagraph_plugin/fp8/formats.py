"""FP8 weights a fit cannot train right, found before the first step.

Two mistakes that TransformerEngine reports late, or never:

* **A format the GPU does not run.** ``te.quantized_model_init`` (``te.fp8_model_init`` on TE < 2.8) builds
  ``MXFP8Tensor``/``NVFP4Tensor`` parameters on any GPU; TE checks the recipe only when ``te.autocast`` is entered in
  the first forward (``check_recipe_support``, whose message names no fix, and which does not cover NVFP4).
  :func:`unsupported_params` and :func:`unsupported_recipe` compare the parameters' formats (and a recipe that is
  known before the step, e.g. Lightning's ``TransformerEnginePrecision(recipe=...)``) with TE's rules for the GPU
  they are on. The recipe a training step passes to ``te.autocast`` is not visible before that step.
* **FP8 primary weights updated without FP32 masters** (:func:`masterless_params`). A torch optimizer updates each
  parameter in place; on a TE quantized tensor that is dequantize, update, quantize back, so every update smaller
  than FP8's spacing at that weight is lost and training goes wrong silently. An optimizer that keeps FP32 masters
  (whatever its param groups hold) is not concerned.

TE's class names and rules are read in :mod:`._te_compat`; nothing here imports TransformerEngine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from . import _te_compat as te

__all__ = ["Gpu", "MasterlessParams", "UnsupportedFormat", "gpu_of", "is_te_fused_adam", "masterless_params",
           "quantized_params", "recipes_it_runs", "unsupported_params", "unsupported_recipe"]


@dataclass(frozen=True)
class Gpu:
    """A CUDA device as TE's checks see it: its name, compute capability and torch's CUDA version."""

    name: str
    capability: tuple[int, int]
    cuda: Optional[tuple[int, int]] = None

    def __str__(self) -> str:
        return f"{self.name} (compute capability {self.capability[0]}.{self.capability[1]})"


def _cuda_version() -> Optional[tuple[int, int]]:
    text = getattr(torch.version, "cuda", None)
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def gpu_of(device: torch.device) -> Optional[Gpu]:
    """The GPU ``device`` is (``None`` for a CPU tensor or where CUDA is not available)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return Gpu(torch.cuda.get_device_name(device), (int(major), int(minor)), _cuda_version())


def recipes_it_runs(gpu: Gpu) -> list[str]:
    """TE's recipe classes the GPU runs (TE's rules for the installed version), in a fixed order."""
    return te.recipe_formats(gpu.capability, gpu.cuda, te.te_version())


@dataclass(frozen=True)
class UnsupportedFormat:
    """A parameter (or a recipe) of a format the GPU it is meant for does not run.

    Attributes:
        name: the parameter's name, or the recipe's class name for :func:`unsupported_recipe`.
        kind: TE's class of the parameter (``"MXFP8Tensor"``) or of the recipe (``"MXFP8BlockScaling"``).
        format: what the format is called (``"MXFP8"``).
        recipe: the recipe that makes such parameters (``"MXFP8BlockScaling()"``).
        reason: TE's rule, in words.
        gpu: the GPU.
        others: how many more parameters have the same problem.
    """

    name: str
    kind: str
    format: str
    recipe: str
    reason: str
    gpu: Gpu
    others: int = 0


_RECIPE_OF = {"fp8": "DelayedScaling() or Float8CurrentScaling()", "fp8_block": "Float8BlockScaling()",
              "mxfp8": "MXFP8BlockScaling()", "nvfp4": "NVFP4BlockScaling()"}


def unsupported_params(named_params: Iterable[tuple[str, Tensor]]) -> Optional[UnsupportedFormat]:
    """The first parameter that is a TE quantized tensor of a format its GPU does not run (``None``: there is none).

    Parameters on the CPU, or where CUDA is not available, are not judged (there is no GPU to judge them by).
    """
    found: list[UnsupportedFormat] = []
    version = te.te_version()
    seen: set[int] = set()
    for name, p in named_params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        kind = te.quantized_tensor_class(p)
        fmt = te.TENSOR_FORMAT.get(kind or "")
        if fmt is None:
            continue
        gpu = gpu_of(p.device)
        if gpu is None:
            continue
        reason = te.format_unsupported(fmt, gpu.capability, gpu.cuda, version)
        if reason is not None:
            found.append(UnsupportedFormat(name, kind, te.FORMAT_TITLE[fmt], _RECIPE_OF[fmt], reason, gpu))
    if not found:
        return None
    first = found[0]
    return UnsupportedFormat(first.name, first.kind, first.format, first.recipe, first.reason, first.gpu,
                             others=len(found) - 1)


def unsupported_recipe(recipe: Any, device: torch.device) -> Optional[UnsupportedFormat]:
    """``recipe`` (a TE recipe object) when the GPU ``device`` is does not run it, else ``None`` (also for a
    custom recipe, anything that is not a TE recipe, and a device that is not a GPU)."""
    kind = te.recipe_class(recipe)
    gpu = gpu_of(device) if kind is not None else None
    if kind is None or gpu is None:
        return None
    fmt = te.RECIPE_FORMAT[kind]
    reason = te.format_unsupported(fmt, gpu.capability, gpu.cuda, te.te_version())
    if reason is None:
        return None
    return UnsupportedFormat(kind, kind, te.FORMAT_TITLE[fmt], f"{kind}()", reason, gpu)


@dataclass(frozen=True)
class MasterlessParams:
    """An optimizer that updates TE quantized parameters with no FP32 master copy.

    Attributes:
        how: how it updates them and what follows (``"torch's AdamW updates each parameter in place ..."``).
        params: ``(name, TE class)`` of each quantized parameter it updates.
    """

    how: str
    params: list[tuple[str, str]]


def masterless_params(optimizer: Any, names: Optional[dict[int, str]] = None) -> Optional[MasterlessParams]:
    """The TE quantized parameters ``optimizer`` would update without FP32 masters (``None``: none, or it may keep
    masters). Parameters that do not require a gradient are never updated and are left out.

    Args:
        optimizer: the optimizer.
        names: ``id(parameter) -> name``; others are named by their place (``"param group 0, #3"``).
    """
    how = te.masterless_optimizer(optimizer)
    params = quantized_params(optimizer, names) if how is not None else []
    return MasterlessParams(how, params) if how is not None and params else None


def quantized_params(optimizer: Any, names: Optional[dict[int, str]] = None) -> list[tuple[str, str]]:
    """``(name, TE class)`` of every TE quantized parameter in ``optimizer``'s param groups that requires a
    gradient."""
    names = names or {}
    out: list[tuple[str, str]] = []
    for i, group in enumerate(getattr(optimizer, "param_groups", ())):
        for j, p in enumerate(group.get("params", ())):
            kind = te.quantized_tensor_class(p)
            if kind is not None and getattr(p, "requires_grad", True):
                out.append((names.get(id(p), f"param group {i}, #{j}"), kind))
    return out


def is_te_fused_adam(optimizer: Any) -> bool:
    """``optimizer`` is TransformerEngine's ``FusedAdam`` (or a subclass)."""
    return te.is_te_optimizer(optimizer, "FusedAdam")
