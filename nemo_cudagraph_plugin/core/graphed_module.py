"""One module call's forward and backward as two graphs behind an ``autograd.Function``: the partial tier's unit.

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
  static input gradients are handed to autograd. The parameters' gradients then reach ``.grad`` through autograd's
  own accumulation, as in eager training: a parameter without a gradient gets a copy, one with a gradient has it
  added in place (the buffers are handed out as tensors this object keeps a reference to, so autograd never adopts
  graph memory as a ``.grad``).

What is captured: every kernel of the module's forward and of its backward. What is not: the module's own hooks
(they run around the call, every call), Python side effects inside its forward (they happen once, at capture), and
gradients of tensors the module reads that are neither its inputs nor its own parameters (refused at capture).
The autograd graph of the capture is kept: the activations the backward graph reads stay allocated, so no later
capture into the same pool reuses their memory.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ._torch_compat import autocast_cache_disabled, copy_all
from .backend import CapturePool, GraphBackend
from .buffers import flatten, static_like, unflatten, unflattener
from .errors import CaptureError
from .rng import GeneratorRegistry

__all__ = ["GraphedCall", "ReplayTally", "capture_call"]


class ReplayTally:
    """Replays of every graph of one partial tier; ``inside`` is true while a graph replays (an operator counter
    attributes what it sees then to the graph, not to eager code)."""

    __slots__ = ("replays", "inside")

    def __init__(self) -> None:
        self.replays = 0
        self.inside = False


class GraphedCall:
    """The forward graph and backward graph of one module for one input signature.

    The forward graph is captured by :func:`capture_call`; the backward graph by the first backward of a call, when
    the gradients of the outputs exist (so a backend's first replay after a capture computes real numbers, as for
    the forward). A backward that cannot be captured gets its gradients eagerly from the autograd graph the forward's
    capture built (it holds that call's activations) and reports the error (``on_failure``).

    Attributes:
        state: ``name -> data_ptr`` of the module's parameters and buffers at capture (the graphs address them).
        keep: their storages: the memory the graphs address stays valid while this object lives.
        on_failure: called with the exception of a backward capture that failed (the module is then not graphed).
    """

    def __init__(self, name: str, fwd: Any, inputs: list[Tensor], params: tuple[Tensor, ...], out_spec: Hashable,
                 outs: list[Tensor], diff: list[bool], state: dict[str, int], keep: list[Any], tally: ReplayTally,
                 new_graph: Callable[[], Any], capture: Callable[[Any], Any], finish: Callable[[Any], Any]) -> None:
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
        self._new_graph, self._capture, self._finish = new_graph, capture, finish
        self._build = unflattener(out_spec)

    @property
    def needs_grad(self) -> bool:
        return any(self.diff)

    def __call__(self, leaves: Sequence[Tensor]) -> Any:
        """The module's outputs for the call whose tensor arguments are ``leaves`` (hot path)."""
        if not self.needs_grad:
            with torch.no_grad():
                return self._build(self.forward(leaves))
        return self._build(list(_Replay.apply(self, *leaves, *self.params)))

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

    def backward(self, grads: Sequence[Optional[Tensor]]) -> tuple[Optional[Tensor], ...]:
        """Copy the output gradients in, replay the backward graph; the inputs' and parameters' gradients."""
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
            # Kept here, so autograd's accumulation sees tensors someone else holds and copies them (never adopts
            # the graph's memory as a .grad, which the next replay would overwrite).
            self.grad_ins = tuple(None if g is None else g.detach() for g in self._slots(got))
        self._replay(self.bwd)
        return self.grad_ins

    def _grads(self) -> tuple[Optional[Tensor], ...]:
        """The backward of the capture's autograd graph, run (or recorded) once more; it stays for the next time."""
        wrt = [s for s in self.inputs if s.requires_grad] + list(self.params)
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
    """The graphed call as one autograd node: inputs are the call's tensors and the module's trainable parameters."""

    @staticmethod
    def forward(ctx: Any, call: GraphedCall, *tensors: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.call = call
        outs = call.forward(tensors[: len(call.inputs)])
        fixed = [o for o, d in zip(outs, call.diff) if not d]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        return (None, *ctx.call.backward(grads))


def module_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """The parameters and buffers a module's graphs address, named for messages."""
    return [*module.named_parameters(), *((f"buffer '{n}'", b) for n, b in module.named_buffers())]


def capture_call(name: str, forward: Callable[..., Any], module: nn.Module, leaves: list[Tensor], spec: Hashable,
                 backend: GraphBackend, pool: CapturePool, stream: Any, generators: GeneratorRegistry,
                 device_type: str, tally: ReplayTally) -> GraphedCall:
    """Capture ``forward`` (the module's own forward) for the call whose arguments flatten to ``leaves``/``spec``.

    Raises whatever the capture raised (a host read, a CPU tensor, a data-dependent shape), or a
    :class:`CaptureError` for what a graph of this module cannot repeat: an input written in place, a gradient of a
    tensor that is neither an input nor the module's own parameter, a non-tensor argument that cannot be rebuilt.
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
    params = tuple(p for p in module.parameters() if p.requires_grad) if grad else ()
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
                       lambda graph: pool.capture(graph, stream), lambda graph: backend.finish(graph, None))


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
