"""What the engine asks of the framework that hands it a training step: one adapter object.

:class:`StepAdapter` is the whole interface between :class:`~.engine.CaptureEngine` and a framework adapter (the
Lightning adapter, ``lightning/adapter.py``, implements it). The engine asks the adapter for each member when it needs it: ``after_replay`` after
every replay, the rest at capture, on address checks and around ``verify_steps``; the list of ``guards`` is read
once, when the engine is built. :class:`StepFunctions` builds an adapter from plain functions, for
framework-free use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    from .engine import GraphEntry

__all__ = ["Guard", "Named", "StepAdapter", "StepFunctions"]

#: a check run before every step; a reason (``str``) drops every graph once
Guard = Callable[[], Optional[str]]
#: a tensor, or ``(name, tensor)`` (the name is used in messages)
Named = Union[Tensor, tuple[str, Tensor]]


@runtime_checkable
class StepAdapter(Protocol):
    """What a framework tells the engine about the steps it hands it.

    Per step: :meth:`guards` (read once, when the engine is built) and ``after_replay``. At capture: ``on_capture``,
    :meth:`capture_contexts`, :meth:`post_capture_checks`, :meth:`host_state`. On address checks (capture, after eager
    steps, when a watched tensor was freed): :meth:`state_tensors`, :meth:`watched_tensors`. Around ``verify_steps``:
    :meth:`mutable_tensors`, :meth:`host_state`.
    """

    #: after every replay (the framework repeats the host effects a replay skips); ``None``: nothing
    after_replay: Optional[Callable[[GraphEntry], None]]
    #: right after each capture, before its first replay; ``None``: nothing
    on_capture: Optional[Callable[[GraphEntry], None]]

    def guards(self) -> Sequence[Guard]:
        """The checks run before every step (eager, capture or replay); read once, when the engine is built."""
        ...

    def state_tensors(self) -> Sequence[Named]:
        """Every tensor besides the parameters the step reads or writes across steps (optimizer state, learning-rate
        tensors)."""
        ...

    def watched_tensors(self) -> Sequence[tuple[str, Tensor]]:
        """Other tensors a graph reads (frozen parameters, module buffers): addresses recorded and checked."""
        ...

    def mutable_tensors(self) -> Sequence[Tensor]:
        """Tensors the step writes without torch's dispatcher seeing it (e.g. TransformerEngine's FP8 scaling state):
        snapshotted around ``verify_steps``."""
        ...

    def host_state(self) -> Callable[[], None]:
        """Snapshot the host-side counters the step mutates; the returned function puts them back (a failed capture,
        the eager half of ``verify_steps``)."""
        ...

    def capture_contexts(self) -> Sequence[Callable[[], contextlib.AbstractContextManager]]:
        """Context managers entered around each capture (hazard checks; they may raise ``CaptureError`` on exit)."""
        ...

    def post_capture_checks(self) -> Sequence[Callable[[], None]]:
        """Checks run right after each capture (they may raise ``CaptureError``)."""
        ...


def _none() -> None:
    return None


class StepFunctions:
    """A :class:`StepAdapter` made of plain functions; each one left out means "nothing"."""

    def __init__(
        self,
        state: Callable[[], Sequence[Named]] = lambda: [],
        watched: Callable[[], Sequence[tuple[str, Tensor]]] = lambda: [],
        mutable: Callable[[], Sequence[Tensor]] = lambda: [],
        host_state: Optional[Callable[[], Callable[[], None]]] = None,
        guards: Sequence[Guard] = (),
        capture_contexts: Sequence[Callable[[], contextlib.AbstractContextManager]] = (),
        post_capture_checks: Sequence[Callable[[], None]] = (),
        on_capture: Optional[Callable[[Any], None]] = None,
        after_replay: Optional[Callable[[Any], None]] = None,
    ) -> None:
        self._state, self._watched, self._mutable = state, watched, mutable
        self._host = host_state or (lambda: _none)
        self._guards = list(guards)
        self._contexts = list(capture_contexts)
        self._checks = list(post_capture_checks)
        self.on_capture = on_capture
        self.after_replay = after_replay

    def guards(self) -> Sequence[Guard]:
        return self._guards

    def state_tensors(self) -> Sequence[Named]:
        return self._state()

    def watched_tensors(self) -> Sequence[tuple[str, Tensor]]:
        return self._watched()

    def mutable_tensors(self) -> Sequence[Tensor]:
        return self._mutable()

    def host_state(self) -> Callable[[], None]:
        return self._host()

    def capture_contexts(self) -> Sequence[Callable[[], contextlib.AbstractContextManager]]:
        return self._contexts

    def post_capture_checks(self) -> Sequence[Callable[[], None]]:
        return self._checks
