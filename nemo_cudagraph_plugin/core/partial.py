"""The partial tier: graphs of the largest submodules that capture, when the whole step cannot be one graph.

:class:`PartialGraphs` wraps the ``forward`` of every module of a tree (any ``nn.Module``; for Lightning, the
``LightningModule``) and is told where each training step begins and ends (:meth:`PartialGraphs.step`). Framework
free: it knows modules, not trainers.

**Discovery.** The first ``warmup_steps`` steps run eagerly; every module call is counted and its input signature
noted. Then the largest modules are tried first: a module called exactly once per step is a candidate unless an
ancestor is one (a module the step never calls, or calls more than once, passes the question to its children). A
candidate's next call is captured (:func:`~.graphed_module.capture_call`: the forward graph at the call, the
backward graph at its backward; the graphs captured in one step share one memory pool, until a capture fails,
:class:`~.backend.CapturePool`).
Where the capture raises (a host read, a CPU tensor made in the forward, a data-dependent shape), the module's
reason is kept (the capture error with its file:line, :mod:`.errors`), its children become the candidates, and the
module runs eagerly in that same call, so its children are tried right away: one step resolves the whole tree (a
backward that does not capture gives that call's gradients eagerly; the children are tried from the next step).
The islands are the modules that failed and contain no graph, and the failed modules whose own code between graphed
children failed (reported once: a failure whose line a smaller island already names is not repeated).

**Guards**, before every step, as for whole-step graphs: the module tree's Python values (``training``, dropout
``p``, ``requires_grad``: :class:`~.module_state.ModuleStateWatch`) drop every graph; a parameter or buffer of a
graphed module at a new address drops that module's graphs (:func:`~.addresses.difference`). Per call: the input
signature (structure, non-tensor values, shapes, dtypes, strides, which tensors require a gradient, grad mode,
autocast) is the key of a graph; a new key gets one eager call, then a capture, bounded by ``max_graphs`` per
module (``on_cache_full``). Generators registered with the tier advance with each replay, as the default one does.

**Not graphed here:** the code outside modules (a loss computed in ``training_step``) and the islands: they run
eagerly, as written. The optimizer side of the step (clipping and the update) is one graph of its own where the owner
asks for it (:meth:`PartialGraphs.graph_optimizer`, :mod:`.partial_optimizer`).

**Gradients.** A graphed module's backward graph adds its parameters' gradients into ``.grad`` itself where that is
exactly what autograd's accumulation would do (:class:`~.graphed_module.GradAccumulation`: the parameter's only
gradient in the backward, the module called once in the step, no hook on the parameter, a ``.grad`` that stays where
it is, as this tier's owner keeps it by zeroing in place); elsewhere autograd adds them, one kernel per parameter
outside the graphs.

**Verification** (``verify_steps``, driven by the engine the whole step handed over to): a step whose graphs all
replay may also run once with every graph set aside (:meth:`PartialGraphs.eager`: the modules' own forwards, the
optimizer's own step), from the same state, which the engine then restores; that run changes nothing the tier found
or counts. :meth:`PartialGraphs.may_replay_only` says before a step whether it may be such a step,
:meth:`PartialGraphs.replayed_only` after it whether it was.

**Coverage** (:class:`~.config.PartialStats`): the graphed modules, the islands with their reasons, the share of
the step's modules inside graphs, the share of its operators (as the dispatcher sees them: one eager step against
one step whose graphs all replayed), and how many parameters' gradients are accumulated inside graphs (those left to
autograd for good, with why).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Hashable, Iterator
from typing import Any, Optional

import torch
from torch import nn

from ._torch_compat import (
    ObservingMode,
    autocast_cache_disabled,
    autocast_state,
    compiled_runs_under_modes,
    compiler_of,
    is_compiled,
)
from .addresses import difference
from .backend import CapturePool, GraphBackend, default_backend
from .buffers import capture_layout, flatten, signature_of, unflatten
from .config import CaptureConfig, CaptureStats, PartialStats
from .errors import CaptureError, capture_error_from, root_cause
from .graph_cache import GraphCache
from .graphed_module import GradAccumulation, GraphedCall, ReplayTally, capture_call, module_tensors
from .module_state import ModuleStateWatch
from .partial_optimizer import OptimizerGraph
from .rng import GeneratorRegistry

__all__ = ["PartialGraphs"]

# A module's place in the tier.
_WATCH = "watch"  # warm-up: counted, its signatures noted, eager
_OPENED = "opened"  # inside compiled code split open: counted as in the warm-up (:meth:`PartialGraphs._open`)
_EAGER = "eager"  # not graphed itself (never called, called more than once per step, or split): its children decide
_CANDIDATE = "candidate"  # its next call of a known signature is captured
_GRAPHED = "graphed"  # its calls replay its graphs
_INSIDE = "inside"  # inside a graphed module: its calls are part of that module's graphs
_SPLIT = "split"  # its capture failed: it runs eagerly, its children are candidates


class _Node:
    __slots__ = ("name", "module", "forward", "parent", "children", "calls", "per_step", "status", "reason",
                 "location", "cache", "seen", "host_s", "compiled", "compiler", "plain", "restore")

    def __init__(self, name: str, module: nn.Module, parent: Optional[_Node], max_graphs: int,
                 compiler: Any = None) -> None:
        self.name, self.module, self.parent = name, module, parent
        self.forward: Any = None  # the call the tier makes (None: not wrapped, or not yet)
        #: inside a compiled module: what compiles this module's calls once the compiled code around it is split open
        #: (:meth:`PartialGraphs._open`); until then the tier leaves it alone (dynamo traces it as the user's code)
        self.compiler = compiler
        self.plain: Any = None  # a node running compiled code that can be split open: its own call, uncompiled
        self.restore: Any = None  # the instance ``forward`` that close() gives back (None: it had none)
        self.children: list[_Node] = []
        self.calls = 0  # this step
        self.per_step = 0  # in the last warm-up step (for a submodule of compiled code split open: once counted)
        self.status = _WATCH
        self.reason: Optional[str] = None
        self.location: Optional[str] = None
        self.cache: GraphCache[GraphedCall] = GraphCache(max_graphs)
        self.seen: set[Hashable] = set()
        self.host_s = 0.0  # its own code's host time in the step whose islands are timed
        self.compiled = is_compiled(module)  # its calls run compiled code (torch.compile's, or the tier's, opened)


class _OpCounter(ObservingMode):
    """Counts the operators dispatched outside graph replays (a graph's replay launches none of its own on CUDA; the
    CPU stand-in's replay re-runs operators, which ``tally.inside`` tells apart)."""

    def __init__(self, tally: ReplayTally) -> None:
        super().__init__()
        self.tally = tally
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if not self.tally.inside:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _as_captured(compiled: Any) -> Any:
    """torch.compile's call with autocast's cache off on every call through the tier, as a capture has it: dynamo
    guards on that switch, so one state compiles once and never inside a capture (where Inductor's first run of its
    kernels cannot be captured). Compiled code casts in its own kernels; only a graph break's eager code casts anew."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with autocast_cache_disabled():
            return compiled(*args, **kwargs)

    call.__wrapped__ = compiled  # type: ignore[attr-defined]
    return call


class PartialGraphs:
    """Graphs of the largest capturable submodules of ``root``, found and kept current by the tier itself.

    Args:
        root: the module tree (its ``forward`` and every submodule's are wrapped until :meth:`close`).
        config: the options (``warmup_steps``, ``max_graphs``, ``on_cache_full``).
        warmup_steps: eager steps before the first captures (default ``config.warmup_steps``; at least 1: the calls
            of one eager step are what discovery starts from).
        device: the device the step runs on.
        backend: the device interface (default: CUDA graphs, from ``config``).
        generators: extra generators registered with every graph.
        stats: the counters to report into (``stats.partial``).
    """

    def __init__(self, root: nn.Module, config: CaptureConfig, device: torch.device, *,
                 backend: Optional[GraphBackend] = None, generators: Optional[GeneratorRegistry] = None,
                 stats: Optional[CaptureStats] = None, warmup_steps: Optional[int] = None) -> None:
        self.root = root
        self.config = config
        self.device = device
        self.backend = default_backend(backend, config)
        self.generators = generators or GeneratorRegistry(self.backend.device_type)
        self.stats = stats or CaptureStats()
        self.report = self.stats.partial = PartialStats()
        self.tally = ReplayTally()
        #: which parameters' gradients the backward graphs add into ``.grad`` themselves
        self.grads = GradAccumulation(root, device)
        self.grads.on_change = self._changed
        self.watch = ModuleStateWatch(root)
        self.nodes: list[_Node] = []
        self._warmup_left = max(1, config.warmup_steps if warmup_steps is None else warmup_steps)
        self._in_step = False  # a step of the tier is running (and not inside eager(): graphs set aside)
        self._capturing = 0
        self._pool = CapturePool(self.backend, self._graphs_live)
        self._stream: Any = None
        self._events = 0  # captures, failures and eager calls of graphed modules this step
        self._step_no = 0  # steps of the tier begun (a graph replayed with gradients once per step)
        self._counter: Optional[_OpCounter] = None  # this step's operator counter (None: not counted)
        self._opt_events = 0  # the optimizer graph's events when this step began
        self._replays_at = 0  # the tier's replays (modules' and optimizer's) when this step began
        self._measure: Optional[str] = None
        self._timing = False  # this step's calls are timed (the islands' host time)
        self._inner_s: list[float] = []  # per timed call being run: the time of the calls inside it so far
        #: submodules of compiled code split open, by the step they were opened in: counted, then made candidates
        #: (:meth:`_open`)
        self._opened: list[tuple[int, list[_Node]]] = []
        #: the optimizer side of the step as one graph (:meth:`graph_optimizer`); ``None``: it runs eagerly
        self.optimizer: Optional[OptimizerGraph] = None
        self._build(root)

    # ------------------------------------------------------------------------------------------
    # the module tree
    # ------------------------------------------------------------------------------------------
    def _build(self, root: nn.Module) -> None:
        def visit(name: str, module: nn.Module, parent: Optional[_Node], compiler: Any) -> None:
            node = _Node(name, module, parent, self.config.max_graphs, compiler)
            if parent is not None:
                parent.children.append(node)
            self.nodes.append(node)
            if compiler is None:
                self._install(node)
            inner = module
            if node.compiled:
                # what torch.compile compiles runs as one opaque call: its submodules are nodes of the tier only once
                # a host read inside the compiled code splits it open (never where nothing can compile them)
                compiler = compiler_of(module)
                if compiler is None:
                    return
                inner = module._orig_mod  # named as the user's module tree has them, without the wrapper's name
            for child_name, child in inner.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child, node, compiler)

        visit("", root, None, None)

    def _install(self, node: _Node) -> bool:
        """Wrap ``node``'s ``forward`` (an instance attribute: ``nn.Module.__call__`` calls it); ``False`` for a
        module the tier does not call (a container without ``forward``, one whose instance has its own)."""
        if node.forward is not None:
            return True
        module = node.module
        own = module.__dict__.get("forward")
        if node.compiled and callable(own):
            # torch.compile's wrapper keeps the compiled call as its instance's ``forward``: the call is graphed as one
            # module (Inductor's kernels inside our graphs); split open, the module runs uncompiled around its
            # submodules, each compiled alone
            # (split open only where _build found a compiler for its submodules: it then has children)
            node.restore, call, node.plain = own, own, module._orig_mod.__call__
        elif own is None and type(module).forward is not nn.Module.forward:
            call = module.forward
            if node.compiler is not None:  # inside compiled code split open: this module's own code, compiled alone
                node.plain, call = call, node.compiler(call)
                node.compiled = True
        else:
            return False
        # compiled calls run as a capture has them (_as_captured): one compile, outside any capture
        node.forward = _as_captured(call) if node.compiled else call
        module.forward = self._wrapper(node)
        return True

    def _wrapper(self, node: _Node) -> Any:
        call = self._call

        def forward(*args: Any, **kwargs: Any) -> Any:
            return call(node, args, kwargs)

        forward.__wrapped__ = node.forward  # type: ignore[attr-defined]
        return forward

    def graph_optimizer(self, optimizer: torch.optim.Optimizer, named_params: list[tuple[str, torch.Tensor]],
                        tensors: Any, on_capture: Any = lambda: None,
                        before_update: Any = lambda: None) -> OptimizerGraph:
        """Graph the optimizer side of each step (:class:`~.partial_optimizer.OptimizerGraph`: deferred clipping and
        the update, in this tier's memory pool, after its warm-up); given back by :meth:`close`."""
        self.optimizer = OptimizerGraph(
            optimizer, named_params, tensors, self.backend, self.device, stream=lambda: self._stream,
            pool=self._pool, tally=self.tally, report=self.report,
            active=lambda: self._in_step and self._warmup_left == 0, on_capture=on_capture,
            before_update=before_update, drop_untouched=self.grads.drop_untouched)
        return self.optimizer

    def _graphs_live(self) -> bool:
        return any(len(n.cache) for n in self.nodes) or (self.optimizer is not None and bool(self.optimizer.graphs))

    def close(self) -> None:
        """Give every module its own ``forward`` and the optimizer its ``step`` back, drop the graphs (idempotent)."""
        if self.optimizer is not None:
            self.optimizer.close()
        for node in self.nodes:
            if node.forward is not None and node.module.__dict__.get("forward") is not None:
                if node.restore is not None:
                    node.module.__dict__["forward"] = node.restore  # torch.compile's own instance forward
                else:
                    del node.module.__dict__["forward"]
            node.forward = None
            node.cache.clear()
        self.nodes = []
        self.grads.close()

    # ------------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one whole training step: guards before it, the tier's bookkeeping after it."""
        warm = self._warmup_left > 0
        # Graphs captured in this step replay, in later steps, in the order of their capture, among graphs of other
        # steps: they share no pool with those (a pool hands a capture the memory of earlier captures' temporaries,
        # which an earlier graph replayed in between would overwrite).
        self._pool.seal()
        if not warm:
            if any(n.status == _WATCH for n in self.nodes):
                self._assign(self.nodes[0])
            self._guards()
        for node in self.nodes:
            node.calls = 0
        self._step_no += 1
        self._events = 0
        self.grads.begin_step()
        measure = "step" if self._warmup_left == 1 else ("outside" if self._measure == "outside" else None)
        counter = _OpCounter(self.tally) if measure is not None and self._countable() else None
        # The step whose graphs all replay is also the one whose islands are timed (the other steps time nothing).
        self._timing = measure == "outside"
        if self._timing:
            for node in self.nodes:
                node.host_s = 0.0
        be = self.backend
        if self._stream is None:
            self._stream = be.side_stream(self.device)
        # Warm-up steps run on the stream the graphs are captured on, as the whole-step tier's do: the libraries'
        # per-stream state (cuBLAS workspaces) is then made before any capture, outside the graph pool.
        cur = be.current_stream(self.device) if warm else None
        opt_events = 0
        if self.optimizer is not None:
            self.optimizer.begin_step()
            opt_events = self.optimizer.events
        self._opt_events = opt_events
        self._replays_at = self.tally.replays + self.report.optimizer_replays
        self._counter = counter
        self._in_step = True
        try:
            with contextlib.ExitStack() as stack:
                if cur is not None:
                    self._stream.wait_stream(cur)
                    stack.callback(cur.wait_stream, self._stream)
                    stack.enter_context(be.use_stream(self._stream))
                if counter is not None:
                    stack.enter_context(counter)
                yield
        finally:
            self._in_step = False
            self._counter = None
        if self.optimizer is not None:
            self._events += self.optimizer.events - opt_events
        if warm:
            self._warmup_left -= 1
            for node in self.nodes:
                node.per_step = node.calls
            if counter is not None:
                self.report.ops_step = counter.count
            self.report.modules_called = sum(1 for n in self.nodes if n.per_step)
        elif counter is not None and self._events == 0:
            self.report.ops_outside = counter.count
            by_name = {n.name: n for n in self.nodes}
            self.report.island_host_ms = {k: by_name[k].host_s * 1e3 for k in self.report.islands if k in by_name}
            self._measure = None
        self._timing = False
        if self._opened:
            self._assign_opened()
        if not warm and self._events:
            self._measure = "outside"  # measured on the next step whose graphs all replay
            self._summarize()
        self.watch.rebase()  # what the step's own Python set is the state its graphs were captured with

    def _countable(self) -> bool:
        """Whether the step's operators can be counted: torch before 2.9 would run a compiled module uncompiled under
        the counter, and from then on (its coverage then stays unmeasured)."""
        return compiled_runs_under_modes() or not any(n.compiled for n in self.nodes)

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Inside a step of the tier, every graph set aside for the block (``verify_steps``' eager half): each module
        runs its own ``forward``, neither counted, timed nor captured (no signature noted, no replay); the optimizer's
        step runs eagerly with the framework's clipping not deferred (:meth:`OptimizerGraph.eager
        <.partial_optimizer.OptimizerGraph.eager>`); the operators the block dispatches are not counted. Nothing the
        tier found or counts changes; outside the block nothing is checked (the modules' calls test the flag they test
        anyway)."""
        in_step, self._in_step = self._in_step, False
        counter = self._counter
        counted = counter.count if counter is not None else 0
        try:
            with self.optimizer.eager() if self.optimizer is not None else contextlib.nullcontext():
                yield
        finally:
            self._in_step = in_step
            if counter is not None:
                counter.count = counted

    def may_replay_only(self) -> bool:
        """Whether the step running now may replay graphs and nothing else (``verify_steps``; checked before its
        calls, and by :meth:`replayed_only` after them): past the warm-up, no module left to try, a graph to replay."""
        return (self._in_step and self._warmup_left == 0 and self._graphs_live()
                and not any(n.status is _WATCH or n.status is _OPENED or n.status is _CANDIDATE for n in self.nodes))

    def replayed_only(self) -> bool:
        """Whether the step running now has so far replayed graphs of the tier and done nothing else of the tier's:
        no capture (a module's forward, backward or gradient additions, the optimizer side), no failed capture, no
        eager call of a graphed module, no eager first step of an optimizer key, no parameter leaving in-graph
        accumulation: a step whose graphs all replayed, as the one whose operators are counted."""
        opt = self.optimizer
        opt_events = opt.events - self._opt_events if opt is not None else 0
        replays = self.tally.replays + self.report.optimizer_replays
        return self._events == 0 and opt_events == 0 and replays > self._replays_at

    def _assign(self, node: _Node) -> None:
        """Make ``node`` a candidate if the step calls it exactly once, else pass the question to its children."""
        if node.forward is not None and node.per_step == 1:
            node.status = _CANDIDATE
            for d in self._descendants(node):
                d.status = _INSIDE
            return
        node.status = _EAGER
        for child in node.children:
            self._assign(child)

    def _descendants(self, node: _Node) -> Iterator[_Node]:
        for child in node.children:
            yield child
            yield from self._descendants(child)

    def _guards(self) -> None:
        why = self.watch.changed()
        if why is not None:
            self.invalidate(f"{why} (a replay runs no Python, so it would keep the captured value)")
        moved = []
        for node in self.nodes:
            if not len(node.cache):
                continue
            now = {n: t.data_ptr() for n, t in module_tensors(node.module)}
            for key in list(node.cache.keys()):
                why = difference(node.cache.peek(key).state, False, now)
                if why is not None:
                    node.cache.pop(key)
                    node.seen.discard(key)
                    moved.append((node.name, why))
        if moved:
            self.stats.recaptures += len(moved)
            warnings.warn(f"CUDA graphs of module '{moved[0][0]}' re-captured ({len(moved)} graphs): {moved[0][1]}",
                          stacklevel=4)

    def invalidate(self, reason: str) -> None:
        """Drop every module's graphs (a module value they bake in changed; the optimizer's graph reads none); each
        graphed module's next call of a signature runs eagerly, the one after captures."""
        dropped = sum(len(n.cache) for n in self.nodes)
        for node in self.nodes:
            node.cache.clear()
            node.seen.clear()
        if dropped:
            self.stats.recaptures += dropped
            warnings.warn(f"CUDA graphs of modules re-captured: {reason}", stacklevel=4)

    # ------------------------------------------------------------------------------------------
    # one module call (hot path: a key, a lookup, a replay)
    # ------------------------------------------------------------------------------------------
    def _call(self, node: _Node, args: tuple, kwargs: dict) -> Any:
        if not self._in_step or self._capturing:
            return node.forward(*args, **kwargs)
        if self._timing:
            return self._timed(node, args, kwargs)
        return self._dispatch(node, args, kwargs)

    def _timed(self, node: _Node, args: tuple, kwargs: dict) -> Any:
        """A call in the timed step: the host time of the module's own code, its submodules' calls left out."""
        inner = self._inner_s
        inner.append(0.0)
        t0 = time.perf_counter()
        try:
            return self._dispatch(node, args, kwargs)
        finally:
            dt = time.perf_counter() - t0
            node.host_s += dt - inner.pop()
            if inner:
                inner[-1] += dt

    def _dispatch(self, node: _Node, args: tuple, kwargs: dict) -> Any:
        node.calls += 1
        status = node.status
        if status is _EAGER or status is _INSIDE or status is _SPLIT:
            return node.forward(*args, **kwargs)
        leaves, spec = flatten((args, kwargs))
        key = (signature_of(leaves, spec), tuple(t.requires_grad for t in leaves), torch.is_grad_enabled(),
               autocast_state(self.backend.device_type))
        if status is _WATCH or status is _OPENED:
            node.seen.add(key)
            if status is _OPENED:
                self._events += 1  # a module not yet tried runs eagerly: not a step whose graphs all replay
            return self._before_capture(node, leaves, spec, args, kwargs)
        entry = node.cache.get(key)
        if entry is not None:
            if entry.last_step == self._step_no and entry.needs_grad and torch.is_grad_enabled():
                # The same graph again in one step: its replay would overwrite the activations the first call's
                # backward reads (the graph's static memory). This call runs eagerly; the first keeps them.
                self._eager_call("called again in the step")
                return node.forward(*args, **kwargs)
            entry.last_step = self._step_no
            self.report.replays += 1
            return entry(leaves)
        if key not in node.seen:
            # A new signature runs eagerly once (lazy state and library plans are made outside the graph pool).
            node.seen.add(key)
            self._eager_call("new-signature warm-up")
            return self._before_capture(node, leaves, spec, args, kwargs)
        if node.cache.full():
            if self.config.on_cache_full == "eager":
                self._eager_call("graph cache full")
                return node.forward(*args, **kwargs)
            node.cache.evict_lru()
        return self._capture(node, key, leaves, spec, args, kwargs)

    @staticmethod
    def _before_capture(node: _Node, leaves: list, spec: Hashable, args: tuple, kwargs: dict) -> Any:
        """An eager call of a module its next call of this signature captures. A compiled module gets its inputs as
        the capture will (:func:`~.buffers.capture_layout`), so that dynamo compiles now for what the capture runs."""
        laid = capture_layout(leaves) if node.compiled else None
        if laid is not None:
            try:
                args, kwargs = unflatten(spec, laid)
            except ValueError:  # an argument the capture cannot rebuild either: that capture fails, at its line
                pass
        return node.forward(*args, **kwargs)

    def _changed(self) -> None:
        """A backward graph or a graph that adds parameters' gradients into ``.grad`` was captured, or a parameter left
        in-graph accumulation: this step is not one whose graphs all replayed (operators counted, ``verify_steps``)."""
        self._events += 1

    def _eager_call(self, reason: str) -> None:
        self._events += 1
        calls = self.report.eager_calls
        calls[reason] = calls.get(reason, 0) + 1

    def _capture(self, node: _Node, key: Hashable, leaves: list, spec: Hashable, args: tuple, kwargs: dict) -> Any:
        be = self.backend
        self._events += 1
        # A failed capture must leave the step as if it had not been tried: the generators' draws and the module's
        # buffers (a backend that runs while it captures writes them) are put back before the eager call.
        rng = (be.rng_state(self.device), self.generators.states())
        buffers = [(b, b.clone()) for b in node.module.buffers()]
        self._capturing += 1
        failure: Optional[BaseException] = None
        try:
            entry = capture_call(node.name, node.forward, node.module, leaves, spec, be, self._pool, self._stream,
                                 self.generators, be.device_type, self.tally, self.grads)
        except Exception as exc:  # noqa: BLE001 - every capture failure makes the module eager, with its reason
            failure = exc
        finally:
            self._capturing -= 1
        if failure is not None:
            be.set_rng_state(rng[0], self.device)
            self.generators.set_states(rng[1])
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            what = f"module '{node.name}'"
            err = failure if isinstance(failure, CaptureError) else capture_error_from(root_cause(failure), what)
            return self._failed(node, err, what, args, kwargs)  # its children are tried in this eager call
        entry.on_failure = lambda exc: self._backward_failed(node, exc)
        entry.alone = lambda: node.calls == 1  # a second call of the module in the step is a second contribution
        entry.on_capture = self._changed
        node.cache.put(key, entry)
        entry.last_step = self._step_no
        if node.status is not _GRAPHED:
            node.status = _GRAPHED
        self.report.captures += 1
        return entry(leaves)

    def _failed(self, node: _Node, err: CaptureError, what: str, args: tuple, kwargs: dict) -> Any:
        """``node`` cannot be a graph: it runs eagerly from now on, and its children are tried in this very call."""
        self._split(node, err, what)
        return node.forward(*args, **kwargs)

    def _backward_failed(self, node: _Node, exc: BaseException) -> None:
        """The backward of a captured forward did not capture (its gradients this once came eagerly): the module is
        not a graph from the next step on; its children are tried in their next calls."""
        what = f"module '{node.name}' (backward)"
        self._events += 1
        self._split(node, exc if isinstance(exc, CaptureError) else capture_error_from(root_cause(exc), what), what)

    def _split(self, node: _Node, err: CaptureError, what: str) -> None:
        node.status = _SPLIT
        # "file:line: what it does there" (the capture error's first line, without its generic words)
        node.reason = str(err).splitlines()[0].replace(f"cannot capture the training step into a CUDA graph ({what}): ",
                                                       "")
        node.location = err.location
        node.cache.clear()
        if node.plain is not None and node.children:
            self._open(node)
            return
        for child in node.children:
            self._assign(child)

    def _open(self, node: _Node) -> None:
        """Split open a module whose compiled code did not capture (a host read inside it, or anything else a graph
        cannot hold): from now on its own code runs uncompiled, as written, and each submodule it calls is compiled
        alone with the same ``torch.compile`` settings, so that the host read is an island of the module's own code
        and the submodules around it are graphs with Inductor's kernels. The submodules are counted until the end of a step they ran in
        (:meth:`_assign_opened`), then made candidates; their first calls compile them, outside any capture.

        Inductor then fuses within each submodule rather than across them: the losses may differ from the whole
        module's compile by rounding, as any two compiles of one model may. Said once, for the user's compiled
        module; every module split open is listed in ``stats.partial.compiled_apart``."""
        node.forward = node.plain
        opened: list[_Node] = []

        def frontier(n: _Node) -> None:
            if self._install(n):
                n.status = _OPENED
                opened.append(n)
                return
            n.status = _EAGER  # a container never called itself (ModuleList): its children are called
            for c in n.children:
                frontier(c)

        for child in node.children:
            frontier(child)
        self._opened.append((self._step_no, opened))
        self.report.compiled_apart.append(node.name)
        if node.compiler is None:  # the user's torch.compile wrapper (the modules below it are the tier's compiles)
            warnings.warn(
                f"module '{node.name or '<root>'}' is compiled with torch.compile and its compiled code cannot be one "
                f"graph ({node.reason}): its submodules are compiled one by one with its torch.compile settings and "
                "graphed where they capture, its own code runs uncompiled. Inductor then fuses within each submodule, "
                "so losses may differ from the whole module's compile by rounding.", stacklevel=5)

    def _assign_opened(self) -> None:
        """At the end of a step, the submodules counted since they were opened: made candidates (or passed to their
        children). Those opened in this step's forward ran after it in this step (the module split open is called
        once in a step, and runs them); those opened in its backward did not, and are counted over the next step."""
        waiting = []
        for step, nodes in self._opened:
            if step == self._step_no and not any(n.calls for n in nodes):
                waiting.append((step, nodes))
                continue
            for n in nodes:
                n.per_step = n.calls
                self._assign(n)
        self._opened = waiting

    # ------------------------------------------------------------------------------------------
    # coverage
    # ------------------------------------------------------------------------------------------
    def _summarize(self) -> None:
        rep = self.report
        graphed = [n for n in self.nodes if n.status is _GRAPHED]
        rep.modules_called = sum(1 for n in self.nodes if n.per_step)  # with the submodules of compiled code opened
        rep.graphed = [n.name for n in graphed]
        inside = {id(d) for n in graphed for d in self._descendants(n)} | {id(n) for n in graphed}
        rep.modules_graphed = sum(1 for n in self.nodes if n.per_step and id(n) in inside)
        rep.grads_in_graphs = len({id(p) for n in graphed for k in n.cache.keys()
                                   for _, p, _ in n.cache.peek(k).accumulated})
        rep.grads_outside = {name: why for _, name, why in self.grads.outside.values()}
        islands: dict[str, str] = {}
        for node in self.nodes:
            if node.status is not _SPLIT:
                continue
            below = list(self._descendants(node))
            split_below = [d for d in below if d.status is _SPLIT]
            # One island per line: a failure whose line a smaller island names is that island's.
            if node.location is not None and any(d.location == node.location for d in split_below):
                continue
            if split_below or any(d.status is _GRAPHED for d in below):
                islands[node.name] = f"its own code (not its submodules): {node.reason}"
            else:
                islands[node.name] = node.reason or ""
        rep.islands = islands
