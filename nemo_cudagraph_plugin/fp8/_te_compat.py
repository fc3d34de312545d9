"""The one place that touches TransformerEngine's private ``Float8Tensor`` attributes.

Everything else in :mod:`nemo_cudagraph_plugin.fp8` goes through the functions here, so a TE
release that renames something breaks this module (and its CPU tests) only.

A ``Float8Tensor`` keeps its FP8 bytes in ``_data`` (row-wise, shape ``[*M, N]``) and a cached
transpose in ``_transpose`` (column-wise, ``[N, *M]``, used by the backward GEMMs on Hopper),
with a flag ``_transpose_invalid``. What each API generation does (read from TE's source):

============  ==========================================================================
generation    transpose refresh
============  ==========================================================================
``te1.6``     TE 1.6-1.7 ``float8_tensor.py``: ``transpose_2d(*, cache=False, noop_flag=None)``.
              With ``cache=True`` and the flag set it writes into the existing
              ``_transpose`` (``fp8_transpose_noalloc``), allocating only when it is ``None``;
              with the flag clear it returns the cache without a kernel.
``te1.8``     TE 1.8-1.14 (``tensor/float8_tensor.py`` from 1.11):
              ``transpose_2d(*, force_compute=False, fill_cache=False, noop_flag=None,
              cache=None)``. ``force_compute=True, fill_cache=True`` always runs the kernel
              into the existing buffer (TE's own ``copy_`` uses exactly this pair).
``te2``       TE 2.x ``Float8TensorStorage._create_transpose()``:
              ``tex.fp8_transpose(data, dtype, out=self._transpose)`` - in place when the
              buffer exists, a new allocation when it is ``None``; no-op without ``_data``.
============  ==========================================================================

In every generation ``_reset_caches()`` only sets ``_transpose_invalid`` (the buffer is kept);
TE 2.20 additionally treats a tensor without ``_data`` (column-wise-only storage, Hopper hybrid
quantization) as primary storage and leaves it valid. Eager TE rebuilds an invalid cache before
use (2.x: ``update_usage`` in the module forward/backward); a CUDA graph captured while the flag
was clear contains no rebuild and keeps reading the buffer.

The generation is detected from the tensor's methods (cached per class), never from the version
string alone; :func:`te_version` is used to refuse TE < 1.6 and to warn about a mismatch.

Also here, because they follow TE's names and rules release by release: which TE quantized tensor class a parameter
is (``Float8Tensor``, ``Float8BlockwiseQTensor``, ``MXFP8Tensor``, ``NVFP4Tensor``) and which recipe class makes it,
the GPUs TE runs each format on (:func:`format_unsupported`, TE's ``check_*_support`` by version), and the optimizers
that keep no FP32 master weights (:func:`masterless_optimizer`: torch's own, TE's ``FusedAdam(master_weights=False)``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import re
import sys
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from ..core.warn import warn_once

__all__ = [
    "FORMAT_TITLE",
    "GENERATIONS",
    "Generation",
    "MIN_TE_VERSION",
    "RECIPE_FORMAT",
    "TENSOR_FORMAT",
    "UnsupportedFp8ApiError",
    "api_generation",
    "check_te_version",
    "delayed_scaling_unregistered",
    "expected_generation",
    "fp8_enabled",
    "format_unsupported",
    "fp8_element_format",
    "high_precision_value",
    "is_fp8_tensor",
    "is_te_optimizer",
    "looks_like_fp8_tensor",
    "masterless_optimizer",
    "quantized_tensor_class",
    "recipe_class",
    "recipe_formats",
    "recompute_transpose",
    "reset_caches",
    "rowwise_data",
    "te_installed",
    "te_rng_states",
    "te_version",
    "transpose_buffer",
    "transpose_flagged_invalid",
    "write_per_tensor_fp8",
]

Generation = Literal["te1.6", "te1.8", "te2"]
GENERATIONS: tuple[Generation, ...] = ("te1.6", "te1.8", "te2")
MIN_TE_VERSION = (1, 6)

_TE_DISTRIBUTIONS = ("transformer_engine", "transformer-engine", "transformer_engine_torch")
_GEN_CACHE: dict[type, Optional[Generation]] = {}


class UnsupportedFp8ApiError(TypeError):
    """A tensor looks like a TE ``Float8Tensor`` but offers no in-place transpose refresh."""



# --------------------------------------------------------------------------------------------
# Detection (duck typing, cached per class)
# --------------------------------------------------------------------------------------------


def _generation_of(cls: type) -> Optional[Generation]:
    if cls in _GEN_CACHE:
        return _GEN_CACHE[cls]
    gen: Optional[Generation] = None
    if callable(getattr(cls, "_reset_caches", None)):
        if callable(getattr(cls, "_create_transpose", None)):
            gen = "te2"
        else:
            t2d = getattr(cls, "transpose_2d", None)
            if callable(t2d):
                try:
                    names = inspect.signature(t2d).parameters
                except (TypeError, ValueError):  # builtin without a signature: cannot tell
                    names = {}
                if "fill_cache" in names:
                    gen = "te1.8"
                elif "cache" in names:
                    gen = "te1.6"
    _GEN_CACHE[cls] = gen
    return gen


def api_generation(t: Any) -> Optional[Generation]:
    """The TE API generation of ``t``'s transpose cache, or ``None`` if ``t`` is not FP8-like."""
    return _generation_of(type(t))


def is_fp8_tensor(t: Any) -> bool:
    """True for a TE ``Float8Tensor`` (or a test double) whose transpose we know how to refresh.

    Duck typing: ``_reset_caches`` plus ``_create_transpose`` (TE 2.x) or a ``transpose_2d``
    taking ``cache``/``fill_cache`` (TE 1.6-1.14).
    """
    return _generation_of(type(t)) is not None


def looks_like_fp8_tensor(t: Any) -> bool:
    """True for anything with a TE-style transpose cache (``_reset_caches`` and ``_transpose``),
    whether or not its refresh API is known (TE < 1.6 has the cache but no in-place refresh)."""
    return callable(getattr(type(t), "_reset_caches", None)) and hasattr(t, "_transpose")


def unsupported_api_error(t: Any, name: str) -> UnsupportedFp8ApiError:
    """The error for an FP8-looking tensor whose refresh API is unknown."""
    methods = sorted(
        m for m in ("transpose", "transpose_2d", "_create_transpose", "update_usage") if hasattr(t, m)
    )
    ver = te_version()
    found = f"transformer_engine {'.'.join(map(str, ver))}" if ver else "an unknown TransformerEngine version"
    return UnsupportedFp8ApiError(
        f"Parameter {name} ({type(t).__module__}.{type(t).__name__}, from {found}) has a transpose cache "
        f"but no in-place refresh this package knows (methods present: {methods or 'none'}). Supported: "
        "TE 1.6-1.7 transpose_2d(cache=...), TE 1.8-1.14 transpose_2d(fill_cache=...), TE 2.x "
        "_create_transpose(). Upgrade transformer-engine to >= 1.6 (pip install 'nemo_cudagraph_plugin[te]'), "
        "or train this model without FP8 primary weights."
    )


# --------------------------------------------------------------------------------------------
# Private attribute access
# --------------------------------------------------------------------------------------------


def rowwise_data(t: Any) -> Optional[Tensor]:
    """The row-wise FP8 bytes (``_data``), ``None`` for column-wise-only storage."""
    return getattr(t, "_data", None)


def transpose_buffer(t: Any) -> Optional[Tensor]:
    """The cached transpose buffer (``_transpose``), ``None`` when there is none."""
    return getattr(t, "_transpose", None)


def transpose_flagged_invalid(t: Any) -> bool:
    """TE's own staleness flag (``_transpose_invalid``). A graph ignores it."""
    return bool(getattr(t, "_transpose_invalid", True))


def reset_caches(t: Any) -> None:
    """``t._reset_caches()``: marks the cache stale; never frees it in any supported TE."""
    t._reset_caches()


# FP8 element formats by the name of TE's ``tex.DType`` member (``_fp8_dtype``): torch's dtype and its largest finite
# value (E4M3: 448, E5M2: 57344).
_FP8_FORMATS = {"E4M3": (torch.float8_e4m3fn, 448.0), "E5M2": (torch.float8_e5m2, 57344.0)}


def fp8_element_format(t: Any) -> Optional[tuple[torch.dtype, float]]:
    """``(torch FP8 dtype, largest finite value)`` of a ``Float8Tensor``'s bytes, from ``_fp8_dtype`` (TE's
    ``DType.kFloat8E4M3`` / ``kFloat8E5M2``); ``None`` when it is neither. By the member's ``name``: a pybind11 enum up to
    TE 2.16, a Python ``IntEnum`` from 2.17 (whose ``str()`` is its number on Python >= 3.11)."""
    dt = getattr(t, "_fp8_dtype", None)
    name = getattr(dt, "name", None)
    if not isinstance(name, str):
        return None
    for key, fmt in _FP8_FORMATS.items():
        if key in name.upper():
            return fmt
    return None


def high_precision_value(t: Any) -> Tensor:
    """The value an FP32 master weight of ``t`` starts from: TE's kept initial value (``te.quantized_model_init(...,
    preserve_high_precision_init_val=True)``: ``get_high_precision_init_val()``, freed here once read), else the
    dequantized FP8 value."""
    get = getattr(t, "get_high_precision_init_val", None)
    value = get() if callable(get) else None
    if value is None:
        return t.dequantize(dtype=torch.float32)
    clear = getattr(t, "clear_high_precision_init_val", None)
    if callable(clear):
        clear()
    return value


def write_per_tensor_fp8(t: Any, master: Tensor, fmt: tuple[torch.dtype, float], *, reset: bool = True) -> None:
    """Quantize ``master`` into ``Float8Tensor`` ``t`` in place with per-tensor current scaling: ``scale = fmt max /
    amax(master)``, the FP8 bytes into ``_data`` and ``1 / scale`` into ``_scale_inv`` (what TE's GEMMs read for a
    quantized weight, whatever recipe made it). Device ops only (a TE quantizer called inside a CUDA-graph capture
    records a host copy that fails on replay, measured on TE 2.20), so the write is captured with the step.
    ``_reset_caches()`` first: TE's contract for an in-place write, so eager TE rebuilds the transpose before its
    next use (inside a graph the FP8 refresh rewrites it); ``reset=False`` writes the bytes only, as an all-gather into
    a distributed optimizer's parameter buffer does."""
    dtype, fmax = fmt
    if reset:
        t._reset_caches()
    data = t._data
    src = master.detach().float()
    scale = fmax / src.abs().amax().clamp_min(1e-12)  # an all-zero master: any finite scale writes zeros
    q = (src * scale).clamp_(-fmax, fmax).to(dtype)
    data.copy_(q.view(torch.uint8).view(data.shape) if data.dtype == torch.uint8 else q.view(data.dtype))
    t._scale_inv.copy_(scale.reciprocal().reshape(t._scale_inv.shape))


def mark_transpose_valid(t: Any) -> None:
    """After the transpose was written from the current ``_data`` by other means: what TE 2.x's
    ``_create_transpose()`` sets once its kernel is launched (``_transpose_invalid = False``)."""
    t._transpose_invalid = False


def recompute_transpose(t: Any, gen: Generation) -> None:
    """Recompute ``t``'s transpose from ``_data`` into the existing ``_transpose`` buffer.

    The caller checked that the buffer exists, so no supported generation allocates here.
    Launches one transpose kernel on the current stream (captured when a graph is capturing).
    """
    if gen == "te2":
        t._create_transpose()
    elif gen == "te1.8":
        # force_compute: run the kernel whatever the flag says; fill_cache: keep ``out`` as the cache.
        t.transpose_2d(force_compute=True, fill_cache=True)
    elif gen == "te1.6":
        if not transpose_flagged_invalid(t):
            # transpose_2d(cache=True) would return the cache without a kernel: stale forever in a graph.
            raise RuntimeError(
                f"{type(t).__name__}._reset_caches() did not mark the transpose stale, so "
                "transpose_2d(cache=True) would not recompute it. This TransformerEngine 1.6/1.7 build behaves "
                "unlike the released versions; upgrade transformer-engine."
            )
        t.transpose_2d(cache=True)
    else:  # pragma: no cover - guarded by callers
        raise ValueError(f"unknown TE API generation {gen!r}")


# --------------------------------------------------------------------------------------------
# Version
# --------------------------------------------------------------------------------------------


def _parse_version(text: str) -> Optional[tuple[int, int, int]]:
    m = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@functools.lru_cache(maxsize=1)
def _distribution_version() -> Optional[tuple[int, int, int]]:
    for dist in _TE_DISTRIBUTIONS:
        try:
            return _parse_version(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def te_version() -> Optional[tuple[int, int, int]]:
    """Installed TransformerEngine version ``(major, minor, patch)``, ``None`` if not installed.

    Never imports TE: reads ``transformer_engine.__version__`` when TE is already imported, else
    the installed distribution's metadata (looked up once per process).
    """
    mod = sys.modules.get("transformer_engine")
    text = getattr(mod, "__version__", None) if mod is not None else None
    if isinstance(text, str):
        return _parse_version(text)
    return _distribution_version()


def te_installed() -> bool:
    """True when a TransformerEngine distribution is installed (not necessarily importable)."""
    return te_version() is not None


def expected_generation(version: tuple[int, ...]) -> Optional[Generation]:
    """The API generation a released TE version has (``None`` below 1.6)."""
    major, minor = version[0], version[1]
    if major >= 2:
        return "te2"
    if major == 1 and minor >= 8:
        return "te1.8"
    if major == 1 and minor >= 6:
        return "te1.6"
    return None


def check_te_version(version: Optional[tuple[int, ...]] = None) -> Optional[tuple[int, ...]]:
    """Refuse TE < 1.6; warn once for TE >= 3 (untested). Returns the version (``None``: no TE).

    Raises:
        RuntimeError: TransformerEngine older than 1.6 is installed.
    """
    version = te_version() if version is None else version
    if version is None:
        return None
    if tuple(version[:2]) < MIN_TE_VERSION:
        raise RuntimeError(
            f"transformer_engine {'.'.join(map(str, version))} is installed, but FP8 transpose refresh needs "
            ">= 1.6 (older Float8Tensor has no in-place transpose_2d cache). Upgrade with "
            "pip install 'nemo_cudagraph_plugin[te]', or train without FP8 primary weights."
        )
    if version[0] >= 3:
        warn_once(
            f"te-untested-{version[0]}",
            f"transformer_engine {'.'.join(map(str, version))} is newer than the versions this package was "
            "tested with (1.6-2.x); the transpose refresh is chosen from the tensor's methods. Run "
            "verify_fp8_transposes(model) once after a step to confirm the refresh works.",
            RuntimeWarning,
        )
    return version


def warn_if_generation_mismatch(gen: Generation, version: Optional[tuple[int, ...]]) -> None:
    """Warn once when the methods say one generation and the installed version another."""
    if version is None:
        return
    want = expected_generation(version)
    if want is not None and want != gen:
        warn_once(
            f"gen-mismatch-{gen}-{want}",
            f"Float8Tensor methods look like TE API {gen!r} but transformer_engine "
            f"{'.'.join(map(str, version))} is installed (expected {want!r}); using the methods found. "
            "Check that only one TransformerEngine is installed.",
            RuntimeWarning,
        )


# --------------------------------------------------------------------------------------------
# TE global state used by the hazard checks (looked up only when TE is already imported)
# --------------------------------------------------------------------------------------------


def _te_state_manager() -> Any:
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        mod = sys.modules.get(name)
        mgr = getattr(mod, "FP8GlobalStateManager", None) if mod is not None else None
        if mgr is not None:
            return mgr
    return None


def fp8_enabled() -> bool:
    """True inside an enabled ``te.autocast``/``te.fp8_autocast`` (False when TE is not imported)."""
    mgr = _te_state_manager()
    if mgr is None:
        return False
    fn = getattr(mgr, "is_fp8_enabled", None)
    return bool(fn()) if callable(fn) else False


def te_rng_states() -> dict[str, Any]:
    """TE's ``CudaRNGStatesTracker`` states (``get_all_rng_states()``), ``{}`` when TE is not imported."""
    mod = sys.modules.get("transformer_engine.pytorch.distributed")
    fn = getattr(mod, "get_all_rng_states", None) if mod is not None else None
    if not callable(fn):
        return {}
    states = fn()
    return dict(states) if states else {}


def _recipe_is_delayed(recipe: Any) -> bool:
    fn = getattr(recipe, "delayed", None)
    if callable(fn):
        return bool(fn())
    return type(recipe).__name__ == "DelayedScaling"


def delayed_scaling_unregistered(module: torch.nn.Module) -> list[str]:
    """Names of TE modules that ran under delayed scaling but never joined TE's global amax buffer.

    TE registers a module's amax/scale tensors in ``FP8GlobalStateManager``'s global buffer on
    its first *eager* FP8 forward (``add_fp8_tensors_to_global_buffer`` is skipped while a CUDA
    graph is capturing, TE 2.x ``module/base.py``). A module whose first FP8 forward happened
    inside a capture is never reduced/updated, so its scales stay frozen. Returns ``[]`` when TE
    is not imported or this TE has no such buffer.
    """
    mgr = _te_state_manager()
    info = getattr(mgr, "get_buffer_info", None) if mgr is not None else None
    if not callable(info):
        return []
    key = info()
    out: list[str] = []
    for name, m in module.named_modules():
        meta = getattr(m, "fp8_meta", None)
        if not isinstance(meta, dict) or "recipe" not in meta or "scaling_fwd" not in meta:
            continue
        if not getattr(m, "fp8", False) or not _recipe_is_delayed(meta["recipe"]):
            continue
        if key not in meta:
            out.append(name or type(m).__name__)
    return out


def is_te_module(module: torch.nn.Module) -> bool:
    """A TransformerEngine module (judged by its class's module path; TE need not be importable)."""
    return any(c.__module__.startswith("transformer_engine") for c in type(module).__mro__[:-1])


def has_te_modules(module: torch.nn.Module) -> bool:
    return any(is_te_module(m) for m in module.modules())


def fp8_scaling_state(module: torch.nn.Module) -> list[Tensor]:
    """Every delayed-scaling tensor of TE modules (``fp8_meta[...]`` scale / scale_inv / amax_history).

    TE updates them inside its own C++ kernels, which torch's dispatcher does not see, so code
    that must undo a step (``verify_steps``) snapshots them explicitly.
    """
    out: list[Tensor] = []
    seen: set[int] = set()
    for m in module.modules():
        meta = getattr(m, "fp8_meta", None)
        if not isinstance(meta, dict):
            continue
        for key in ("scaling_fwd", "scaling_bwd"):
            state = meta.get(key)
            for attr in ("scale", "scale_inv", "amax_history"):
                t = getattr(state, attr, None)
                if isinstance(t, Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
    return out


# --------------------------------------------------------------------------------------------
# Quantized parameter formats, the recipes that make them, and the GPUs that run them
# --------------------------------------------------------------------------------------------

#: TE's quantized tensor classes a parameter can be (``transformer_engine.pytorch.tensor.*``; TE 1.x:
#: ``transformer_engine.pytorch.float8_tensor``) -> the format family TE checks a GPU for.
TENSOR_FORMAT: dict[str, str] = {
    "Float8Tensor": "fp8",
    "Float8BlockwiseQTensor": "fp8_block",
    "MXFP8Tensor": "mxfp8",
    "NVFP4Tensor": "nvfp4",
}

#: TE's recipe classes (``transformer_engine.common.recipe``) -> the format family of the tensors they make, in the
#: order a fix lists them.
RECIPE_FORMAT: dict[str, str] = {
    "DelayedScaling": "fp8",
    "Float8CurrentScaling": "fp8",
    "Float8BlockScaling": "fp8_block",
    "MXFP8BlockScaling": "mxfp8",
    "NVFP4BlockScaling": "nvfp4",
}

#: what each family is called in a message
FORMAT_TITLE: dict[str, str] = {
    "fp8": "FP8 with per-tensor scaling", "fp8_block": "FP8 block scaling", "mxfp8": "MXFP8", "nvfp4": "NVFP4",
}


def _te_class(obj: Any, package: str, names: Any) -> Optional[str]:
    for cls in type(obj).__mro__:
        if cls.__module__.startswith(package) and cls.__name__ in names:
            return cls.__name__
    return None


def quantized_tensor_class(t: Any) -> Optional[str]:
    """The TE class name of a quantized tensor (``"Float8Tensor"``, ``"MXFP8Tensor"``, ...; TE's base
    ``"QuantizedTensor"`` for a subclass this table does not know), ``None`` for anything else.

    Judged by the class's name and module (TE need not be importable); a tensor with TE's ``Float8Tensor``
    transpose cache counts as ``"Float8Tensor"`` (duck typing, as :func:`is_fp8_tensor`).
    """
    name = _te_class(t, "transformer_engine", TENSOR_FORMAT)
    if name is not None:
        return name
    if _te_class(t, "transformer_engine", ("QuantizedTensor",)) is not None:
        return "QuantizedTensor"
    if is_fp8_tensor(t) or looks_like_fp8_tensor(t):
        return "Float8Tensor"
    return None


def recipe_class(recipe: Any) -> Optional[str]:
    """The TE recipe class name of ``recipe`` (``"MXFP8BlockScaling"``, ...), ``None`` for anything else (TE's
    ``CustomRecipe`` included: its quantizers are the user's)."""
    return _te_class(recipe, "transformer_engine.common.recipe", RECIPE_FORMAT)


def _cuda_at_least(cuda: Optional[tuple[int, int]], want: tuple[int, int]) -> bool:
    return cuda is None or tuple(cuda) >= want  # unknown (a stand-in): not held against the GPU


def format_unsupported(
    fmt: str, capability: tuple[int, int], cuda: Optional[tuple[int, int]] = None,
    version: Optional[tuple[int, ...]] = None,
) -> Optional[str]:
    """Why TransformerEngine does not run ``fmt`` on a GPU of ``capability`` with CUDA ``cuda`` (``None``: it does).

    TE's own rules (``check_fp8_support``, ``check_fp8_block_scaling_support``, ``check_mxfp8_support``,
    ``check_nvfp4_support``; ``transformer_engine/pytorch/quantization.py`` in 2.10-2.20, ``fp8.py`` before), by
    the installed TE ``version`` (``None``: the 2.20 rules):

    - FP8 per-tensor (``DelayedScaling``, ``Float8CurrentScaling``): 9.0 or higher; 8.9 (Ada) with CUDA >= 12.1
      (and cuBLASLt >= 12.1.3, which TE checks itself).
    - FP8 block scaling (``Float8BlockScaling``): 9.0 or higher and CUDA >= 12.9; TE 2.3-2.8: Hopper (9.x) only.
    - MXFP8 (``MXFP8BlockScaling``): 10.0 or higher; from TE 2.6 not 12.0 or higher ("not supported on 12.0+
      architectures yet").
    - NVFP4 (``NVFP4BlockScaling``): 10.0 or higher.
    """
    cc = tuple(capability)
    version = tuple(version) if version is not None else (2, 20, 0)
    if fmt == "fp8":
        if cc >= (9, 0):
            return None
        if cc < (8, 9):
            return "TransformerEngine runs FP8 on compute capability 8.9 (Ada) or higher"
        if not _cuda_at_least(cuda, (12, 1)):
            return "TransformerEngine runs FP8 on compute capability 8.9 (Ada) with CUDA 12.1 or newer"
        return None
    if fmt == "fp8_block":
        hopper_only = version[:2] < (2, 9)
        if cc < (9, 0) or (hopper_only and cc >= (10, 0)):
            where = "Hopper (compute capability 9.x)" if hopper_only else "compute capability 9.0 or higher"
            return f"TransformerEngine runs FP8 block scaling on {where} with CUDA 12.9 or newer"
        if not _cuda_at_least(cuda, (12, 9)):
            return "TransformerEngine runs FP8 block scaling with CUDA 12.9 or newer only"
        return None
    if fmt == "mxfp8":
        if version[:2] >= (2, 6) and cc >= (12, 0):
            return ("TransformerEngine does not run MXFP8 on compute capability 12.0 or higher yet (it runs it on "
                    "10.x and 11.x: Blackwell data-center GPUs)")
        if cc < (10, 0):
            return "TransformerEngine runs MXFP8 on compute capability 10.0 or higher (Blackwell)"
        return None
    if fmt == "nvfp4":
        if cc < (10, 0):
            return "TransformerEngine runs NVFP4 on compute capability 10.0 or higher (Blackwell)"
        return None
    raise ValueError(f"unknown format {fmt!r}")


def recipe_formats(
    capability: tuple[int, int], cuda: Optional[tuple[int, int]] = None, version: Optional[tuple[int, ...]] = None
) -> list[str]:
    """The TE recipes a GPU runs (class names, in :data:`RECIPE_FORMAT`'s order)."""
    return [r for r, fmt in RECIPE_FORMAT.items() if format_unsupported(fmt, capability, cuda, version) is None]


# --------------------------------------------------------------------------------------------
# Optimizers that keep no FP32 master weights
# --------------------------------------------------------------------------------------------


def masterless_optimizer(optimizer: Any) -> Optional[str]:
    """How ``optimizer`` updates its parameters without FP32 master weights (a phrase for a message), ``None``
    when it may keep them.

    - torch's own optimizers (a ``step`` defined in ``torch.optim``, subclasses that keep it included) update each
      parameter in place: on a TE quantized tensor that is dequantize, update, quantize back.
    - TE's ``FusedAdam`` with ``master_weights=False`` (its constructor argument, kept as ``self.master_weights``):
      no FP32 copy (TE 2.20 ``fused_adam.py``: FP8 ``Float8Tensor`` parameters are then collected but not
      updated, other quantized ones refused at the step).

    Any other optimizer (one that keeps FP32 masters and writes the quantized weights from them, whatever its
    param groups hold) is ``None``.
    """
    step = inspect.unwrap(getattr(type(optimizer), "step", None) or (lambda: None))
    module = getattr(step, "__module__", "") or ""
    if module == "torch.optim" or module.startswith("torch.optim."):
        return (f"torch's {type(optimizer).__name__} updates each parameter in place with no FP32 master copy, so "
                "every step rounds the updated weight back to the quantized format and loses each update smaller "
                "than its spacing: training goes wrong silently")
    if is_te_optimizer(optimizer, "FusedAdam") and not getattr(optimizer, "master_weights", False):
        return ("TransformerEngine's FusedAdam(master_weights=False) keeps no FP32 master copy: it updates "
                "delayed-scaling Float8Tensor parameters in FP8 directly and raises at its step for other quantized "
                "ones, current-scaling Float8Tensor included (TE 2.20)")
    return None


def is_te_optimizer(optimizer: Any, name: str) -> bool:
    """``optimizer`` is TE's optimizer class ``name`` (``"FusedAdam"``: ``transformer_engine.pytorch.optimizers``),
    or a subclass of it."""
    return _te_class(optimizer, "transformer_engine", (name,)) is not None
