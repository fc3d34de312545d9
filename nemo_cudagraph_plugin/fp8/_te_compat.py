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
    "GENERATIONS",
    "Generation",
    "MIN_TE_VERSION",
    "UnsupportedFp8ApiError",
    "api_generation",
    "check_te_version",
    "delayed_scaling_unregistered",
    "expected_generation",
    "fp8_enabled",
    "is_fp8_tensor",
    "looks_like_fp8_tensor",
    "recompute_transpose",
    "reset_caches",
    "rowwise_data",
    "te_installed",
    "te_rng_states",
    "te_version",
    "transpose_buffer",
    "transpose_flagged_invalid",
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
