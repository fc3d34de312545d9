"""Static input buffers for nested batches.

A CUDA graph reads its inputs from fixed addresses, so every batch is copied (``copy_``) into
buffers allocated once per input signature. A batch may be any nesting of dict, list, tuple,
namedtuple and dataclass; tensor leaves are copied, every other leaf (strings, ints, ``None``)
is part of the signature and compared, never copied: a step captured with ``mode="a"`` is never
replayed for ``mode="b"``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any, Optional

import torch

from ._torch_compat import copy_all, is_view

__all__ = ["flatten", "unflatten", "signature_of", "is_broadcast", "static_like", "capture_layout", "StaticInputs"]

# Spec nodes (all hashable):
#   _T                                  a tensor leaf
#   ("c", value)                        a hashable non-tensor leaf, compared by value
#   ("r", type_name, repr)              an unhashable non-tensor leaf, compared by repr
#   ("d", keys, children)               dict (keys in insertion order)
#   ("l", children) / ("t", children)   list / tuple
#   ("n", type, children)               namedtuple
#   ("D", type, names, children)        dataclass instance
_T = "T"


def _flatten(obj: Any, leaves: list[torch.Tensor]) -> Hashable:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return _T
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # Before dict: a dict that is a dataclass (Hugging Face's ModelOutput) is rebuilt as its own class.
        names = tuple(f.name for f in dataclasses.fields(obj))
        return ("D", type(obj), names, tuple(_flatten(getattr(obj, n), leaves) for n in names))
    if isinstance(obj, dict):
        keys = tuple(obj.keys())
        return ("d", keys, tuple(_flatten(obj[k], leaves) for k in keys))
    if isinstance(obj, tuple):
        if hasattr(obj, "_fields"):  # namedtuple
            return ("n", type(obj), tuple(_flatten(v, leaves) for v in obj))
        return ("t", tuple(_flatten(v, leaves) for v in obj))
    if isinstance(obj, list):
        return ("l", tuple(_flatten(v, leaves) for v in obj))
    try:
        hash(obj)
    except TypeError:
        return ("r", type(obj).__qualname__, repr(obj))
    return ("c", obj)


def flatten(obj: Any) -> tuple[list[torch.Tensor], Hashable]:
    """Split a nested batch into its tensor leaves and a hashable structure spec."""
    leaves: list[torch.Tensor] = []
    spec = _flatten(obj, leaves)
    return leaves, spec


def _unflatten(spec: Hashable, it) -> Any:
    if spec == _T:
        return next(it)
    kind = spec[0]
    if kind == "c":
        return spec[1]
    if kind == "r":
        raise ValueError(
            f"cannot rebuild a batch leaf of type {spec[1]} (unhashable, compared by repr only); "
            "pass tensors, numbers, strings or containers of them"
        )
    if kind == "d":
        return {k: _unflatten(s, it) for k, s in zip(spec[1], spec[2])}
    if kind == "l":
        return [_unflatten(s, it) for s in spec[1]]
    if kind == "t":
        return tuple(_unflatten(s, it) for s in spec[1])
    if kind == "n":
        return spec[1](*(_unflatten(s, it) for s in spec[2]))
    if kind == "D":
        return spec[1](**{n: _unflatten(s, it) for n, s in zip(spec[2], spec[3])})
    raise AssertionError(f"unknown spec node {spec!r}")


def unflatten(spec: Hashable, leaves: list[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`: rebuild the batch from ``spec`` with ``leaves`` in order."""
    return _unflatten(spec, iter(leaves))


def unflattener(spec: Hashable) -> Callable[[list[torch.Tensor]], Any]:
    """:func:`unflatten` for one ``spec``, decided once: the spec is walked here, not per call (a replayed
    step's outputs are rebuilt with it after every replay)."""
    if spec == _T:
        return lambda leaves: leaves[0]
    if spec[0] == "d" and all(s == _T for s in spec[2]):  # {"loss": ...}: no walk at all
        keys = spec[1]
        return lambda leaves: dict(zip(keys, leaves))
    build = _builder(spec)
    return lambda leaves: build(iter(leaves))


def _builder(spec: Hashable) -> Callable[[Any], Any]:
    """A function of an iterator of leaves that rebuilds ``spec`` (as ``_unflatten`` does, leaves in order)."""
    if spec == _T:
        return next
    kind = spec[0]
    if kind == "c":
        value = spec[1]
        return lambda it: value
    if kind == "r":
        return functools.partial(_unflatten, spec)  # raises the same error, when called
    if kind == "d":
        keys, subs = spec[1], tuple(_builder(s) for s in spec[2])
        return lambda it: {k: b(it) for k, b in zip(keys, subs)}
    if kind in ("l", "t"):
        subs = tuple(_builder(s) for s in spec[1])
        seq = list if kind == "l" else tuple
        return lambda it: seq([b(it) for b in subs])
    if kind == "n":
        cls, subs = spec[1], tuple(_builder(s) for s in spec[2])
        return lambda it: cls(*[b(it) for b in subs])
    if kind == "D":
        cls, names, subs = spec[1], spec[2], tuple(_builder(s) for s in spec[3])
        return lambda it: cls(**{n: b(it) for n, b in zip(names, subs)})
    raise AssertionError(f"unknown spec node {spec!r}")


def is_broadcast(t: torch.Tensor) -> bool:
    """Whether ``t`` is a broadcast view (a stride 0 over more than one element: ``expand``)."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))


def static_like(t: torch.Tensor) -> torch.Tensor:
    """Uninitialised memory a graph reads in place of ``t``: ``t``'s own layout, so kernels read the strides of the
    example, except where ``t`` is a broadcast view (:func:`is_broadcast`), which nothing can be copied into; that one
    is dense (contiguous)."""
    if is_broadcast(t):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


def capture_layout(leaves: list[torch.Tensor]) -> Optional[list[torch.Tensor]]:
    """The tensors as a capture reads them, for the eager step before it: a copy in the static buffer's layout
    (:func:`static_like`) where a tensor is a view, since a capture's buffers are dense where the view is broadcast and
    never views; ``None`` where no tensor is a view. ``torch.compile`` guards on both (strides, and a view's base once
    it compiles with dynamic shapes): an eager step on the caller's views would leave dynamo to compile again inside
    the capture, where Inductor's first run of new kernels cannot be captured. The copies keep autograd's edges."""
    if not any(is_view(t) for t in leaves):
        return None
    return [static_like(t).copy_(t) if is_view(t) else t for t in leaves]


def signature_of(leaves: list[torch.Tensor], spec: Hashable) -> Hashable:
    """Hashable key of a batch: its structure, non-tensor leaves and each tensor's shape/dtype/device.

    Strides are included because a replay copies into a buffer laid out like the captured batch;
    a transposed view would otherwise be read in the wrong order by kernels that assume
    contiguity.
    """
    return (spec, tuple((t.shape, t.dtype, t.device, t.stride()) for t in leaves))


class StaticInputs:
    """Buffers holding the batch that a captured graph reads.

    Created from one example batch (its signature); :meth:`copy_from` copies a new batch of the
    same signature in with one ``copy_`` per tensor leaf on the current stream.
    """

    def __init__(self, leaves: list[torch.Tensor], spec: Hashable, device: Optional[torch.device] = None) -> None:
        for i, t in enumerate(leaves):
            if device is not None and t.device != device:
                raise ValueError(
                    f"batch tensor #{i} (shape {tuple(t.shape)}) is on {t.device}, but the step is captured on "
                    f"{device}. Move every batch tensor to the GPU before the step (Lightning's "
                    "transfer_batch_to_device does this), or pass CPU-side values as Python numbers/strings."
                )
            if t.requires_grad:
                raise ValueError(
                    f"batch tensor #{i} requires grad; inputs of a captured step must be plain data tensors."
                )
        self.spec = spec
        self.leaves = [static_like(t) for t in leaves]
        for s, t in zip(self.leaves, leaves):
            s.copy_(t)
        self.batch = unflatten(spec, self.leaves)

    def copy_from(self, leaves: list[torch.Tensor]) -> None:
        """Copy a batch of the same signature into the buffers (no allocation, no sync; one launch)."""
        if leaves:
            copy_all(self.leaves, leaves)
