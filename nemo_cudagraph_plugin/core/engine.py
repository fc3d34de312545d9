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
  steps and keeps that memory alive; a graph whose addresses moved (``p.data = ...``, ``module.to``,
  a replaced gradient, state created later) is dropped with one warning and captured again (:mod:`.addresses`);
* gradients owned by the graph: a step that zeroes gradients and steps the optimizer (``fresh_grads=True``)
  is captured with the gradients set to ``None`` first, as ``zero_grad(set_to_none=True)`` leaves them in eager
  training: backward writes them fresh into the graph's memory (no zeroing or accumulation kernel), the capture
  peaks with one set of gradients as eager does, and the optimizer skips a parameter without a gradient. Such a
  graph's gradients are temporaries of the shared pool: after a replay ``param.grad`` holds this step's gradients
  only when it is the most recently captured graph (read gradients inside the step, e.g. in
  ``on_before_optimizer_step``);
* random numbers: the default generator is advanced per replay by the backend; extra generators
  are registered through :class:`~.rng.GeneratorRegistry`;
* ``verify_steps``: :mod:`.parity` runs the step eagerly, restores everything it wrote, then replays
  and compares, so verification leaves training exactly as an unverified run. After :meth:`CaptureEngine.hand_over`
  to the partial tier, the first steps whose graphs all replay are verified the same way
  (:class:`PartialTier`: the eager half with every graph of the tier set aside).

The engine asks its adapter (:class:`~.adapter.StepAdapter`) for what it needs when it needs it; it reads the
adapter's guards once.
"""

from __future__ import annotations

import contextlib
import operator
import time
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from ._torch_compat import copy_all
from .adapter import Guard, StepAdapter, StepFunctions
from .addresses import AddressBook, difference, moved_in_capture
from .backend import CapturePool, GraphBackend, default_backend
from .buffers import StaticInputs, capture_layout, flatten, signature_of, unflatten, unflattener
from .config import CaptureConfig, CaptureStats
from .errors import CaptureError, capture_error_from, is_sync_error, root_cause
from .graph_cache import GraphCache
from .parity import StepParity, WriteRecorder
from .rng import GeneratorRegistry

__all__ = ["CaptureEngine", "GraphEntry", "PartialTier"]

StepFn = Callable[[Any], Any]


class PartialTier(Protocol):
    """What the engine asks of the partial tier it hands its steps over to (:class:`~.partial.PartialGraphs`), for
    ``verify_steps``; asked inside the tier's step."""

    def may_replay_only(self) -> bool:
        """Whether the step running now may be one whose graphs all replay (cheap; checked before the step)."""
        ...

    def replayed_only(self) -> bool:
        """Whether the step so far replayed graphs and did nothing else of the tier's: no capture (checked after)."""
        ...

    def eager(self) -> contextlib.AbstractContextManager:
        """Every graph of the tier set aside inside the block, with no effect on what the tier found or counts."""
        ...

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


class CaptureEngine:
    """Runs a training step eagerly, captures it, or replays it.

    Args:
        config: options (warm-up, cache size, error policy, verification).
        device: the device the step runs on.
        named_params: the model's trainable ``(name, parameter)`` pairs.
        adapter: what the framework tells the engine about its steps (:class:`~.adapter.StepAdapter`: the state
            the step reads and writes, guards, hazard checks, what to repeat after a replay), asked when each is
            needed; its guards are read once, here. Default: nothing besides the parameters
            (:class:`~.adapter.StepFunctions`).
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
        self.adapter: StepAdapter = adapter if adapter is not None else StepFunctions()
        # The checks run before every step, read once (StepAdapter.guards).
        self.guards: list[Guard] = list(self.adapter.guards())
        self.generators = generators or GeneratorRegistry()
        self.stats = stats or CaptureStats()
        self.cache: GraphCache[GraphEntry] = GraphCache(config.max_graphs)
        self.addresses = AddressBook(named_params, self.adapter)
        self.parity = StepParity(self.backend, device, self.generators, self.adapter, self.stats, config.verify_rtol)
        self.disabled_reason: Optional[str] = None
        self._pool = CapturePool(self.backend, lambda: len(self.cache) > 0)
        self._stream: Any = None
        self._warmup_left = config.warmup_steps
        self._seen: set[Hashable] = set()
        self._verify_left = config.verify_steps
        self._tier: Optional[PartialTier] = None
        #: told, instead of ``on_capture_error``, that a capture failed (``scope="auto"``): the caller graphs parts of
        #: the later steps (the partial tier) and calls :meth:`hand_over`; this step then runs eagerly
        self.fallback: Optional[Callable[[CaptureError], None]] = None
        self._eager_label = "disabled"

    # ------------------------------------------------------------------------------------------
    # the step, and what drops graphs
    # ------------------------------------------------------------------------------------------
    @property
    def named_params(self) -> list[tuple[str, Tensor]]:
        return self.addresses.named_params  # the trainable (name, parameter) pairs; set_params changes them

    @property
    def dirty(self) -> bool:
        """Something a graph depends on may have been re-allocated: check addresses before a replay."""
        return self.addresses.dirty

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self.addresses.dirty = value

    def step(self, batch: Any, key: Hashable, fn: StepFn, quiet_fn: Optional[StepFn] = None,
             fresh_grads: bool = False) -> Any:
        """Run one training step on ``batch``.

        Args:
            batch: the step's input (nested tensors); copied into static buffers on replay.
            key: the step key: every Python value the step depends on besides the batch (see the
                module docstring). Steps of different keys never share a graph.
            fn: performs the step eagerly or, during capture, records it.
            quiet_fn: like ``fn`` but without host-visible side effects (logging); used for the
                eager half of ``verify_steps``. Defaults to ``fn``.
            fresh_grads: the step zeroes every gradient before backward and steps the optimizer (no accumulation
                across steps), so its graph may own the gradients; its capture drops the previous ones first and its
                warm-up keeps no copy, so the peak holds one set of gradients, as eager training does.
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
        if entry is not None and self.addresses.may_have_moved():
            self.revalidate()
            entry = self.cache.get(full_key)
        if entry is None:
            return self._miss(full_key, leaves, spec, batch, fn, quiet_fn, fresh_grads)
        if self._verify_left > 0:
            self._verify_left -= 1
            out = self.parity.replay(entry, leaves, batch, quiet_fn or fn, self.named_params,
                                     what=f"the graphed step (batch {self._batches() + 1} since fit start)")
        else:
            out = entry.replay(leaves)
            self.stats.replays += 1
        after = self.adapter.after_replay
        if after is not None:
            after(entry)
        return out

    def set_params(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        """The trainable parameters changed (layers frozen or unfrozen). Call with the graphs dropped
        (:meth:`invalidate`): the next captures write, own and check these parameters' gradients."""
        self.addresses.set_params(named_params)

    def invalidate(self, reason: str) -> None:
        """Drop every graph; the next steps warm up (one eager step per key) and re-capture."""
        if len(self.cache):
            warnings.warn(f"CUDA graphs re-captured: {reason}", stacklevel=3)
            self.stats.recaptures += len(self.cache)
        self.cache.clear()
        self._seen.clear()
        self.stats.graphs = 0
        self.addresses.dirty = False

    def revalidate(self) -> None:
        """Compare each graph's recorded addresses with the live ones; drop the graphs that differ."""
        book = self.addresses
        book.dirty = False
        if not len(self.cache):
            return
        now = book.now()
        graphs = [(key, self.cache.peek(key)) for key in list(self.cache.keys())]
        stale = [(key, why) for key, e in graphs if (why := difference(e.state, e.owns_grads, now)) is not None]
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
        book.rescan()

    def disable(self, reason: str) -> None:
        """Stop capturing for the rest of training (one warning); steps run eagerly."""
        if self.disabled_reason is None:
            self.disabled_reason = reason
            warnings.warn(f"CUDA graphs disabled, training eagerly: {reason}", stacklevel=3)
        self.cache.clear()
        self.stats.graphs = 0

    def hand_over(self, reason: str, tier: Optional[PartialTier] = None) -> None:
        """Capture no whole step for the rest of training, without a warning: the caller graphs parts of each step
        itself (the partial tier) around the eager steps this engine runs (counted as ``"partial graphs"``).

        With ``tier``, ``verify_steps`` counts anew for the tier's graphs: each of its first ``verify_steps`` steps
        whose graphs all replay runs eagerly first, with the tier's graphs set aside, from the same state, and is
        compared as a whole-step replay is (:meth:`~.parity.StepParity.verify`). A step that turns out to capture
        something (or to run a graphed module eagerly) has its eager half undone and is neither compared nor counted.
        """
        self.disabled_reason = reason
        self._eager_label = "partial graphs"
        self.cache.clear()
        self.stats.graphs = 0
        self._tier = tier
        self._verify_left = self.config.verify_steps if tier is not None else 0

    def note_peak_memory(self) -> None:
        """Record the device's peak allocated memory so far in ``stats.peak_bytes`` (after a capture; at the end of
        fit). A read of the allocator's counters: no sync, no device work."""
        if self.stats.peak_eager_bytes:
            self.stats.peak_bytes = torch.cuda.max_memory_allocated(self.device)

    # ------------------------------------------------------------------------------------------
    # warm-up (eager steps), then capture; the replay is GraphEntry.replay, called by step()
    # ------------------------------------------------------------------------------------------
    def _after_eager(self) -> None:
        """State may have been created by an eager step (first gradient of a parameter, lazy
        optimizer state): graphs captured without it must not replay."""
        if len(self.cache):
            self.addresses.dirty = True

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = self.backend.side_stream(self.device)
        return self._stream

    def _miss(self, key: Hashable, leaves: list[Tensor], spec: Hashable, batch: Any, fn: StepFn,
              quiet_fn: Optional[StepFn], fresh_grads: bool) -> Any:
        cfg = self.config
        if self.disabled_reason is not None:
            self.stats.count_eager(self._eager_label)
            tier = self._tier
            if tier is not None and self._verify_left > 0 and tier.may_replay_only():
                return self._verify_tier(tier, batch, fn, quiet_fn or fn)
            return fn(batch)
        warmup = self._warmup_left > 0
        if warmup or key not in self._seen:
            # A new key (or a re-capture) gets one eager step first: shape-specific lazy state and library plans are
            # then created outside the graph pool. Eager steps before a capture read the batch as the capture will
            # (its buffers' layout), so that what they set up (torch.compile's code, which guards on layouts) is
            # what the capture runs.
            laid = capture_layout(leaves)
            warm = batch if laid is None else unflatten(spec, laid)
            self._seen.add(key)
            if warmup:
                self._warmup_left -= 1
                self.stats.warmup_steps += 1
                sync_check = cfg.sync_check and self._warmup_left == 0
            else:
                self.stats.count_eager("new-signature warm-up")
                sync_check = cfg.sync_check
            out = self._warmup(fn, warm, sync_check=sync_check, fresh_grads=fresh_grads)
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
        if self.addresses.dirty:
            self.revalidate()
        return self._capture(key, leaves, spec, batch, fn, fresh_grads)

    def _verify_tier(self, tier: PartialTier, batch: Any, fn: StepFn, quiet_fn: StepFn) -> Any:
        """``verify_steps`` for a step of the partial tier: eager with its graphs set aside, undone, then with them."""

        def graphed() -> tuple[Any, Optional[tuple[str, ...]]]:
            out = fn(batch)
            if not tier.replayed_only():
                return out, None  # it captured (or ran a graphed module eagerly): not a verified step
            self._verify_left -= 1
            return out, ()

        return self.parity.verify(batch, quiet_fn, graphed, self.named_params, bypass=tier.eager,
                                  what=f"the step with partial graphs (batch {self._batches()} since fit start)")

    def _batches(self) -> int:
        """The steps this engine has run (each is counted once: warm-up, capture, replay or eager)."""
        s = self.stats
        return s.warmup_steps + s.captures + s.replays + s.eager_steps

    def _warmup(self, fn: StepFn, batch: Any, sync_check: bool, fresh_grads: bool) -> Any:
        """Eager step on the side stream; optionally with host syncs turned into errors."""
        be = self.backend
        s = self._side_stream()
        cur = be.current_stream(self.device)
        s.wait_stream(cur)
        restore = self.adapter.host_state() if sync_check else None
        backup = None
        if sync_check and (self.config.on_capture_error == "eager" or self.fallback is not None) and not fresh_grads:
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
            if not sync_check or not is_sync_error(exc):
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

    def _capture(self, key: Hashable, leaves: list[Tensor], spec: Hashable, batch: Any, fn: StepFn, fresh_grads: bool) -> Any:
        t0 = time.perf_counter()
        if not self.stats.peak_eager_bytes and self.device.type == "cuda":
            self.stats.peak_eager_bytes = torch.cuda.max_memory_allocated(self.device)
        be = self.backend
        inputs = StaticInputs(leaves, spec, self.device)
        graph = be.new_graph()
        self.generators.apply(graph)
        owns = fresh_grads
        if owns:
            # Backward then writes fresh gradients into the graph's memory: no zeroing kernel and no
            # accumulation per parameter, and the optimizer skips parameters that get none. The previous
            # step's gradients are dead values (this step zeroes them), so nothing keeps them: the capture
            # peaks with one set of gradients alive, as eager training does (a failed capture leaves them None).
            for _, p in self.named_params:
                p.grad = None
        book = self.addresses
        before_ptrs = book.now(with_grads=not owns)
        undo = self.adapter.host_state()
        # A backend whose capture runs the step (a stand-in) has written it once: a refused capture puts that back
        # before the step runs eagerly. CUDA's capture only records, and writes nothing.
        writes = WriteRecorder() if be.capture_runs_work else contextlib.nullcontext()

        try:
            # The adapter's hazard checks: contexts around the capture (they may raise CaptureError on exit) and
            # checks right after it; both see Python only, never a replay.
            with contextlib.ExitStack() as checks:
                for make in self.adapter.capture_contexts():
                    checks.enter_context(make())
                with self._pool.capture(graph, self._side_stream()), writes:
                    out = fn(inputs.batch)
            for check in self.adapter.post_capture_checks():
                check()
            out_leaves, out_spec = flatten(out)
            io = be.finish(graph, (inputs.leaves, out_leaves))  # the backend decided io_in_graph once
        except CaptureError as err:  # a hazard check refused this capture
            if isinstance(writes, WriteRecorder):
                writes.restore()
            undo()
            return self._handle_capture_error(err, err, fn, batch)
        except Exception as exc:  # noqa: BLE001
            original = root_cause(exc)
            if isinstance(writes, WriteRecorder):
                writes.restore()
            undo()
            err = capture_error_from(original, "capture")
            return self._handle_capture_error(err, original, fn, batch)
        named_after = book.named_state()
        moved = moved_in_capture(before_ptrs, named_after)
        if moved is not None:
            undo()
            return self._handle_capture_error(moved, moved, fn, batch)
        rec = book.record(named_after, before_ptrs, owns)
        entry = GraphEntry(graph, inputs, out_spec, out_leaves, key, rec.state, rec.keep, owns_grads=owns, io=io)
        entry.meta["watch"] = rec.watch
        self.cache.put(key, entry)
        self.stats.captures += 1
        self.stats.graphs = len(self.cache)
        self.stats.memsets_rewritten = be.memsets_rewritten
        self.stats.graphs_with_io_nodes += io is not None
        on_capture = self.adapter.on_capture
        if on_capture is not None:
            on_capture(entry)
        self.stats.capture_time_s += time.perf_counter() - t0
        # Capture records the step without running it: run it now for this batch.
        out = entry.replay(leaves)
        # Other graphs recorded the gradients' old addresses (gradients this capture created or owns).
        if owns or len(rec.state) != len(before_ptrs):
            book.dirty = True
        return out

    def _handle_capture_error(self, err: CaptureError, exc: BaseException, fn: StepFn, batch: Any) -> Any:
        if self.fallback is not None:
            self.fallback(err)
            self.stats.count_eager(self._eager_label)
            return fn(batch)
        if self.config.on_capture_error == "raise":
            raise err from exc
        self.disable(str(err).splitlines()[0])
        self.stats.count_eager("capture error")
        return fn(batch)
