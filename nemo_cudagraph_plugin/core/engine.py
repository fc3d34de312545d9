"""The capture engine: eager warm-up, capture, and replay of a whole training step.

Framework-free: the engine is handed a step function ``fn(batch) -> outputs`` that performs one
complete training step (zero-grad, forward, backward, clipping, optimizer step — whatever the
caller puts in it) and decides, per call, whether to run it eagerly, capture it, or replay a
graph captured earlier for the same key.

**The key** of a graph is everything it baked in that can differ between steps, and it is the
only thing compared before a replay::

    (input signature, step key)
     input signature = structure of the batch, its non-tensor leaves, each tensor's
                       shape/dtype/device/stride                        (buffers.signature_of)
     step key        = what the adapter says the step depends on as Python values; for
                       Lightning: zero_grad?, optimizer step?, accumulate_grad_batches,
                       gradient clipping value/algorithm, precision    (lightning._compat.step_key)

Values a graph bakes in that are *not* in the key are checked by **guards** run before every
step — eager, capture or replay — so a capture never freezes a value a guard would have fixed:
for Lightning, the optimizer's learning rate (a device tensor the guard keeps current) and every
other float hyperparameter (a change re-captures; a scheduled change is refused).

Lifecycle of one key::

    eager warm-up (side stream) -> [last warm-up with sync check] -> capture -> replay, replay, ...

What is captured: every device kernel and copy ``fn`` launches on the capture stream. What is
not: Python side effects of ``fn`` (counters, hooks, prints) run once, at capture; the caller
repeats what it needs after each replay (``after_replay``). Hazards covered here:

* inputs at fixed addresses: :class:`~.buffers.StaticInputs`, copied in before each replay;
* outputs overwritten by the next replay: tensor outputs are copied into fresh memory after every replay;
* those two copies are kernel nodes of the graph itself where the backend can add them (``io_in_graph``): the
  first node copies the batch in from where it lies, the last ones copy the outputs into memory allocated for
  this step; their addresses are set before each replay (:meth:`GraphEntry.replay`). Elsewhere each is a launch
  of its own around the graph;
* host syncs inside the step: the last warm-up runs with sync errors on and failures are
  reported at the user's file:line (:mod:`.errors`);
* re-allocated state: each graph records the address of every tensor it reads or writes across
  steps (parameters, gradients, optimizer state, buffers) and keeps that memory alive. Before a
  replay the parameters' addresses are compared (swaps such as ``p.data = ...``, ``module.to``,
  ``torch.utils.swap_tensors``, EMA weight swaps); gradients, optimizer state and buffers are
  watched by weak references (replacing one marks the engine dirty) and compared in full when
  dirty and after every eager step (state created later, e.g. a gradient that first appears for a
  longer sequence, makes the graphs captured without it stale). A mismatch drops those graphs
  (one warning) and they are captured again;
* gradients owned by the graph: a step that zeroes gradients and steps the optimizer
  (``fresh_grads=True``: nothing accumulates across steps) is captured with the gradients set to
  ``None`` first, as ``zero_grad(set_to_none=True)`` leaves them in eager training. Backward then
  writes them fresh into the graph's memory (no zeroing kernel, no accumulation kernel per
  parameter; the previous step's gradients are released, not kept, so the capture's peak holds one
  set of gradients as eager's does), and a parameter without a gradient in this step is skipped by
  the optimizer exactly as in eager training. Such a graph depends on no gradient address; its gradients are temporaries
  of the shared pool, so after a replay ``param.grad`` holds this step's gradients only when it is
  the most recently captured graph (read gradients inside the step, e.g. in
  ``on_before_optimizer_step``);
* random numbers: the default generator is advanced per replay by the backend; extra generators
  are registered through :class:`~.rng.GeneratorRegistry`;
* ``verify_steps``: the eager half records every tensor it writes (and the adapter's
  ``mutable_tensors``, generators, host counters) and restores them before the graph's step
  runs, so verification leaves training exactly as an unverified run.
"""

from __future__ import annotations

import contextlib
import operator
import time
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ._torch_compat import copy_all
from .adapter import Guard, Named, StepAdapter, StepFunctions
from .backend import GraphBackend, default_backend
from .buffers import StaticInputs, flatten, signature_of, unflattener
from .config import CaptureConfig, CaptureStats
from .errors import CaptureError, ParityError, capture_error_from
from .graph_cache import GraphCache
from .rng import GeneratorRegistry

__all__ = ["CaptureEngine", "GraphEntry"]

StepFn = Callable[[Any], Any]

_data_ptr = Tensor.data_ptr
_call = operator.call


@dataclass(eq=False)
class GraphEntry:
    """One captured step: its graph, input buffers, static outputs and what it depends on."""

    graph: Any
    inputs: StaticInputs
    out_spec: Hashable
    out_leaves: list[Tensor]
    key: Hashable
    #: (name, data_ptr) of every tensor the graph reads or writes across steps, at capture
    state: dict[str, int]
    #: the storages of those tensors: the memory the graph addresses stays valid while it exists
    keep: list[Any]
    #: the graph writes the gradients fresh (captured with them set to None first)
    owns_grads: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    #: the graph's own copy nodes for the batch and the outputs (``GraphBackend.finish``); None: launches around it
    io: Any = None

    def __post_init__(self) -> None:
        self._build = unflattener(self.out_spec)  # decided once: outputs() runs after every replay

    def replay(self, leaves: list[Tensor]) -> Any:
        """Replay on the batch ``leaves``; this step's outputs, in fresh memory (hot path)."""
        io = self.io
        if io is None:
            self.inputs.copy_from(leaves)
            self.graph.replay()
            return self.outputs()
        # The graph copies the batch in from where it lies and its outputs into this memory: no launch of ours.
        fresh = [torch.empty_like(t) for t in self.out_leaves]
        io.bind(leaves, fresh)
        self.graph.replay()
        return self._build(fresh)

    def outputs(self) -> Any:
        """This replay's outputs in fresh memory: the next replay overwrites the static outputs, and a user may keep
        this step's loss. One copy launch for all of them (a clone each would be a launch each on the step's
        stream)."""
        leaves = self.out_leaves
        fresh = [torch.empty_like(t) for t in leaves]
        if fresh:
            copy_all(fresh, leaves)
        return self._build(fresh)


class _Flag:
    """A mutable bool that weak-reference callbacks can set without keeping the engine alive."""

    __slots__ = ("dirty",)

    def __init__(self) -> None:
        self.dirty = False


class CaptureEngine:
    """Runs a training step eagerly, captures it, or replays it.

    Args:
        config: options (warm-up, cache size, error policy, verification).
        device: the device the step runs on.
        named_params: the model's trainable ``(name, parameter)`` pairs.
        adapter: what the framework tells the engine about its steps (:class:`~.adapter.StepAdapter`: the state
            the step reads and writes, guards, hazard checks, what to repeat after a replay); its per-step members
            are bound here, once. Default: nothing besides the parameters (:class:`~.adapter.StepFunctions`).
        generators: extra generators to register with each graph.
        stats: counters to update (one shared :class:`CaptureStats` per trainer).
        backend: the device interface. Default: a :class:`~.backend.CudaBackend` built from ``config``'s
            ``memsets_as_kernels`` and ``io_in_graph``, which it decides once (what the option asks and what
            torch and the driver allow); a backend passed in carries its own choice of both.
    """

    def __init__(
        self,
        config: CaptureConfig,
        device: torch.device,
        named_params: Sequence[tuple[str, Tensor]],
        adapter: Optional[StepAdapter] = None,
        *,
        generators: Optional[GeneratorRegistry] = None,
        stats: Optional[CaptureStats] = None,
        backend: Optional[GraphBackend] = None,
    ) -> None:
        self.backend = default_backend(backend, config)
        if device.type != self.backend.device_type:
            raise ValueError(f"CaptureEngine needs a {self.backend.device_type.upper()} device, got {device}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.config = config
        self.device = device
        self.named_params = list(named_params)
        self.adapter: StepAdapter = adapter if adapter is not None else StepFunctions()
        # The adapter's members, bound once: a replay calls them without looking anything up.
        a = self.adapter
        self.state_fn: Callable[[], Sequence[Named]] = a.state_tensors
        self.watched_fn: Callable[[], Sequence[tuple[str, Tensor]]] = a.watched_tensors
        self.mutable_fn: Callable[[], Sequence[Tensor]] = a.mutable_tensors
        self.host_state: Callable[[], Callable[[], None]] = a.host_state
        self.guards: list[Guard] = list(a.guards())
        self.after_replay: Optional[Callable[[GraphEntry], None]] = a.after_replay
        self.on_capture: Optional[Callable[[GraphEntry], None]] = a.on_capture
        self.generators = generators or GeneratorRegistry()
        self.stats = stats or CaptureStats()
        self.cache: GraphCache[GraphEntry] = GraphCache(config.max_graphs)
        self.disabled_reason: Optional[str] = None
        self._flag = _Flag()
        self._pool: Any = None
        self._stream: Any = None
        self._warmup_left = config.warmup_steps
        self._seen: set[Hashable] = set()
        self._verify_left = config.verify_steps
        # Per-replay address check: every parameter (trainable and frozen) and its address at capture.
        self._scan: list[Tensor] = [p for _, p in self.named_params]
        self._scan_ptrs: list[int] = list(map(_data_ptr, self._scan))

    # ------------------------------------------------------------------------------------------
    # public entry
    # ------------------------------------------------------------------------------------------
    @property
    def dirty(self) -> bool:
        """Something a graph depends on may have been re-allocated: check addresses before a replay."""
        return self._flag.dirty

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self._flag.dirty = value

    def step(
        self,
        batch: Any,
        key: Hashable,
        fn: StepFn,
        quiet_fn: Optional[StepFn] = None,
        fresh_grads: bool = False,
    ) -> Any:
        """Run one training step on ``batch``.

        Args:
            batch: the step's input (nested tensors); copied into static buffers on replay.
            key: the step key: every Python value the step depends on besides the batch (see the
                module docstring). Steps of different keys never share a graph.
            fn: performs the step eagerly or, during capture, records it.
            quiet_fn: like ``fn`` but without host-visible side effects (logging); used for the
                eager half of ``verify_steps``. Defaults to ``fn``.
            fresh_grads: the step zeroes every gradient before backward and steps the optimizer
                (no accumulation across steps), so its graph may own the gradients. The gradients from before such
                a step are dead values: its capture drops them first and its warm-up keeps no copy, so the peak
                holds one set of gradients, as eager training does.
        """
        leaves, spec = flatten(batch)
        full_key = (signature_of(leaves, spec), key)
        # Guards run before every step (not only before replays): a capture must never bake in a
        # value the guard would have fixed (a float learning rate assigned before this step, say).
        # Every guard runs (each records what it saw); any reason drops the graphs once.
        reasons = [r for r in map(_call, self.guards) if r is not None]
        if reasons:
            self.invalidate("; ".join(reasons))
        entry = self.cache.get(full_key)
        if entry is not None and (self._flag.dirty or list(map(_data_ptr, self._scan)) != self._scan_ptrs):
            self.revalidate()
            entry = self.cache.get(full_key)
        if entry is None:
            return self._miss(full_key, leaves, spec, batch, fn, fresh_grads)
        if self._verify_left > 0:
            return self._verified_replay(entry, leaves, batch, quiet_fn or fn)
        out = entry.replay(leaves)
        self.stats.replays += 1
        if self.after_replay is not None:
            self.after_replay(entry)
        return out

    def set_params(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        """The trainable parameters changed (layers frozen or unfrozen). Call with the graphs dropped
        (:meth:`invalidate`): the next captures write, own and check these parameters' gradients."""
        self.named_params = list(named_params)
        self._scan = [p for _, p in self.named_params]
        self._scan_ptrs = list(map(_data_ptr, self._scan))

    def invalidate(self, reason: str) -> None:
        """Drop every graph; the next steps warm up (one eager step per key) and re-capture."""
        if len(self.cache):
            warnings.warn(f"CUDA graphs re-captured: {reason}", stacklevel=3)
            self.stats.recaptures += len(self.cache)
        self.cache.clear()
        self._seen.clear()
        self.stats.graphs = 0
        self._flag.dirty = False

    def revalidate(self) -> None:
        """Compare each graph's recorded addresses with the live ones; drop the graphs that differ."""
        self._flag.dirty = False
        if not len(self.cache):
            return
        now = self._state_now()
        stale: list[tuple[Hashable, str]] = []
        for key in list(self.cache.keys()):
            entry = self.cache.peek(key)
            why = _difference(entry, now)
            if why is not None:
                stale.append((key, why))
        for key, _ in stale:
            self.cache.pop(key)
            self._seen.discard(key)
        if stale:
            self.stats.recaptures += len(stale)
            self.stats.graphs = len(self.cache)
            warnings.warn(
                f"CUDA graphs re-captured ({len(stale)} of {len(stale) + len(self.cache)}): {stale[0][1]}; "
                "re-capturing instead of replaying stale memory",
                stacklevel=3,
            )
        self._scan_ptrs = list(map(_data_ptr, self._scan))

    def disable(self, reason: str) -> None:
        """Stop capturing for the rest of training (one warning); steps run eagerly."""
        if self.disabled_reason is None:
            self.disabled_reason = reason
            warnings.warn(f"CUDA graphs disabled, training eagerly: {reason}", stacklevel=3)
        self.cache.clear()
        self.stats.graphs = 0

    # ------------------------------------------------------------------------------------------
    # state bookkeeping
    # ------------------------------------------------------------------------------------------
    def _named_state(self, with_grads: bool = True) -> list[tuple[str, Tensor]]:
        """Every tensor a graph reads or writes across steps, named for messages."""
        out: list[tuple[str, Tensor]] = []
        for name, p in self.named_params:
            out.append((name, p))
            if with_grads and p.grad is not None:
                out.append((name + ".grad", p.grad))
        for i, item in enumerate(self.state_fn()):
            out.append(item if isinstance(item, tuple) else (f"optimizer/extra state tensor #{i}", item))
        out.extend(self.watched_fn())
        return out

    def _state_now(self) -> dict[str, int]:
        return {name: t.data_ptr() for name, t in self._named_state()}

    def _watch(self, tensors: list[tuple[str, Tensor]]) -> list[weakref.ref]:
        """Weak references that mark the engine dirty when one of these tensor objects is replaced
        and freed (kept with the graph that depends on them)."""
        flag = self._flag

        def freed(_ref: weakref.ref, flag: _Flag = flag) -> None:
            flag.dirty = True

        # Parameters are scanned before every replay instead (their objects outlive a `.data` swap).
        return [weakref.ref(t, freed) for _, t in tensors if not isinstance(t, torch.nn.Parameter)]

    def _after_eager(self) -> None:
        """State may have been created by an eager step (first gradient of a parameter, lazy
        optimizer state): graphs captured without it must not replay."""
        if len(self.cache):
            self._flag.dirty = True

    # ------------------------------------------------------------------------------------------
    # internals
    # ------------------------------------------------------------------------------------------
    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = self.backend.side_stream(self.device)
        return self._stream

    def _miss(self, key: Hashable, leaves: list[Tensor], spec: Hashable, batch: Any, fn: StepFn, fresh_grads: bool) -> Any:
        cfg = self.config
        if self.disabled_reason is not None:
            self.stats.count_eager("disabled")
            return fn(batch)
        if self._warmup_left > 0:
            self._warmup_left -= 1
            self._seen.add(key)
            self.stats.warmup_steps += 1
            out = self._warmup(fn, batch, sync_check=cfg.sync_check and self._warmup_left == 0, fresh_grads=fresh_grads)
            self._after_eager()
            return out
        if key not in self._seen:
            # A new key (or a re-capture) gets one eager step first: shape-specific lazy state and
            # library plans are then created outside the graph pool.
            self._seen.add(key)
            self.stats.count_eager("new-signature warm-up")
            out = self._warmup(fn, batch, sync_check=cfg.sync_check, fresh_grads=fresh_grads)
            self._after_eager()
            return out
        if self.cache.full():
            if cfg.on_cache_full == "eager":
                self.stats.count_eager("graph cache full")
                out = fn(batch)
                self._after_eager()
                return out
            self.cache.evict_lru()
            self.stats.graphs = len(self.cache)
        if self._flag.dirty:
            self.revalidate()
        return self._capture(key, leaves, spec, batch, fn, fresh_grads)

    def _warmup(self, fn: StepFn, batch: Any, sync_check: bool, fresh_grads: bool) -> Any:
        """Eager step on the side stream; optionally with host syncs turned into errors."""
        be = self.backend
        s = self._side_stream()
        cur = be.current_stream(self.device)
        s.wait_stream(cur)
        restore = self.host_state() if sync_check else None
        backup = None
        if sync_check and self.config.on_capture_error == "eager" and not fresh_grads:
            # A sync error can stop the step half-way (after backward, say); keep the gradients so the
            # eager fallback does not accumulate them twice. Only then: it costs one gradient copy. A step that
            # zeroes its gradients (fresh_grads) needs none: the fallback zeroes them again.
            backup = [(p, None if p.grad is None else p.grad.clone()) for _, p in self.named_params]
        try:
            with be.use_stream(s):
                if sync_check:
                    with be.sync_errors():
                        out = fn(batch)
                else:
                    out = fn(batch)
        except Exception as exc:  # noqa: BLE001 - re-raised as a CaptureError or handled below
            cur.wait_stream(s)
            if not sync_check or not _is_sync_error(exc):
                raise
            err = capture_error_from(exc, "host-sync check of the last warm-up step")
            if backup is not None:
                for p, g in backup:
                    if g is None:
                        p.grad = None
                    elif p.grad is not None:
                        p.grad.copy_(g)
            if restore is not None:
                restore()
            return self._handle_capture_error(err, exc, fn, batch)
        cur.wait_stream(s)
        return out

    def note_peak_memory(self) -> None:
        """Record the device's peak allocated memory so far in ``stats.peak_bytes`` (after a capture; at the end of
        fit). A read of the allocator's counters: no sync, no device work."""
        if self.stats.peak_eager_bytes:
            self.stats.peak_bytes = torch.cuda.max_memory_allocated(self.device)

    def _capture(self, key: Hashable, leaves: list[Tensor], spec: Hashable, batch: Any, fn: StepFn, fresh_grads: bool) -> Any:
        t0 = time.perf_counter()
        if not self.stats.peak_eager_bytes and self.device.type == "cuda":
            self.stats.peak_eager_bytes = torch.cuda.max_memory_allocated(self.device)
        be = self.backend
        inputs = StaticInputs(leaves, spec, self.device)
        graph = be.new_graph()
        self.generators.apply(graph)
        if self._pool is None or not len(self.cache):
            # A new pool once every graph is gone: torch refuses a capture into a pool whose graphs were all
            # destroyed while tensors allocated in it (gradients, the guard's tables) still live.
            self._pool = be.pool()
        owns = fresh_grads
        if owns:
            # Backward then writes fresh gradients into the graph's memory: no zeroing kernel and no
            # accumulation per parameter, and the optimizer skips parameters that get none. The previous
            # step's gradients are dead values (this step zeroes them), so nothing keeps them: the capture
            # peaks with one set of gradients alive, as eager training does (a failed capture leaves them None).
            for _, p in self.named_params:
                p.grad = None
        before = dict(self._named_state(with_grads=not owns))
        before_ptrs = {n: t.data_ptr() for n, t in before.items()}
        undo = self.host_state()

        try:
            # The adapter's hazard checks: contexts around the capture (they may raise CaptureError on exit) and
            # checks right after it; both see Python only, never a replay.
            with contextlib.ExitStack() as checks:
                for make in self.adapter.capture_contexts():
                    checks.enter_context(make())
                with be.capture(graph, self._pool, self._side_stream()):
                    out = fn(inputs.batch)
            for check in self.adapter.post_capture_checks():
                check()
            out_leaves, out_spec = flatten(out)
            io = be.finish(graph, (inputs.leaves, out_leaves))  # the backend decided io_in_graph once
        except CaptureError as err:  # a hazard check refused this capture
            undo()
            return self._handle_capture_error(err, err, fn, batch)
        except Exception as exc:  # noqa: BLE001
            original = _root_cause(exc)
            undo()
            err = capture_error_from(original, "capture")
            return self._handle_capture_error(err, original, fn, batch)
        named_after = self._named_state()
        moved = next(
            (n for n, t in named_after if n in before_ptrs and t.data_ptr() != before_ptrs[n]), None
        ) or next((n for n in before_ptrs if n not in dict(named_after)), None)
        if moved is not None:
            undo()
            err = CaptureError(
                f"'{moved}' was re-allocated inside the captured step, so a replay would write memory nothing "
                "reads. Typical causes: `param.grad = None` inside training_step or a hook it calls, or a parameter "
                "replaced in forward. Zero gradients with optimizer.zero_grad() and keep parameters fixed.",
                rule="reallocation",
            )
            return self._handle_capture_error(err, err, fn, batch)
        # A gradient this (non-owning) capture created is written fresh by the graph, not accumulated:
        # right for this step (eager had no gradient either), stale from the next step on. Recording it
        # as absent makes the next check drop the graph, so it is captured again with the gradient.
        state = {n: t.data_ptr() for n, t in named_after if owns or n in before_ptrs or not n.endswith(".grad")}
        grads = {n for n, _ in named_after if n.endswith(".grad")} if owns else set()
        # The memory a graph addresses stays allocated while it exists; owned gradients are the
        # graph's own pool memory (other graphs' captures may reuse it between replays).
        watched = [(n, t) for n, t in named_after if n not in grads]
        keep = [t.untyped_storage() for _, t in watched]
        entry = GraphEntry(graph, inputs, out_spec, out_leaves, key, state, keep, owns_grads=owns, io=io)
        entry.meta["watch"] = self._watch(watched)
        self.cache.put(key, entry)
        self._scan = [p for _, p in self.named_params] + [
            t for _, t in self.watched_fn() if isinstance(t, torch.nn.Parameter)
        ]
        self._scan_ptrs = list(map(_data_ptr, self._scan))
        self.stats.captures += 1
        self.stats.graphs = len(self.cache)
        self.stats.memsets_rewritten = be.memsets_rewritten
        self.stats.graphs_with_io_nodes += io is not None
        if self.on_capture is not None:
            self.on_capture(entry)
        self.stats.capture_time_s += time.perf_counter() - t0
        # Capture records the step without running it: run it now for this batch.
        out = entry.replay(leaves)
        # Other graphs recorded the gradients' old addresses (gradients this capture created or owns).
        if owns or len(state) != len(before_ptrs):
            self._flag.dirty = True
        return out

    def _handle_capture_error(self, err: CaptureError, exc: BaseException, fn: StepFn, batch: Any) -> Any:
        if self.config.on_capture_error == "raise":
            raise err from exc
        self.disable(str(err).splitlines()[0])
        self.stats.count_eager("capture error")
        return fn(batch)

    # ------------------------------------------------------------------------------------------
    # verify_steps
    # ------------------------------------------------------------------------------------------
    def _verified_replay(self, entry: GraphEntry, leaves: list[Tensor], batch: Any, quiet_fn: StepFn) -> Any:
        """Run the step eagerly, undo everything it wrote, then replay the graph and compare.

        The eager half runs first under a recorder that snapshots every pre-existing tensor before
        its first write (parameters, gradients, optimizer state, module buffers such as BatchNorm
        statistics, NaN-guard accumulators); those, the adapter's ``mutable_tensors``, every
        generator and the host counters are restored before the graph's step, whose effects are
        the ones that stay. Training is then exactly that of an unverified run.
        """
        self._verify_left -= 1
        be = self.backend
        rng = be.rng_state(self.device)
        gens = self.generators.states()
        extra = [(t, t.detach().clone()) for t in self.mutable_fn()]
        restore_host = self.host_state()
        grads = [(p, p.grad) for _, p in self.named_params]  # eager zero_grad may set them to None
        # The adapter's reference_step (optional): the eager half runs the user's own optimizer step in it.
        reference = getattr(self.adapter, "reference_step", None)
        with reference() if reference is not None else contextlib.nullcontext(), _WriteRecorder() as rec:
            out_eager = quiet_fn(batch)
        eager_vals = _metrics(out_eager, self.named_params)
        post_eager = [p.detach().clone() for _, p in self.named_params]
        rec.restore()
        for p, g in grads:
            p.grad = g
        with torch.no_grad():
            for t, v in extra:
                t.copy_(v)
        self.generators.set_states(gens)
        be.set_rng_state(rng, self.device)
        restore_host()
        out_graph = entry.replay(leaves)
        self.stats.replays += 1
        graph_vals = _metrics(out_graph, self.named_params)
        if entry.owns_grads and any(
            p.grad is not None and p.grad.data_ptr() != entry.state.get(n + ".grad") for n, p in self.named_params
        ):
            # The parameters' .grad is another graph's memory now: this graph's gradients are not visible.
            eager_vals.pop("grad_norm", None)
        rtol = self.config.verify_rtol
        problems = []
        for k in eager_vals:
            a, b = graph_vals.get(k), eager_vals[k]
            if a is None or not _close(a, b, rtol):
                problems.append(f"{k}: graph {a!r} vs eager {b!r}")
        for (name, p), e in zip(self.named_params, post_eager):
            if not _close_t(p.detach(), e, rtol):
                diff = (p.detach().float() - e.float()).abs().max().item()
                problems.append(f"parameter '{name}' after the step: max |graph - eager| = {diff:.3e}")
                break
        self.stats.verified_steps += 1
        if problems:
            raise ParityError(
                "verify_steps: the graphed step differs from the same step run eagerly (rtol="
                f"{rtol}):\n  " + "\n  ".join(problems) + "\nThe step does something a replay does not repeat "
                "(Python-side state, a host value frozen at capture, an unregistered random generator). "
                "Set on_capture_error='eager' or enabled=False for this model, and please report it."
            )
        if self.after_replay is not None:
            self.after_replay(entry)
        return out_graph


class _WriteRecorder(TorchDispatchMode):
    """Snapshots every tensor that existed before the block, right before its first in-place write.

    Writes are found from the operator schemas (``Tensor(a!)`` arguments, lists included: fused
    optimizer updates, ``add_``, ``out=`` variants), plus the ``running_mean``/``running_var``
    arguments of the batch-norm kernels, whose schemas (``native_batch_norm``, ``cudnn_batch_norm``,
    ``miopen_batch_norm``, ``batch_norm_update_stats``) do not mark them as written although the
    kernels update them. Tensors created inside the block are skipped. Kernels that bypass torch's
    dispatcher (custom C++ extensions) are invisible here: the engine snapshots those through its
    adapter's ``mutable_tensors`` (the Lightning adapter passes the module's buffers and TE's FP8 scaling state).
    """

    def __init__(self) -> None:
        super().__init__()
        self._created: set[int] = set()
        self._seen: set[tuple] = set()
        self._snaps: list[tuple[Tensor, Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            written = arg.alias_info is not None and arg.alias_info.is_write
            if not written and arg.name not in _UNMARKED_WRITES:
                continue
            val = kwargs[arg.name] if arg.name in kwargs else (args[i] if i < len(args) else None)
            for t in val if isinstance(val, (list, tuple)) else (val,):
                if isinstance(t, Tensor):
                    self._snapshot(t)
        out = func(*args, **kwargs)
        # New tensors (not views of, or writes into, an argument) are temporaries of the block.
        if all(r.alias_info is None for r in func._schema.returns):
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, Tensor) and t.numel():
                    self._created.add(t.untyped_storage().data_ptr())
        return out

    def _snapshot(self, t: Tensor) -> None:
        if not t.numel():
            return
        sp = t.untyped_storage().data_ptr()
        if sp in self._created:
            return
        view = (sp, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if view in self._seen:
            return
        self._seen.add(view)
        with torch.utils._python_dispatch._disable_current_modes():
            self._snaps.append((t, t.detach().clone()))

    def restore(self) -> None:
        """Write every snapshot back, latest first (overlapping views end with the oldest value)."""
        with torch.no_grad():
            for t, v in reversed(self._snaps):
                t.copy_(v)
        self._snaps.clear()


# Arguments that kernels write although their schemas do not say so (the batch-norm family's running statistics).
_UNMARKED_WRITES = frozenset({"running_mean", "running_var"})


def _difference(entry: GraphEntry, now: dict[str, int]) -> Optional[str]:
    """Why ``entry`` must not replay with the state ``now`` (``None`` if it may)."""
    for name, ptr in entry.state.items():
        if entry.owns_grads and name.endswith(".grad"):
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
        if name not in entry.state and not (entry.owns_grads and name.endswith(".grad")):
            return f"'{name}' was created after the graph was captured (a later step made it), so the graph ignores it"
    return None


def _is_sync_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "synchroniz" in text or "capturing" in text


def _root_cause(exc: BaseException) -> BaseException:
    """The exception raised inside the captured body, not capture_end's follow-up error."""
    ctx = exc.__context__
    if ctx is not None and "captur" in str(exc).lower() and ctx is not exc:
        return ctx
    return exc


def _metrics(out: Any, named_params: Sequence[tuple[str, Tensor]]) -> dict[str, float]:
    leaves, _ = flatten(out)
    vals: dict[str, float] = {}
    if leaves:
        vals["loss"] = float(leaves[0].detach().float().sum())
    grads = [p.grad for _, p in named_params if p.grad is not None]
    if grads:
        vals["grad_norm"] = float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))
    return vals


def _close(a: float, b: float, rtol: float) -> bool:
    if a != a or b != b:  # NaN never passes
        return False
    return a == b if rtol == 0 else abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


def _close_t(a: Tensor, b: Tensor, rtol: float) -> bool:
    if rtol == 0:
        return torch.equal(a, b)
    return torch.allclose(a.float(), b.float(), rtol=rtol, atol=0.0)
