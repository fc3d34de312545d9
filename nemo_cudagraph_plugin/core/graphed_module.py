"""One module call's forward and backward as graphs behind an ``autograd.Function``: the partial tier's unit.

:func:`capture_call` captures a module's forward for one input signature into a forward graph; where anything
needs a gradient, the first backward of the call captures the backward of that forward (``torch.autograd.grad`` of
the outputs with respect to the inputs that require a gradient and the module's own trainable parameters, on the
autograd graph the forward's capture built) into a backward graph, both in the caller's memory pool (the one it has
at each capture: after a failed capture that is a new one, :class:`~.backend.CapturePool`), as
``torch.cuda.make_graphed_callables`` does (which captures both up front, with gradients it makes up).
:class:`GraphedCall` replays them:

* forward (:class:`_Replay.forward`): the call's tensors are copied into the static input buffers (those already
  at that address are not), the forward graph replays, and the outputs are returned as copies in fresh memory (the
  next replay overwrites the static outputs, and code after the module may keep or write them, as it may an eager
  module's);
* backward: the incoming gradients are copied into the static gradient buffers, the backward graph replays, and the
  static input gradients are handed to autograd. The parameters' gradients reach ``.grad`` in one of two ways:

  - **inside a graph** (:class:`GradAccumulation`): a third graph of the call, captured after the backward graph in
    the same pool and stream, adds each one into its parameter's ``.grad`` in place (``grad.add_(g)``: what
    autograd's ``AccumulateGrad`` does with an existing gradient outside grad mode, ``grad += g``, so the same bits),
    and autograd gets ``None`` for them: it launches nothing for those parameters;
  - **by autograd**, as in eager training, where that is not safe or not known to be: a parameter without a
    gradient gets a copy, one with a gradient has it added in place (the buffers are handed out as tensors this
    object keeps a reference to, so autograd never adopts graph memory as a ``.grad``).

  In-graph accumulation is exact only where the graph's gradient is the parameter's one contribution of the backward
  pass: with two (a tied weight, a parameter the loss also reads), autograd sums them first and adds the sum once,
  and ``(grad + a) + b`` is not ``grad + (a + b)`` in floating point. A parameter is accumulated inside the graph
  when, at the build of that graph, its ``.grad`` is a tensor of its shape, dtype and device (not a view of another:
  its version counter, which the check after each pass reads, would be shared with the other views), no hook on it
  expects to see the gradient (``register_hook``, ``register_post_accumulate_grad_hook``), the module tree holds it
  under one name only (not tied), and an earlier backward of the call found its gradient to be the parameter's only
  one (the probe, below). Every backward checks, before the third graph replays (else this call's parameter gradients
  go to autograd, and nothing is written): the module was called once in this step (two calls are two
  contributions), the pass accumulates into every leaf (``backward()`` without ``inputs``: not ``autograd.grad``,
  which must leave ``.grad`` alone), grad mode is off (not ``create_graph``), and each ``.grad`` is still the tensor
  the graph writes (one identity test per parameter, no host sync; set to ``None`` or replaced, this call's gradients
  go to autograd and the graph is built again with the gradients then present; a call whose gradients keep being
  replaced, as with ``zero_grad(set_to_none=True)`` every step, leaves them to autograd after a few tries).

  Extra contributions are found twice over. **The probe**, at the first backward of the call (which hands every
  gradient to autograd): a one-off hook on each candidate parameter sees what autograd is about to add; if that is
  not this call's own gradient tensor, autograd summed in another one, and the parameter stays with autograd: found
  before any replay relies on it, nothing differs. **After each pass** whose graphs added gradients: one version
  counter read per such parameter (a graph's replay does not move it; autograd's in-place add does). A ``.grad``
  written during the pass after the graph's add means a contribution that appeared later (the loss started to read
  the parameter): its value this step is the same numbers added in another order (the last bits may differ from
  eager, where the gradient was not zero before the pass), which one warning says, and from the next backward on
  autograd accumulates that parameter again. Nothing cheaper tells: autograd runs a parameter's ``AccumulateGrad``
  and its ``register_post_accumulate_grad_hook`` hooks in every pass, with no gradient too (torch 2.13), so such a
  hook would cost a Python call per parameter per backward and say nothing; and by the time a second contribution is
  seen the graph has added the first, so the probe is what keeps the bits where the extra use is there from the
  start.

  Not seen: hooks registered on a parameter after its add graph was built, and hooks on the ``AccumulateGrad`` node
  itself (DDP's; the tier refuses DDP); a ``.grad`` re-pointed in place (``grad.data = ...``: the graph adds into
  the memory it was captured with, which it keeps alive).

What is captured: every kernel of the module's forward and of its backward, and the parameters' accumulation into
``.grad`` where safe. What is not: the module's own hooks (they run around the call, every call), Python side effects
inside its forward (they happen once, at capture), and gradients of tensors the module reads that are neither its
inputs nor its own parameters (refused at capture). The autograd graph of the capture is kept: the activations the
backward graph reads stay allocated, so no later capture into the same pool reuses their memory.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ._torch_compat import (
    at_backward_end,
    autocast_cache_disabled,
    backward_pass_id,
    backward_runs,
    copy_all,
    donated_buffers_off,
    drop_empty_grad_hooks,
    grad_accumulator,
    has_grad_hooks,
    is_view,
)
from .backend import CapturePool, GraphBackend
from .buffers import flatten, static_like, unflatten, unflattener
from .errors import CaptureError
from .rng import GeneratorRegistry

__all__ = ["GradAccumulation", "GraphedCall", "ReplayTally", "capture_call"]

#: set-ups of a call's accumulation graph that may probe, find nothing to add or find a ``.grad`` replaced before the
#: graph has replayed :data:`_SETTLED` times; after that its parameters' gradients stay with autograd (gradients set
#: to ``None`` every step or every other step: nothing to gain)
_SETUPS = 3
#: replays after which an accumulation graph has settled: its call gets :data:`_SETUPS` set-ups again (gradients
#: freed now and then, as before each validation, keep it)
_SETTLED = 8


class ReplayTally:
    """Replays of every graph of one partial tier; ``inside`` is true while a graph replays (an operator counter
    attributes what it sees then to the graph, not to eager code)."""

    __slots__ = ("replays", "inside")

    def __init__(self) -> None:
        self.replays = 0
        self.inside = False


class GradAccumulation:
    """Which parameters' gradients the backward graphs of one tier add into ``.grad`` themselves (the module
    docstring says when), shared by its :class:`GraphedCall` objects: the probe's results, the parameters that stay
    with autograd and why, the end-of-pass check.

    Args:
        root: the module tree the tier works on (a parameter it holds under two names is tied: autograd's).
        device: the device of the pass's sentinel (a leaf of no size every graphed call takes as an input: autograd
            runs its ``AccumulateGrad`` in a pass that accumulates into every leaf only).

    Attributes:
        outside: ``id(parameter) -> (parameter, name, why)`` of the parameters that stay with autograd for good.
        version: moves when a parameter joins :attr:`outside` (each call's accumulation graph is then built again).
        on_change: called when a parameter leaves in-graph accumulation during a pass (the owner's bookkeeping).
    """

    def __init__(self, root: nn.Module, device: torch.device) -> None:
        self.root = root
        self.sentinel = torch.empty(0, device=device, requires_grad=True)
        self._sentinel_node = grad_accumulator(self.sentinel)
        self.probed: dict[int, tuple[Tensor, bool]] = {}
        self.outside: dict[int, tuple[Tensor, str, str]] = {}
        self.version = 0
        self.on_change: Callable[[], None] = lambda: None
        self.warned = False
        self._counts: Optional[Counter[int]] = None
        self._names: dict[int, str] = {}  # the module tree's name of each parameter (a tied one: its first)
        self._probes: list[tuple[Tensor, Any]] = []
        self._pass = -1
        self._watched: list[tuple[str, list[tuple[str, Tensor, Tensor]], list[int]]] = []
        # The window since the gradients were last zeroed in place for a zero_grad(set_to_none=True): each gradient
        # at its version right after the zeroing, and what the graphs added since (their adds move no version).
        self._zeroed: list[tuple[Tensor, Tensor, int]] = []
        self._window_adds: list[list[tuple[str, Tensor, Tensor]]] = []
        #: ``(parameter, .grad)`` set to ``None`` for the update of a window that gave them nothing (re-attached by
        #: :meth:`restore` before the next zeroing)
        self.dropped: list[tuple[Tensor, Tensor]] = []
        self._added: dict[tuple[int, ...], tuple[list, frozenset[int]]] = {}

    def begin_step(self) -> None:
        """Outside any backward pass, before a step: the module tree's parameters are counted anew when needed, and
        a probe whose pass raised (its hooks were not removed) is removed."""
        self._counts, self._names = None, {}
        self._unprobe()

    # ------------------------------------------------------------------------------------------
    # parameters a window gives no gradient (eager training leaves them None: the optimizer skips them)
    # ------------------------------------------------------------------------------------------
    def begin_window(self, zeroed: list[tuple[Tensor, Tensor]]) -> None:
        """The gradients ``(parameter, .grad)`` were just zeroed in place for a ``zero_grad(set_to_none=True)``
        (empty: the zeroing keeps zeros, as ``set_to_none=False`` does): the window that ends at the next update
        starts."""
        self._zeroed = [(p, g, g._version) for p, g in zeroed]
        self._window_adds = []

    def drop_untouched(self) -> bool:
        """At the end of a window's last backward, before the clipping and the update: every gradient the window
        zeroed and then gave nothing (no graph added into it, autograd wrote nothing: its version is the zeroing's)
        is set to ``None``, as ``zero_grad(set_to_none=True)`` leaves it in eager training, so the clipping and the
        optimizer skip that parameter as they do there. Once per window (later calls return the same answer).
        Returns whether any gradient is dropped."""
        zeroed, self._zeroed = self._zeroed, []
        if zeroed:
            adds, self._window_adds = self._window_adds, []
            # the same calls add every step: their parameters' set is made once per sequence of calls (the entry
            # keeps those lists alive, so their ids in the key are not reused)
            key = tuple(map(id, adds))
            entry = self._added.get(key)
            if entry is None:
                if len(self._added) >= 8:
                    self._added.clear()
                entry = self._added[key] = (adds, frozenset(id(p) for named in adds for _, p, _ in named))
            added = entry[1]
            for p, g, v in zeroed:
                if id(p) not in added and p.grad is g and g._version == v:
                    p.grad = None
                    self.dropped.append((p, g))
        return bool(self.dropped)

    def restore(self) -> None:
        """Before the next zeroing: the dropped gradients are the parameters' again (at the addresses the graphs add
        into and the optimizer's graph reads), unless something else was given meanwhile."""
        dropped, self.dropped = self.dropped, []
        for p, g in dropped:
            if p.grad is None:
                p.grad = g

    def full_pass(self) -> bool:
        """Whether the backward pass running now accumulates into every leaf's ``.grad``."""
        return backward_runs(self._sentinel_node)

    def eligible(self, p: Tensor, name: str, g: Optional[Tensor]) -> bool:
        """Whether ``p``'s gradient ``g`` (the backward graph's buffer) may be added into ``p.grad`` by a graph now
        (the probe aside). Records the parameters that never may."""
        key = id(p)
        if key in self.outside:
            return False
        if self._counts is None:
            named = list(self.root.named_parameters(remove_duplicate=False))
            self._counts = Counter(id(q) for _, q in named)
            self._names = {}
            for n, q in named:
                self._names.setdefault(id(q), n)
        why = None
        if self._counts[key] > 1:
            why = "tied: the module tree holds it under several names (autograd sums its gradients first)"
        elif has_grad_hooks(p):
            why = "a hook registered on it expects to see its gradient"
        if why is not None:
            self.exclude(p, name, why)
            return False
        grad = p.grad
        # not a view: the version counter the end-of-pass check reads would be its base's, moved by its neighbours
        return (g is not None and grad is not None and grad.layout is torch.strided and not grad.requires_grad
                and not is_view(grad) and grad.shape == p.shape and grad.dtype == p.dtype and grad.device == p.device
                and g.shape == p.shape and g.dtype == p.dtype and g.device == p.device)

    def exclude(self, p: Tensor, name: str, why: str) -> None:
        """``p``'s gradient is autograd's to accumulate from now on."""
        if id(p) not in self.outside:
            self.outside[id(p)] = (p, self._names.get(id(p), name), why)
            self.version += 1

    def probe(self, named: list[tuple[str, Tensor, Tensor]]) -> None:
        """In a pass that hands ``(name, parameter, gradient)`` to autograd: see whether the gradient autograd is
        about to add into each parameter's ``.grad`` is that tensor itself (its only contribution) or a sum."""
        pass_id = backward_pass_id()
        for name, p, g in named:

            def seen(total: Optional[Tensor], name: str = name, p: Tensor = p, g: Tensor = g) -> None:
                if backward_pass_id() != pass_id:
                    return
                self.probed[id(p)] = (p, total is g)
                if total is not g:
                    self.exclude(p, name, "it also gets a gradient from outside its module in the same backward "
                                          "(autograd sums the two first)")

            self._probes.append((p, p.register_hook(seen)))
        at_backward_end(self._unprobe)

    def close(self) -> None:
        """Remove what a probe whose pass raised left registered."""
        self._unprobe()

    def _unprobe(self) -> None:
        probes, self._probes = self._probes, []
        for p, handle in probes:
            handle.remove()
            drop_empty_grad_hooks(p)

    def watch(self, module: str, named: list[tuple[str, Tensor, Tensor]], versions: list[int]) -> None:
        """A graph added ``(name, parameter, .grad)``'s gradients in this pass, each ``.grad`` then at ``versions``:
        checked when the pass ends."""
        pass_id = backward_pass_id()
        if pass_id != self._pass:
            self._pass, self._watched = pass_id, []
            at_backward_end(self._end_pass)
        self._watched.append((module, named, versions))
        if self._zeroed:
            self._window_adds.append(named)

    def _end_pass(self) -> None:
        watched, self._watched, self._pass = self._watched, [], -1
        for module, named, versions in watched:
            for (name, p, grad), v in zip(named, versions):
                if grad._version == v:
                    continue
                # written in place after the graph's add, in this pass: autograd added another contribution
                self.exclude(p, name, "it also got a gradient from outside its module in a backward")
                self.on_change()
                if not self.warned:
                    self.warned = True
                    warnings.warn(
                        f"the gradient of '{name}' came from the graph of module '{module}' and from outside it in "
                        "one backward: its .grad this step is the same numbers added in another order than eager "
                        "training adds them (the last bits may differ); autograd accumulates it from the next backward "
                        "on (other parameters found so are not reported again: stats.partial.grads_outside)",
                        stacklevel=2)


class GraphedCall:
    """The forward graph and backward graph of one module for one input signature (and the graph that adds its
    parameters' gradients into ``.grad``, where :class:`GradAccumulation` allows).

    The forward graph is captured by :func:`capture_call`; the backward graph by the first backward of a call, when
    the gradients of the outputs exist (so a backend's first replay after a capture computes real numbers, as for
    the forward). A backward that cannot be captured gets its gradients eagerly from the autograd graph the forward's
    capture built (it holds that call's activations) and reports the error (``on_failure``).

    Attributes:
        state: ``name -> data_ptr`` of the module's parameters and buffers at capture (the graphs address them).
        keep: their storages: the memory the graphs address stays valid while this object lives.
        on_failure: called with the exception of a backward capture that failed (the module is then not graphed).
        alone: whether this call is its module's only call in the step (set by the owner; read in the backward).
        on_capture: called after the backward graph or the accumulation graph was captured (the owner's
            bookkeeping: a step that captures is not one whose graphs all replayed).
        accumulated: ``(name, parameter, .grad)`` of the parameters whose gradients the accumulation graph adds.
    """

    def __init__(self, name: str, fwd: Any, inputs: list[Tensor], params: tuple[Tensor, ...], out_spec: Hashable,
                 outs: list[Tensor], diff: list[bool], state: dict[str, int], keep: list[Any], tally: ReplayTally,
                 new_graph: Callable[[], Any], capture: Callable[..., Any], finish: Callable[[Any], Any],
                 param_names: Sequence[str] = (), grads: Optional[GradAccumulation] = None) -> None:
        self.name = name
        self.fwd: Any = fwd
        self.bwd: Any = None
        self.inputs, self.params = inputs, params
        # Copies go into aliases with their own version counter: the autograd graph of the capture, which the
        # backward's capture runs, saved the static inputs and must find them unchanged.
        self._input_data = [t.data for t in inputs]
        self.outs, self.diff = outs, diff
        self.grad_outs: list[Optional[Tensor]] = [torch.empty_like(o) if d else None for o, d in zip(outs, diff)]
        self.grad_ins: tuple[Optional[Tensor], ...] = ()
        self.state, self.keep = state, keep
        self.tally = tally
        self.on_failure: Callable[[BaseException], None] = lambda exc: None
        self.alone: Callable[[], bool] = lambda: True
        self.on_capture: Callable[[], None] = lambda: None
        self._new_graph, self._capture, self._finish = new_graph, capture, finish
        self._build = unflattener(out_spec)
        prefix = f"{name}." if name else ""
        self.param_names = tuple(prefix + n for n in param_names) or tuple(f"{prefix}<{i}>" for i in range(len(params)))
        self.grads = grads if params else None
        # the pass's sentinel: autograd runs its AccumulateGrad only in a pass that accumulates into every leaf
        self._extra: tuple[Tensor, ...] = (grads.sentinel,) if self.grads is not None else ()
        self.adds: Any = None
        self.accumulated: list[tuple[str, Tensor, Tensor]] = []
        self._adds_version = -1
        self._handed: tuple[Optional[Tensor], ...] = ()  # the gradients autograd gets when the adds ran
        self._setups = _SETUPS
        self._ran = 0  # replays of the accumulation graph since it was built
        self._kept: list[Any] = []
        #: the owner's step in which this call last replayed (one replay with gradients per step: the owner's guard)
        self.last_step = -1

    @property
    def needs_grad(self) -> bool:
        return any(self.diff)

    def __call__(self, leaves: Sequence[Tensor]) -> Any:
        """The module's outputs for the call whose tensor arguments are ``leaves`` (hot path)."""
        if not self.needs_grad:
            with torch.no_grad():
                return self._build(self.forward(leaves))
        return self._build(list(_Replay.apply(self, *leaves, *self.params, *self._extra)))

    def forward(self, leaves: Sequence[Tensor]) -> list[Tensor]:
        """Copy the inputs in, replay the forward graph, return the outputs in fresh memory."""
        pairs = [(d, t) for d, t in zip(self._input_data, leaves) if d.data_ptr() != t.data_ptr()]
        if pairs:
            copy_all([d for d, _ in pairs], [t for _, t in pairs])
        self._replay(self.fwd)
        fresh = [torch.empty_like(o) for o in self.outs]
        if fresh:
            copy_all(fresh, self.outs)
        return fresh

    def backward(self, grads: Sequence[Optional[Tensor]], create_graph: bool = False) -> tuple[Optional[Tensor], ...]:
        """Copy the output gradients in, replay the backward graph (and the accumulation graph where it may run);
        the inputs' and parameters' gradients for autograd. ``create_graph``: the pass runs in grad mode (autograd
        then adds out of place: the accumulation stays with it)."""
        for buf, g in zip(self.grad_outs, grads):
            if buf is not None and g is not None and buf.data_ptr() != g.data_ptr():
                buf.copy_(g)
        if self.bwd is None:
            graph = self._new_graph()
            try:
                with self._capture(graph):
                    got = self._grads()
                self._finish(graph)
            except Exception as exc:  # noqa: BLE001 - reported; this call's gradients are computed eagerly
                self.on_failure(exc)
                return self._slots(self._grads())
            self.bwd = graph
            self.on_capture()
            # Kept here, so autograd's accumulation sees tensors someone else holds and copies them (never adopts
            # the graph's memory as a .grad, which the next replay would overwrite).
            self.grad_ins = tuple(None if g is None else g.detach() for g in self._slots(got))
        if self.grads is not None and (self.adds is not None or self._setups) and not create_graph:
            self._replay(self.bwd)
            return self._accumulate()
        self._replay(self.bwd)
        return self.grad_ins

    # ------------------------------------------------------------------------------------------
    # the parameters' gradients into .grad inside a graph (module docstring)
    # ------------------------------------------------------------------------------------------
    def _accumulate(self) -> tuple[Optional[Tensor], ...]:
        acc = self.grads
        assert acc is not None
        if not self.alone() or not acc.full_pass():
            return self.grad_ins  # this call's parameter gradients go to autograd; the graph stays for the next
        if self.adds is not None:
            if self._adds_version != acc.version and not any(id(p) in acc.outside for _, p, _ in self.accumulated):
                self._adds_version = acc.version  # other calls' parameters left: this graph stays as it is
            if self._adds_version == acc.version:
                versions = []
                for _, p, grad in self.accumulated:
                    if p.grad is not grad:
                        break
                    versions.append(grad._version)
                else:
                    self._replay(self.adds)
                    acc.watch(self.name, self.accumulated, versions)
                    self._ran += 1
                    if self._ran == _SETTLED:
                        self._setups = _SETUPS
                    return self._handed
                self._setups -= 1  # a .grad set to None or replaced: built again with the gradients now there
            self.adds, self.accumulated = None, []
            if not self._setups:
                return self.grad_ins
        return self._setup()

    def _setup(self) -> tuple[Optional[Tensor], ...]:
        """Probe the parameters not probed yet, or else capture the graph that adds the gradients of those that
        passed into their ``.grad`` (and run it: this call's gradients)."""
        acc = self.grads
        assert acc is not None
        base = len(self.inputs)
        slots = [i for i, (n, p) in enumerate(zip(self.param_names, self.params))
                 if acc.eligible(p, n, self.grad_ins[base + i])]
        fresh = [i for i in slots if id(self.params[i]) not in acc.probed]
        if fresh or not slots:
            self._setups -= 1
            if fresh:
                acc.probe([(self.param_names[i], self.params[i], self.grad_ins[base + i]) for i in fresh])
            return self.grad_ins
        named = [(self.param_names[i], self.params[i], self.params[i].grad) for i in slots]
        bufs = [self.grad_ins[base + i] for i in slots]
        graph = self._new_graph()
        try:
            with self._capture(graph, keeps_nothing=True):  # adds in place: allocates nothing
                for (_, _, grad), g in zip(named, bufs):
                    grad.add_(g)  # autograd's AccumulateGrad: `grad += new` (an existing gradient, grad mode off)
            self._finish(graph)
        except Exception:  # noqa: BLE001 - nothing was added (a CUDA capture records only): autograd's, from now on
            self._setups = 0
            return self.grad_ins
        self.on_capture()
        added = {base + i for i in slots}
        self.adds, self.accumulated, self._adds_version, self._ran = graph, named, acc.version, 0
        self._kept = [grad.untyped_storage() for _, _, grad in named]  # the memory the graph adds into
        self._handed = tuple(None if j in added else g for j, g in enumerate(self.grad_ins))
        self._replay(graph)
        acc.watch(self.name, named, [grad._version for _, _, grad in named])
        return self._handed

    def _grads(self) -> tuple[Optional[Tensor], ...]:
        """The backward of the capture's autograd graph, run (or recorded) once more; it stays for the next time."""
        wrt = [s for s in self.inputs if s.requires_grad] + list(self.params)
        with donated_buffers_off():  # a compiled module's backward refuses retain_graph with donated buffers
            return torch.autograd.grad([o for o, d in zip(self.outs, self.diff) if d], wrt,
                                       grad_outputs=[g for g in self.grad_outs if g is not None],
                                       retain_graph=True, allow_unused=True)

    def _slots(self, got: Sequence[Optional[Tensor]]) -> tuple[Optional[Tensor], ...]:
        """One gradient per input of :class:`_Replay` (``None`` for an input that needs none)."""
        it = iter(got)
        return tuple(next(it) if needs else None
                     for needs in [s.requires_grad for s in self.inputs] + [True] * len(self.params))

    def _replay(self, graph: Any) -> None:
        tally = self.tally
        tally.inside = True
        try:
            graph.replay()
        finally:
            tally.inside = False
        tally.replays += 1


class _Replay(torch.autograd.Function):
    """The graphed call as one autograd node: inputs are the call's tensors, the module's trainable parameters and
    the pass's sentinel (:class:`GradAccumulation`)."""

    @staticmethod
    def forward(ctx: Any, call: GraphedCall, *tensors: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.call = call
        outs = call.forward(tensors[: len(call.inputs)])
        fixed = [o for o, d in zip(outs, call.diff) if not d]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        # the pass's grad mode, read before once_differentiable turns it off
        return _replay_backward(ctx, torch.is_grad_enabled(), *grads)


@torch.autograd.function.once_differentiable
def _replay_backward(ctx: Any, create_graph: bool, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
    call = ctx.call
    return (None, *call.backward(grads, create_graph), *(None for _ in call._extra))


def module_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """The parameters and buffers a module's graphs address, named for messages."""
    return [*module.named_parameters(), *((f"buffer '{n}'", b) for n, b in module.named_buffers())]


def capture_call(name: str, forward: Callable[..., Any], module: nn.Module, leaves: list[Tensor], spec: Hashable,
                 backend: GraphBackend, pool: CapturePool, stream: Any, generators: GeneratorRegistry,
                 device_type: str, tally: ReplayTally, grads: Optional[GradAccumulation] = None) -> GraphedCall:
    """Capture ``forward`` (the module's own forward) for the call whose arguments flatten to ``leaves``/``spec``.

    Raises whatever the capture raised (a host read, a CPU tensor, a data-dependent shape), or a
    :class:`CaptureError` for what a graph of this module cannot repeat: an input written in place, a gradient of a
    tensor that is neither an input nor the module's own parameter, a non-tensor argument that cannot be rebuilt.
    With ``grads``, the call's backward adds its parameters' gradients into ``.grad`` inside a graph where that is
    safe (module docstring); without, autograd accumulates them all.
    """
    grad = torch.is_grad_enabled()
    with torch.no_grad():
        static = [static_like(t) for t in leaves]
        for s, t in zip(static, leaves):
            s.copy_(t)
    for s, t in zip(static, leaves):
        s.requires_grad_(grad and t.requires_grad)
    try:
        args, kwargs = unflatten(spec, static)
    except ValueError as exc:
        raise CaptureError(f"module '{name}' takes an argument a graph cannot keep: {exc}", rule="argument") from exc
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad] if grad else []
    params = tuple(p for _, p in trainable)
    before = [(n, t.data_ptr()) for n, t in module_tensors(module)]
    versions = [s._version for s in static]
    fwd = backend.new_graph()
    generators.apply(fwd)  # the default generator is the backend's; dropout draws anew every replay
    # Autocast's cache of cast weights would hand the graph a tensor of the eager step (freed later) or keep one of
    # the graph's pool for eager code: casts inside the graph are its own.
    with autocast_cache_disabled(), pool.capture(fwd, stream):
        out = forward(*args, **kwargs)
    backend.finish(fwd, None)
    outs, out_spec = flatten(out)
    written = next((i for i, (s, v) in enumerate(zip(static, versions)) if s._version != v), None)
    if written is not None:
        raise CaptureError(f"module '{name}' writes its input #{written} in place; a graph would write its own copy "
                           "of it, not your tensor", rule="input-written")
    now = {n: t.data_ptr() for n, t in module_tensors(module)}
    moved = next((n for n, ptr in before if now.get(n) != ptr), None)
    if moved is not None:
        raise CaptureError(f"module '{name}' re-allocates '{moved}' in its forward; a graph would keep the old memory",
                           rule="reallocation")
    diff = [grad and o.requires_grad for o in outs]
    if any(diff) and params + tuple(s for s in static if s.requires_grad):
        _check_leaves(name, [o for o, d in zip(outs, diff) if d], [s for s in static if s.requires_grad] + list(params))
    else:
        diff, params = [False] * len(outs), ()
    named = module_tensors(module)

    def new_graph() -> Any:
        graph = backend.new_graph()
        generators.apply(graph)
        return graph

    return GraphedCall(name, fwd, static, params, out_spec, outs, diff, {n: t.data_ptr() for n, t in named},
                       [t.untyped_storage() for _, t in named], tally, new_graph,
                       lambda graph, keeps_nothing=False: pool.capture(graph, stream, keeps_nothing),
                       lambda graph: backend.finish(graph, None),
                       [n for n, _ in trainable] if params else (), grads)


def _check_leaves(name: str, outputs: list[Tensor], wrt: list[Tensor]) -> None:
    """Refuse a forward whose outputs depend on a trainable tensor that is neither an input nor the module's own
    parameter: the backward graph computes gradients for those two only, so that tensor would lose its gradient."""
    known = {id(t) for t in wrt}
    seen: set[int] = set()
    todo = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)
        if var is not None and id(var) not in known:
            raise CaptureError(
                f"module '{name}' computes with a trainable tensor that is neither its argument nor its own parameter "
                f"(shape {tuple(var.shape)}); its gradient would be lost", rule="foreign-parameter")
        todo.extend(f for f, _ in fn.next_functions if f is not None)
