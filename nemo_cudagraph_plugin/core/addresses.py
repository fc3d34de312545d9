"""The addresses captured graphs depend on: recorded at capture, compared before a replay.

A graph bakes in the address of every tensor it reads or writes across steps (parameters, gradients, optimizer
state, buffers) and keeps that memory alive. :class:`AddressBook` names those tensors, records their addresses for
each graph, and says when they may have moved: the parameters' addresses are compared before every replay (swaps such
as ``p.data = ...``, ``module.to``, ``torch.utils.swap_tensors``, EMA weight swaps: the objects outlive them); every
other tensor (gradients, optimizer state, buffers) is watched by a weak reference (replacing one marks the book dirty)
and compared in full when dirty and after every eager step (state created later, e.g. a gradient that first appears
for a longer sequence, makes the graphs captured without it stale). :func:`difference` says why a graph must not
replay on the addresses of now; the engine then drops it (one warning) and captures it again.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from .errors import CaptureError

if TYPE_CHECKING:
    from .adapter import StepAdapter

__all__ = ["AddressBook", "Recorded", "difference", "moved_in_capture"]

_data_ptr = Tensor.data_ptr


class _Flag:
    """A mutable bool that weak-reference callbacks can set without keeping the engine alive."""

    __slots__ = ("dirty",)

    def __init__(self) -> None:
        self.dirty = False


@dataclass
class Recorded:
    """What one capture depends on by address."""

    #: (name, data_ptr) of every tensor the graph reads or writes across steps, at capture
    state: dict[str, int]
    #: the storages of those tensors: the memory the graph addresses stays valid while it exists
    keep: list[Any]
    #: weak references that mark the book dirty when one of those tensor objects is replaced and freed
    watch: list[weakref.ref]


class AddressBook:
    """The tensors graphs depend on by address, for one engine.

    Args:
        named_params: the model's trainable ``(name, parameter)`` pairs.
        adapter: tells the other tensors (:meth:`~.adapter.StepAdapter.state_tensors`,
            :meth:`~.adapter.StepAdapter.watched_tensors`).
    """

    def __init__(self, named_params: Sequence[tuple[str, Tensor]], adapter: StepAdapter) -> None:
        self.adapter = adapter
        self._flag = _Flag()
        self.set_params(named_params)

    @property
    def dirty(self) -> bool:
        """A watched tensor was replaced (or an eager step may have created state): compare in full."""
        return self._flag.dirty

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self._flag.dirty = value

    def set_params(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        """The trainable parameters (the per-replay scan covers them until the next capture adds the frozen ones)."""
        self.named_params = list(named_params)
        self._scan: list[Tensor] = [p for _, p in self.named_params]
        self._scan_ptrs: list[int] = list(map(_data_ptr, self._scan))

    def may_have_moved(self) -> bool:
        """Before a replay (hot path): dirty, or a parameter's address is not the one recorded."""
        return self._flag.dirty or list(map(_data_ptr, self._scan)) != self._scan_ptrs

    def rescan(self) -> None:
        """The parameters' addresses of now are the ones graphs were checked against."""
        self._scan_ptrs = list(map(_data_ptr, self._scan))

    def named_state(self, with_grads: bool = True) -> list[tuple[str, Tensor]]:
        """Every tensor a graph reads or writes across steps, named for messages."""
        out: list[tuple[str, Tensor]] = []
        for name, p in self.named_params:
            out.append((name, p))
            if with_grads and p.grad is not None:
                out.append((name + ".grad", p.grad))
        for i, item in enumerate(self.adapter.state_tensors()):
            out.append(item if isinstance(item, tuple) else (f"optimizer/extra state tensor #{i}", item))
        out.extend(self.adapter.watched_tensors())
        return out

    def now(self, with_grads: bool = True) -> dict[str, int]:
        """The address of every tensor :meth:`named_state` names."""
        return {name: t.data_ptr() for name, t in self.named_state(with_grads)}

    def record(self, named_after: list[tuple[str, Tensor]], before_ptrs: dict[str, int], owns: bool) -> Recorded:
        """What a capture depends on: the tensors after it (``named_after``), given their addresses before it.

        A gradient this (non-owning) capture created is written fresh by the graph, not accumulated: right for this
        step (eager had no gradient either), stale from the next step on. Recording it as absent makes the next check
        drop the graph, so it is captured again with the gradient. Owned gradients (``owns``) are the graph's own
        pool memory (other graphs' captures may reuse it between replays): neither kept nor watched.
        """
        state = {n: t.data_ptr() for n, t in named_after if owns or n in before_ptrs or not n.endswith(".grad")}
        grads = {n for n, _ in named_after if n.endswith(".grad")} if owns else set()
        watched = [(n, t) for n, t in named_after if n not in grads]
        keep = [t.untyped_storage() for _, t in watched]
        # From now on the per-replay scan covers the frozen parameters too.
        self._scan = [p for _, p in self.named_params] + [
            t for _, t in self.adapter.watched_tensors() if isinstance(t, torch.nn.Parameter)
        ]
        self.rescan()
        return Recorded(state, keep, self._watch(watched))

    def _watch(self, tensors: list[tuple[str, Tensor]]) -> list[weakref.ref]:
        flag = self._flag

        def freed(_ref: weakref.ref, flag: _Flag = flag) -> None:
            flag.dirty = True

        # Parameters are scanned before every replay instead (their objects outlive a `.data` swap).
        return [weakref.ref(t, freed) for _, t in tensors if not isinstance(t, torch.nn.Parameter)]


def moved_in_capture(before_ptrs: dict[str, int], named_after: list[tuple[str, Tensor]]) -> Optional[CaptureError]:
    """The error that refuses a capture inside which a tensor was re-allocated (or removed), if one was: the graph
    would write memory nothing reads."""
    after = dict(named_after)
    moved = next((n for n, t in named_after if n in before_ptrs and t.data_ptr() != before_ptrs[n]), None)
    moved = moved or next((n for n in before_ptrs if n not in after), None)
    if moved is None:
        return None
    return CaptureError(
        f"'{moved}' was re-allocated inside the captured step, so a replay would write memory nothing "
        "reads. Typical causes: `param.grad = None` inside training_step or a hook it calls, or a parameter "
        "replaced in forward. Zero gradients with optimizer.zero_grad() and keep parameters fixed.",
        rule="reallocation",
    )


def difference(state: dict[str, int], owns_grads: bool, now: dict[str, int]) -> Optional[str]:
    """Why a graph that recorded ``state`` (owning its gradients: ``owns_grads``) must not replay with the addresses
    ``now`` (``None`` if it may)."""
    for name, ptr in state.items():
        if owns_grads and name.endswith(".grad"):
            continue
        cur = now.get(name)
        if cur is None:
            return f"'{name}' no longer exists (set to None or removed) after the graph was captured"
        if cur != ptr:
            return (
                f"'{name}' was re-allocated after the graph was captured (p.data = ..., module.to(...), "
                "torch.utils.swap_tensors, a weight swap, load_state_dict or a replaced gradient)"
            )
    for name in now:
        if name not in state and not (owns_grads and name.endswith(".grad")):
            return f"'{name}' was created after the graph was captured (a later step made it), so the graph ignores it"
    return None
