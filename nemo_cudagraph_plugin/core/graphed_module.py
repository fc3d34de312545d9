"""One module call's forward and backward as two graphs behind an ``autograd.Function``: the partial tier's unit.

:func:`capture_call` captures a module's forward for one input signature into a forward graph and, where anything
needs a gradient, the backward of that forward (``torch.autograd.grad`` of the outputs with respect to the inputs
that require a gradient and the module's own trainable parameters) into a backward graph, both in the memory pool of
the caller, as ``torch.cuda.make_graphed_callables`` does. :class:`GraphedCall` replays them:

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
from .backend import GraphBackend
from .buffers import flatten, unflatten, unflattener
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

    Attributes:
        state: ``name -> data_ptr`` of the module's parameters and buffers at capture (the graphs address them).
        keep: their storages: the memory the graphs address stays valid while this object lives.
    """

    def __init__(self, fwd: Any, bwd: Any, inputs: list[Tensor], params: tuple[Tensor, ...], out_spec: Hashable,
                 outs: list[Tensor], diff: list[bool], grad_outs: list[Tensor], grad_ins: tuple[Optional[Tensor], ...],
                 autograd_graph: list[Tensor], state: dict[str, int], keep: list[Any], tally: ReplayTally) -> None:
        self.fwd, self.bwd = fwd, bwd
        self.inputs, self.params = inputs, params
        self.outs, self.diff = outs, diff
        self.grad_outs = grad_outs
        # Kept here, so autograd's accumulation sees a tensor someone else holds and copies it (never adopts it).
        self.grad_ins = grad_ins
        self._autograd_graph = autograd_graph  # the outputs of the capture: their grad_fn keeps the activations
        self.state, self.keep = state, keep
        self.tally = tally
        self._build = unflattener(out_spec)

    def __call__(self, leaves: Sequence[Tensor]) -> Any:
        """The module's outputs for the call whose tensor arguments are ``leaves`` (hot path)."""
        if self.bwd is None:
            with torch.no_grad():
                return self._build(self.forward(leaves))
        return self._build(list(_Replay.apply(self, *leaves, *self.params)))

    def forward(self, leaves: Sequence[Tensor]) -> list[Tensor]:
        """Copy the inputs in, replay the forward graph, return the outputs in fresh memory."""
        dst = [s for s, t in zip(self.inputs, leaves) if s.data_ptr() != t.data_ptr()]
        if dst:
            copy_all(dst, [t for s, t in zip(self.inputs, leaves) if s.data_ptr() != t.data_ptr()])
        self._replay(self.fwd)
        fresh = [torch.empty_like(o) for o in self.outs]
        if fresh:
            copy_all(fresh, self.outs)
        return fresh

    def backward(self, grads: Sequence[Optional[Tensor]]) -> tuple[Optional[Tensor], ...]:
        """Copy the output gradients in, replay the backward graph; the inputs' and parameters' gradients."""
        for buf, g, d in zip(self.grad_outs, grads, self.diff):
            if d and buf.data_ptr() != g.data_ptr():
                buf.copy_(g)
        self._replay(self.bwd)
        return self.grad_ins

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
                 backend: GraphBackend, pool: Any, stream: Any, generators: GeneratorRegistry,
                 device_type: str, tally: ReplayTally) -> GraphedCall:
    """Capture ``forward`` (the module's own forward) for the call whose arguments flatten to ``leaves``/``spec``.

    Raises whatever the capture raised (a host read, a CPU tensor, a data-dependent shape), or a
    :class:`CaptureError` for what a graph of this module cannot repeat: an input written in place, a gradient of a
    tensor that is neither an input nor the module's own parameter, a non-tensor argument that cannot be rebuilt.
    """
    grad = torch.is_grad_enabled()
    with torch.no_grad():
        static = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in leaves]
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
    generators.apply(fwd)
    # Autocast's cache of cast weights would hand the graph a tensor of the eager step (freed later) or keep one of
    # the graph's pool for eager code: casts inside the graph are its own.
    with autocast_cache_disabled(), backend.capture(fwd, pool, stream):
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
    wrt = [s for s in static if s.requires_grad] + list(params)
    bwd = None
    grad_outs = [torch.empty_like(o) for o in outs]
    grad_ins: list[Optional[Tensor]] = [None] * len(static)
    if any(diff) and wrt:
        _check_leaves(name, [o for o, d in zip(outs, diff) if d], wrt)
        bwd = backend.new_graph()
        generators.apply(bwd)
        with backend.capture(bwd, pool, stream):
            got = torch.autograd.grad([o for o, d in zip(outs, diff) if d], wrt,
                                      grad_outputs=[g for g, d in zip(grad_outs, diff) if d],
                                      retain_graph=True, allow_unused=True)
        backend.finish(bwd, None)
        # The backward graph was captured before any output gradient existed: this first replay (the one a backend
        # makes right after a capture) computes nothing anyone reads; the call's own backward replays it again.
        bwd.replay()
        it = iter(got)
        grad_ins = [next(it) if needs else None for needs in [s.requires_grad for s in static] + [True] * len(params)]
    else:
        diff, params = [False] * len(outs), ()
    named = module_tensors(module)
    return GraphedCall(
        fwd, bwd, static, params, out_spec, outs, diff, grad_outs,
        tuple(None if g is None else g.detach() for g in grad_ins),
        outs, {n: t.data_ptr() for n, t in named}, [t.untyped_storage() for _, t in named], tally)


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
