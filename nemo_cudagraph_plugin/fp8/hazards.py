"""TransformerEngine graph hazards next to the FP8 transposes: RNG, weight caching, amax updates.

Each is handled or refused with an error that says what to change:

* **RNG tracker** (:func:`graph_safe_rng_generators`, :func:`register_rng_generators`). TE's
  ``CudaRNGStatesTracker`` (and Megatron's with ``use_cudagraphable_rng``) keeps one
  ``torch.Generator`` per named state and swaps it in with ``graphsafe_set_state`` inside
  ``fork()``. Those generators must be registered with every graph *before* its capture begins
  (``CUDAGraph.register_generator_state``, as TE's ``make_graphed_callables`` does), so each
  replay advances them. A tracker holding byte-tensor states (legacy ``get_rng_state`` style)
  cannot be captured: replays would reuse one random stream. Refused.
* **``is_first_microbatch``** (:class:`FirstMicrobatchCheck`). For modules whose weights are
  *not* FP8 primary weights, TE caches the FP8 copy of the weight: ``is_first_microbatch=True``
  (or ``None``) re-quantizes, ``False`` reuses the cache. Under whole-step capture the value of
  each call is frozen into the graph, so a module whose *first* call in the captured step passed
  ``False`` would reuse the FP8 weight cached before the optimizer step on every replay. Refused
  at the end of the capture. (For FP8 primary weights the flag is inert in TE 2.x: nothing is cached.)
* **Delayed-scaling amax/scale updates** (:func:`check_delayed_scaling_registered`). Under a
  plain ``torch.cuda.graph`` capture TE's forward amax reduction (``autocast`` exit) and backward
  reduction (first module's backward) are recorded into the graph and run on the device every
  replay, like eager. But TE adds a module's amax tensors to its global buffer only on an *eager*
  FP8 forward; a module whose first FP8 forward happens inside the capture is never updated.
  Refused after capture: run at least one eager warm-up step with FP8 enabled.
  (TE's own ``make_graphed_callables`` instead runs these updates eagerly around its replays.)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Optional

import torch

from ..core.errors import CaptureError
from . import _te_compat as te

__all__ = [
    "FirstMicrobatchCheck",
    "check_delayed_scaling_registered",
    "graph_safe_rng_generators",
    "register_rng_generators",
]


# --------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------


def _default_cuda_generators() -> tuple[torch.Generator, ...]:
    try:
        return tuple(torch.cuda.default_generators)
    except Exception:  # CPU-only builds
        return ()


def graph_safe_rng_generators(
    tracker: Optional[Any] = None, *, include_te: bool = True
) -> list[torch.Generator]:
    """The generators a captured step draws from besides the default CUDA generator.

    Args:
        tracker: an RNG states tracker with ``get_states()`` (TE's or Megatron's
            ``CudaRNGStatesTracker``), or ``None``.
        include_te: also include TE's global tracker states (``get_all_rng_states()``) when TE
            is imported.

    Returns:
        Distinct ``torch.Generator`` objects to register with each graph (the default CUDA
        generators are left out: ``torch.cuda.graph`` registers those itself).

    Raises:
        CaptureError: a tracker state is not a ``torch.Generator`` (not graph-safe).
    """
    states: list[tuple[str, Any]] = []
    if include_te:
        states += [(f"TE tracker state {k!r}", v) for k, v in te.te_rng_states().items()]
    if tracker is not None:
        get = getattr(tracker, "get_states", None)
        if not callable(get):
            raise TypeError(
                f"tracker {type(tracker).__name__} has no get_states(); pass an RNG states tracker"
            )
        states += [(f"{type(tracker).__name__} state {k!r}", v) for k, v in get().items()]
    defaults = _default_cuda_generators()
    out: list[torch.Generator] = []
    for what, state in states:
        if not isinstance(state, torch.Generator):
            raise CaptureError(
                f"{what} is a {type(state).__name__}, not a torch.Generator, so it cannot be used inside a CUDA graph: "
                "fork() would restore it with set_rng_state, which a capture freezes (every replay reuses the same "
                "random numbers). Use TransformerEngine's CudaRNGStatesTracker with torch >= 2.5 (graph-safe by "
                "default), or Megatron's tracker with use_cudagraphable_rng=True, or set dropout to 0.",
                rule="rng-tracker",
            )
        if any(state is g for g in defaults) or any(state is g for g in out):
            continue
        out.append(state)
    if out and not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
        raise CaptureError(
            f"torch {torch.__version__} cannot register extra generators with a CUDA graph "
            "(CUDAGraph.register_generator_state appeared in torch 2.5); the RNG tracker's dropout would replay the "
            "same masks. Upgrade torch or disable dropout that uses the tracker.",
            rule="rng-tracker",
        )
    return out


def register_rng_generators(target: Any, tracker: Optional[Any] = None, *, include_te: bool = True) -> int:
    """Register the tracker generators with a graph (before its capture) or with a registry.

    Args:
        target: a ``torch.cuda.CUDAGraph`` (``register_generator_state``) or an object with
            ``register(generator)`` such as :class:`nemo_cudagraph_plugin.core.rng.GeneratorRegistry`.
        tracker, include_te: as in :func:`graph_safe_rng_generators`.

    Returns:
        How many generators were registered.
    """
    gens = graph_safe_rng_generators(tracker, include_te=include_te)
    reg = getattr(target, "register_generator_state", None)
    if not callable(reg):
        reg = getattr(target, "register", None)
    if not callable(reg):
        raise TypeError(
            f"cannot register generators with {type(target).__name__}: pass a torch.cuda.CUDAGraph or an object "
            "with register(generator)"
        )
    for g in gens:
        reg(g)
    return len(gens)


# --------------------------------------------------------------------------------------------
# is_first_microbatch
# --------------------------------------------------------------------------------------------


def _first_microbatch_index(module: torch.nn.Module) -> Optional[int]:
    """Position of ``is_first_microbatch`` in ``module.forward`` (after ``self``), or ``None``."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == "is_first_microbatch":
            return i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else -1
    return None


def _weights_all_fp8(module: torch.nn.Module) -> bool:
    weights = [p for p in module.parameters(recurse=False) if p.dim() >= 2]
    return bool(weights) and all(te.is_fp8_tensor(p) for p in weights)


class FirstMicrobatchCheck:
    """Context manager around a capture that refuses a frozen FP8 weight cache.

    Installs instance-level forward pre-hooks (only for the duration of the ``with`` block, so
    replays pay nothing) on every module whose ``forward`` takes ``is_first_microbatch`` and that
    owns parameters. The first call of such a module inside the block must not pass
    ``is_first_microbatch=False`` while FP8 is enabled, unless its weights are FP8 primary weights.
    Violations are collected and raised as one :class:`CaptureError` when the block exits
    (never from inside the capture).

    Args:
        module: the model being captured.
        fp8_enabled: callable telling whether FP8 is on at call time (default: TE's global state).
    """

    def __init__(self, module: torch.nn.Module, *, fp8_enabled: Optional[Callable[[], bool]] = None) -> None:
        self.module = module
        self._fp8_enabled = fp8_enabled or te.fp8_enabled
        self.violations: list[str] = []
        self._seen: set[int] = set()
        self._handles: list[Any] = []

    def _hook_for(self, name: str, index: int) -> Callable[..., None]:
        def hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if id(mod) in self._seen:
                return
            self._seen.add(id(mod))
            if "is_first_microbatch" in kwargs:
                value = kwargs["is_first_microbatch"]
            elif 0 <= index < len(args):
                value = args[index]
            else:
                value = None
            if value is False and self._fp8_enabled() and not _weights_all_fp8(mod):
                self.violations.append(name or type(mod).__name__)

        return hook

    def __enter__(self) -> FirstMicrobatchCheck:
        self.violations.clear()
        self._seen.clear()
        for name, m in self.module.named_modules():
            idx = _first_microbatch_index(m)
            if idx is None or next(m.parameters(recurse=False), None) is None:
                continue
            self._handles.append(m.register_forward_pre_hook(self._hook_for(name, idx), with_kwargs=True))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if exc_type is None and self.violations:
            raise CaptureError(
                "is_first_microbatch=False on the first call of the captured step for "
                f"{', '.join(self.violations)}: the graph would reuse the FP8 weight copy cached before the optimizer "
                "step on every replay (stale weights). Pass is_first_microbatch=True on the first micro-batch of each "
                "step (or None to re-quantize every call), or use FP8 primary weights (te.quantized_model_init).",
                rule="fp8-weight-cache",
            )


# --------------------------------------------------------------------------------------------
# Delayed scaling
# --------------------------------------------------------------------------------------------


def check_delayed_scaling_registered(module: torch.nn.Module) -> None:
    """Refuse TE modules whose delayed-scaling amax would never be reduced under graph replay.

    Call after a capture (or after the eager warm-up). See :func:`_te_compat.delayed_scaling_unregistered`.

    Raises:
        CaptureError: listing the modules, with the fix.
    """
    missing = te.delayed_scaling_unregistered(module)
    if missing:
        raise CaptureError(
            f"TransformerEngine modules {', '.join(missing)} ran their first FP8 (delayed scaling) forward inside the "
            "CUDA graph capture, so TE never added their amax history to its global buffer and their FP8 scales "
            "would stay frozen on every replay. Run at least one eager warm-up step with FP8 enabled that calls "
            "these modules (warmup_steps >= 1 and the same code path), or use a current-scaling recipe "
            "(te.recipe.Float8CurrentScaling).",
            rule="fp8-delayed-scaling",
        )
