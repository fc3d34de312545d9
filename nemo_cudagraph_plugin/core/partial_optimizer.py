"""The optimizer side of a partial-tier step as one graph: clipping and the optimizer's update.

In the partial tier (:mod:`.partial`) forward and backward run eagerly around the graphs of the modules that
capture; the optimizer side of the step reads and writes only tensors that stay where they are (parameters,
gradients zeroed in place, the optimizer's state, its learning rate as a device tensor), so it is one graph of its
own. :class:`OptimizerGraph` takes over one optimizer instance's ``step`` (an instance attribute, given back by
:meth:`OptimizerGraph.close`; nothing is patched on a class):

* ``step(closure)`` runs the closure eagerly, with gradients on (forward, backward, the hooks after backward);
* then the work handed to :meth:`OptimizerGraph.defer` during the closure (the framework's gradient clipping, which
  it calls last before the update) and the update itself (the instance's own ``step``, hooks included: an FP8
  transpose refresh registered as a step post-hook is part of it) run as one graph: eagerly the first time a key is
  seen (the optimizer's state is created then), captured the next time, replayed after.

**A parameter the step gave no gradient** (``drop_untouched``, the tier's :meth:`GradAccumulation.drop_untouched
<.graphed_module.GradAccumulation.drop_untouched>`: a module not called in it) has its ``.grad`` set to ``None``
after the closure, as eager ``zero_grad(set_to_none=True)`` leaves it: that step's update runs eagerly (torch's
optimizers skip such a parameter; the graph was captured with every gradient present) and the graph stays.

**The key** is what the graph bakes in from the deferred calls (their non-tensor arguments: the clipping value and
algorithm). **Guards**, before every replay: each parameter is where the graph was captured with it (``p.data = ...``
re-allocates with no hook to tell) and its gradient the tensor the graph reads (a parameter moved, a gradient set to
``None`` or replaced is a new capture, with one warning); with :attr:`OptimizerGraph.dirty` set (a
state loaded, a re-prepared optimizer) every address the graph reads is compared. Hyperparameters are the owner's
to guard (:meth:`OptimizerGraph.invalidate`), also those assigned inside the step, before the update (an ``lr`` set in
the framework's optimizer hook): its ``before_update`` runs after the closure, before a graph is looked up.

**Set aside** inside :meth:`OptimizerGraph.eager` (``verify_steps``' eager half): nothing is deferred and the update
this object took over runs eagerly; no key, graph or count of this object changes.

**Not captured:** the closure; a step called with keyword arguments (a ``GradScaler`` handing its scale to a fused
optimizer) or outside a step of the tier, which run eagerly as written. A capture that fails (an optimizer that
reads the host) leaves the optimizer eager for the rest of training, with its reason in ``stats.partial``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import traceback
import warnings
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Optional

import torch
from torch import Tensor

from ._torch_compat import mark_step_called
from .addresses import difference
from .backend import CapturePool, GraphBackend
from .config import PartialStats
from .errors import capture_error_from, root_cause
from .graphed_module import ReplayTally

__all__ = ["OptimizerGraph"]

_ABSENT = object()
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this package: its frames are not the reason


class _Entry:
    __slots__ = ("graph", "grads", "state", "keep")

    def __init__(self, graph: Any, grads: list[tuple[str, Tensor, Optional[Tensor], int]], state: dict[str, int],
                 keep: list[Any]) -> None:
        self.graph, self.grads, self.state, self.keep = graph, grads, state, keep


class OptimizerGraph:
    """Deferred clipping and the update of one optimizer, one graph per key.

    Args:
        optimizer: the optimizer whose ``step`` is taken over (prepared for capture by the owner: learning rate as a
            device tensor, state on the device).
        named_params: the parameters it updates, named for messages (their gradients are guarded).
        tensors: every tensor the update reads or writes, named for messages (parameters, gradients, state).
        backend, device: the device interface.
        stream: the side stream graphs are captured on.
        pool: the memory pool of the captures (shared with the modules' graphs).
        tally: the tier's replay tally (an operator counter tells replays apart).
        report: where the tier's counters go (``optimizer``, ``optimizer_captures``, ``optimizer_replays``).
        active: whether a step of the tier is running past its warm-up (else the update runs eagerly).
        on_capture: called after each capture (the owner keeps the gradients it addresses).
        before_update: called after the closure, before the update's graph is looked up: the owner copies what code
            inside the step assigned (an ``lr`` set in the framework's optimizer hook) to the device values the graph
            reads, and drops the graphs (:meth:`invalidate`) when a value they bake in changed.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_params: list[tuple[str, Tensor]],
                 tensors: Callable[[], list[tuple[str, Tensor]]], backend: GraphBackend, device: torch.device, *,
                 stream: Callable[[], Any], pool: CapturePool, tally: ReplayTally, report: PartialStats,
                 active: Callable[[], bool], on_capture: Callable[[], None] = lambda: None,
                 before_update: Callable[[], None] = lambda: None,
                 drop_untouched: Callable[[], bool] = lambda: False) -> None:
        self.optimizer, self.named_params, self.tensors = optimizer, named_params, tensors
        self._before_update = before_update
        self._drop_untouched = drop_untouched
        self.backend, self.device = backend, device
        self._stream, self._pool, self._active, self._on_capture = stream, pool, active, on_capture
        self.tally, self.report = tally, report
        self.graphs: dict[Hashable, _Entry] = {}
        self._seen: set[Hashable] = set()
        self._deferred: list[tuple[Callable[..., Any], tuple, dict]] = []
        #: check every address a graph reads before the next replay (a state was loaded)
        self.dirty = False
        #: why the optimizer side runs eagerly (``None``: it is graphed)
        self.eager_reason: Optional[str] = None
        #: steps of the tier whose optimizer side did not replay (a key's eager first step, a capture)
        self.events = 0
        self._eager = False  # inside eager(): nothing is deferred
        self._own: Any = _ABSENT
        self._inner: Callable[..., Any] = optimizer.step
        self._step = functools.partial(OptimizerGraph._run_step, self)
        self.follow()
        report.optimizer = "graphed: clipping and the optimizer step replay as one graph after their first eager step"

    # ------------------------------------------------------------------------------------------
    # the optimizer's step (hot path: a key, the gradients' identity, a replay)
    # ------------------------------------------------------------------------------------------
    def _run_step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        if kwargs or self._eager or not self._active() or self.eager_reason is not None:
            self._deferred_now()
            if closure is None:
                self._drop_untouched()
                return self._inner(**kwargs)
            return self._inner(functools.partial(_then, closure, self._drop_untouched), **kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dropped = self._drop_untouched()
        self._before_update()
        deferred, self._deferred = self._deferred, []
        key = tuple((fn, tuple(_plain(a) for a in args), tuple(sorted((k, _plain(v)) for k, v in kw.items())))
                    for fn, args, kw in deferred)
        if dropped:
            # Parameters without a gradient this step (a module not called): the optimizer skips them, so the
            # update differs from the graph's; it runs eagerly, the graph stays for the next step.
            self.events += 1
            self.report.optimizer_eager_untouched += 1
            for fn, args, kw in deferred:
                fn(*args, **kw)
            self._inner()
            return loss
        entry = self.graphs.get(key)
        if entry is not None and self._valid(key, entry):
            mark_step_called(self.optimizer)  # the Python side of torch's step, repeated
            tally = self.tally
            tally.inside = True
            try:
                entry.graph.replay()
            finally:
                tally.inside = False
            self.report.optimizer_replays += 1
            return loss

        def update() -> None:
            for fn, args, kw in deferred:
                fn(*args, **kw)
            self._inner()

        self.events += 1
        if key not in self._seen:
            self._seen.add(key)  # the first step of a key is eager: the optimizer creates its state there
            update()
        else:
            self._capture(key, update)
        return loss

    def defer(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Run ``fn(*args, **kwargs)`` as the first part of this step's optimizer graph instead of now (the
        framework's clipping, called last before the update). Returns ``False`` where nothing is deferred (the
        caller runs ``fn`` itself): outside a graphed step."""
        if self._eager or not self._active() or self.eager_reason is not None:
            return False
        self._deferred.append((fn, args, kwargs))
        return True

    def begin_step(self) -> None:
        """A step of the tier begins: nothing deferred by an earlier step is left (a step a ``GradScaler`` skipped)."""
        self._deferred = []

    def _deferred_now(self) -> None:
        deferred, self._deferred = self._deferred, []
        for fn, args, kw in deferred:
            fn(*args, **kw)

    def _valid(self, key: Hashable, entry: _Entry) -> bool:
        # every step: each parameter where the graph updates it (``p.data = ...`` moves it with no hook; the graph
        # would keep updating the old memory) and its gradient the tensor the graph reads
        why = next((f"'{n}' was re-allocated" if p.data_ptr() != ptr else
                    f"the gradient of '{n}' was replaced or set to None"
                    for n, p, g, ptr in entry.grads if p.grad is not g or p.data_ptr() != ptr), None)
        if why is None and self.dirty:
            self.dirty = False
            why = difference(entry.state, False, {n: t.data_ptr() for n, t in self.tensors()})
        if why is None:
            return True
        del self.graphs[key]
        warnings.warn(f"CUDA graph of the optimizer step re-captured: {why}", stacklevel=5)
        self.report.optimizer_recaptures += 1
        return False

    def _capture(self, key: Hashable, update: Callable[[], None]) -> None:
        be = self.backend
        graph = be.new_graph()
        # Where a capture runs what it records, a failed one has clipped and updated part-way: put that back.
        saved = [(t, t.clone()) for _, t in self.tensors()] if be.capture_runs_work else []
        try:
            # keeps nothing past its replay: it may share the pool of the module graphs captured before it
            with self._pool.capture(graph, self._stream(), keeps_nothing=True):
                update()
            be.finish(graph, None)
        except Exception as exc:  # noqa: BLE001 - the optimizer runs eagerly from now on, with its reason
            with torch.no_grad():
                for t, copy in saved:
                    t.copy_(copy)
            self.disable(self._reason(root_cause(exc)))
            update()
            return
        named = self.tensors()
        self.graphs[key] = _Entry(graph, [(n, p, p.grad, p.data_ptr()) for n, p in self.named_params],
                                  {n: t.data_ptr() for n, t in named},
                                  [t.untyped_storage() for _, t in named])
        self.report.optimizer_captures += 1
        self._on_capture()
        mark_step_called(self.optimizer)
        self.tally.inside = True
        try:
            graph.replay()  # a capture records; this replay is the step
        finally:
            self.tally.inside = False

    def _reason(self, exc: BaseException) -> str:
        """Why the optimizer side cannot be a graph, at the line that said so: the user's (their own optimizer, a
        clipping of theirs) or else the innermost line of the optimizer's own module (torch's ``adam.py``)."""
        what = f"{type(self.optimizer).__name__}.step"
        err = capture_error_from(exc, what)
        first = str(err).splitlines()[0]
        if err.location is not None:
            return first.replace(f"cannot capture the training step into a CUDA graph ({what}): ", f"{what}: ")
        did = first.split(f"({what}): ", 1)[-1]
        try:
            home = os.path.abspath(inspect.getsourcefile(type(self.optimizer)) or "")
        except TypeError:
            home = ""
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not os.path.abspath(f.filename).startswith(_HERE)]
        frame = next((f for f in reversed(frames) if os.path.abspath(f.filename) == home), frames[-1] if frames else None)
        at = f"{frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`): " if frame is not None else ""
        return f"{at}{what}: {did}"

    # ------------------------------------------------------------------------------------------
    # lifecycle
    # ------------------------------------------------------------------------------------------
    def follow(self) -> None:
        """Take the instance's ``step`` over again if something replaced it since (a re-prepared optimizer installs
        its own update): what is there now is the update the graphs capture. Cheap: one lookup (every step)."""
        opt = self.optimizer
        if opt.__dict__.get("step") is self._step:
            return
        self._own = opt.__dict__.get("step", _ABSENT)
        self._inner = opt.step
        opt.step = self._step
        self.graphs.clear()

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Inside the block the update this object took over runs eagerly and nothing is deferred (the framework clips
        itself); the graphs, their keys and the counts untouched. An owner's reference step may replace the instance's
        ``step`` inside the block (:meth:`UserStep.torchs_step <.user_step.UserStep.torchs_step>` gives torch's own
        back, then installs its update anew): this object's ``step`` is the instance's again after it, so the next
        step does not take over a new update (:meth:`follow`, which would drop the graphs)."""
        opt = self.optimizer
        ours = opt.__dict__.get("step") is self._step
        self._eager = True
        try:
            yield
        finally:
            self._eager = False
            if ours:
                opt.step = self._step

    def invalidate(self) -> None:
        """Drop the graphs (a hyperparameter they bake in changed): the next step of each key captures again."""
        self.graphs.clear()

    def disable(self, reason: str) -> None:
        """Run the optimizer side eagerly for the rest of training."""
        self.eager_reason = reason
        self.report.optimizer = f"eager: {reason}"
        self.graphs.clear()

    def close(self) -> None:
        """Give the optimizer its own ``step`` back and drop the graphs (idempotent)."""
        if self.optimizer.__dict__.get("step") is self._step:
            if self._own is _ABSENT:
                del self.optimizer.__dict__["step"]
            else:
                self.optimizer.step = self._own
        self.graphs.clear()


def _then(closure: Callable[[], Any], after: Callable[[], Any]) -> Any:
    """``closure()``, then ``after()``; the closure's result."""
    loss = closure()
    after()
    return loss


def _plain(v: Any) -> Any:
    """A deferred call's argument as part of a key: Python values as they are, lists and tuples by their items
    (a list of the same parameters made anew each step is the same key), anything else by identity."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return id(v)
