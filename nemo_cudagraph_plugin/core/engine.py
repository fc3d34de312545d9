"""The capture engine: eager warm-up, capture, and replay of a whole training step.

Framework-free: the engine is handed a step function ``fn(batch) -> outputs`` that performs one
complete training step (zero-grad, forward, backward, clipping, optimizer step — whatever the
caller puts in it) and decides, per call, whether to run it eagerly, capture it, or replay a
graph captured earlier for the same input signature.

Lifecycle of one input signature (shapes, dtypes, non-tensor leaves, plus the caller's
``phase`` such as "accumulate" vs "step")::

    eager warm-up (side stream) -> [last warm-up with sync check] -> capture -> replay, replay, ...

What is captured: every CUDA kernel and copy ``fn`` launches on the capture stream. What is not:
Python side effects of ``fn`` (counters, hooks, prints) run once, at capture; the caller repeats
what it needs after each replay (``after_replay``). Hazards covered here:

* inputs at fixed addresses: :class:`~.buffers.StaticInputs`, one ``copy_`` per tensor leaf;
* wrong-shape replay: graphs are keyed by the full signature, never reused across shapes;
* outputs overwritten by the next replay: tensor outputs are cloned after every replay;
* host syncs inside the step: the last warm-up runs under ``set_sync_debug_mode("error")`` and
  failures are reported at the user's file:line (:mod:`.errors`);
* re-allocated state (parameters, gradients, optimizer state replaced after capture): addresses
  are recorded at capture and compared whenever the caller marks the engine :attr:`dirty`;
* random numbers: the default CUDA generator is advanced per replay by torch; extra generators
  are registered through :class:`~.rng.GeneratorRegistry`.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from .buffers import StaticInputs, flatten, signature_of, unflatten
from .config import CaptureConfig, CaptureStats
from .errors import CaptureError, ParityError, capture_error_from
from .graph_cache import GraphCache
from .rng import GeneratorRegistry

__all__ = ["CaptureEngine", "GraphEntry"]

StepFn = Callable[[Any], Any]
Guard = Callable[[], Optional[str]]


@dataclass
class GraphEntry:
    """One captured step: its graph, input buffers and static outputs."""

    graph: torch.cuda.CUDAGraph
    inputs: StaticInputs
    out_spec: Hashable
    out_leaves: list[Tensor]
    phase: Hashable
    meta: dict[str, Any] = field(default_factory=dict)

    def outputs(self) -> Any:
        # Clone: the next replay overwrites the static outputs, and a user may keep this step's loss.
        return unflatten(self.out_spec, [t.clone() for t in self.out_leaves])


class CaptureEngine:
    """Runs a training step eagerly, captures it, or replays it.

    Args:
        config: options (warm-up, cache size, error policy, verification).
        device: the CUDA device the step runs on.
        named_params: the model's ``(name, parameter)`` pairs; their data and gradients must keep
            their addresses between capture and replay.
        state_fn: returns every other tensor the step reads or writes across steps (optimizer
            state, learning-rate tensors); called at capture and on :attr:`dirty` checks only.
        generators: extra CUDA generators to register with each graph.
        host_state: returns a function that restores host-side counters the step mutates; used
            when a failed capture or a verification run must be undone.
        stats: counters to update (one shared :class:`CaptureStats` per trainer).
    """

    def __init__(
        self,
        config: CaptureConfig,
        device: torch.device,
        named_params: Sequence[tuple[str, Tensor]],
        state_fn: Callable[[], list[Tensor]] = lambda: [],
        generators: Optional[GeneratorRegistry] = None,
        host_state: Optional[Callable[[], Callable[[], None]]] = None,
        stats: Optional[CaptureStats] = None,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CaptureEngine needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.config = config
        self.device = device
        self.named_params = list(named_params)
        self.state_fn = state_fn
        self.generators = generators or GeneratorRegistry()
        self.host_state = host_state or (lambda: (lambda: None))
        self.stats = stats or CaptureStats()
        self.cache: GraphCache[GraphEntry] = GraphCache(config.max_graphs)
        self.guards: list[Guard] = []
        self.after_replay: Optional[Callable[[GraphEntry], None]] = None
        self.on_capture: Optional[Callable[[GraphEntry], None]] = None
        # Adapters add hazard checks: context managers entered around each capture (they may raise
        # CaptureError on exit) and checks run right after it; both see Python only, never a replay.
        self.capture_contexts: list[Callable[[], contextlib.AbstractContextManager]] = []
        self.post_capture_checks: list[Callable[[], None]] = []
        self.disabled_reason: Optional[str] = None
        self.dirty = False
        self._pool: Optional[tuple] = None
        self._stream: Optional[torch.cuda.Stream] = None
        self._warmup_left = config.warmup_steps
        self._seen: set[Hashable] = set()
        self._ptrs: Optional[list[tuple[str, int]]] = None
        self._verify_left = config.verify_steps

    # ------------------------------------------------------------------------------------------
    # public entry
    # ------------------------------------------------------------------------------------------
    def step(self, batch: Any, phase: Hashable, fn: StepFn, quiet_fn: Optional[StepFn] = None) -> Any:
        """Run one training step on ``batch``.

        Args:
            batch: the step's input (nested tensors); copied into static buffers on replay.
            phase: extra key (e.g. whether this step zeroes gradients / steps the optimizer):
                steps of different phases never share a graph.
            fn: performs the step eagerly or, during capture, records it.
            quiet_fn: like ``fn`` but without host-visible side effects (logging); used for the
                eager half of ``verify_steps``. Defaults to ``fn``.
        """
        leaves, spec = flatten(batch)
        key = (signature_of(leaves, spec), phase)
        entry = self.cache.get(key)
        if entry is not None:
            if self.dirty:
                self.revalidate()
                entry = self.cache.get(key)
            for guard in self.guards:
                reason = guard()
                if reason is not None:
                    self.invalidate(reason)
                    entry = None
                    break
        if entry is not None:
            entry.inputs.copy_from(leaves)
            if self._verify_left > 0:
                return self._verified_replay(entry, batch, quiet_fn or fn)
            entry.graph.replay()
            self.stats.replays += 1
            if self.after_replay is not None:
                self.after_replay(entry)
            return entry.outputs()
        return self._miss(key, leaves, spec, batch, phase, fn)

    def invalidate(self, reason: str) -> None:
        """Drop every graph; the next steps warm up (one eager step per signature) and re-capture."""
        if len(self.cache):
            warnings.warn(f"CUDA graphs re-captured: {reason}", stacklevel=3)
            self.stats.recaptures += len(self.cache)
        self.cache.clear()
        self._seen.clear()
        self._ptrs = None
        self.stats.graphs = 0
        self.dirty = False

    def revalidate(self) -> None:
        """Compare recorded state addresses with the live ones; invalidate graphs on a change."""
        self.dirty = False
        if self._ptrs is None:
            return
        now = self._state_ptrs()
        if now != self._ptrs:
            changed = next((a for a, b in zip(self._ptrs, now) if a != b), None) or (
                "number of state tensors",
                len(now),
            )
            self.invalidate(
                f"'{changed[0]}' was re-allocated after capture (e.g. load_state_dict replaced a tensor, or "
                "gradients were set to None); re-capturing instead of replaying stale memory"
            )

    def disable(self, reason: str) -> None:
        """Stop capturing for the rest of training (one warning); steps run eagerly."""
        if self.disabled_reason is None:
            self.disabled_reason = reason
            warnings.warn(f"CUDA graphs disabled, training eagerly: {reason}", stacklevel=3)
        self.cache.clear()
        self.stats.graphs = 0

    # ------------------------------------------------------------------------------------------
    # internals
    # ------------------------------------------------------------------------------------------
    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def _state_ptrs(self) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for name, p in self.named_params:
            out.append((name, p.data_ptr()))
            if p.grad is not None:
                out.append((name + ".grad", p.grad.data_ptr()))
        for i, t in enumerate(self.state_fn()):
            out.append((f"optimizer/extra state tensor #{i}", t.data_ptr()))
        return out

    def _miss(self, key: Hashable, leaves: list[Tensor], spec: Hashable, batch: Any, phase: Hashable, fn: StepFn) -> Any:
        cfg = self.config
        if self.disabled_reason is not None:
            self.stats.count_eager("disabled")
            return fn(batch)
        if self._warmup_left > 0:
            self._warmup_left -= 1
            self._seen.add(key)
            self.stats.warmup_steps += 1
            return self._warmup(fn, batch, sync_check=cfg.sync_check and self._warmup_left == 0)
        if key not in self._seen:
            # A new signature (or a re-capture) gets one eager step first: shape-specific lazy
            # state and library plans are then created outside the graph pool.
            self._seen.add(key)
            self.stats.count_eager("new-signature warm-up")
            return self._warmup(fn, batch, sync_check=cfg.sync_check)
        if self.cache.full():
            if cfg.on_cache_full == "eager":
                self.stats.count_eager("graph cache full")
                return fn(batch)
            self.cache.evict_lru()
            self.stats.graphs = len(self.cache)
        return self._capture(key, leaves, spec, batch, phase, fn)

    def _warmup(self, fn: StepFn, batch: Any, sync_check: bool) -> Any:
        """Eager step on the side stream; optionally with host syncs turned into errors."""
        s = self._side_stream()
        cur = torch.cuda.current_stream(self.device)
        s.wait_stream(cur)
        restore = self.host_state() if sync_check else None
        backup = None
        if sync_check and self.config.on_capture_error == "eager":
            # A sync error can stop the step half-way (after backward, say); keep the gradients so the
            # eager fallback does not accumulate them twice. Only then: it costs one gradient copy.
            backup = [(p, None if p.grad is None else p.grad.clone()) for _, p in self.named_params]
        try:
            with torch.cuda.stream(s):
                if sync_check:
                    prev = torch.cuda.get_sync_debug_mode()
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        out = fn(batch)
                    finally:
                        torch.cuda.set_sync_debug_mode(prev)
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

    def _capture(self, key: Hashable, leaves: list[Tensor], spec: Hashable, batch: Any, phase: Hashable, fn: StepFn) -> Any:
        t0 = time.perf_counter()
        inputs = StaticInputs(leaves, spec, self.device)
        graph = torch.cuda.CUDAGraph()
        self.generators.apply(graph)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        before = self._state_ptrs()
        restore = self.host_state()
        try:
            with contextlib.ExitStack() as checks:
                for make in self.capture_contexts:
                    checks.enter_context(make())
                with torch.cuda.graph(graph, pool=self._pool, stream=self._side_stream(), capture_error_mode="thread_local"):
                    out = fn(inputs.batch)
            for check in self.post_capture_checks:
                check()
        except CaptureError as err:  # a hazard check refused this capture
            restore()
            return self._handle_capture_error(err, err, fn, batch)
        except Exception as exc:  # noqa: BLE001
            original = _root_cause(exc)
            restore()
            err = capture_error_from(original, "capture")
            return self._handle_capture_error(err, original, fn, batch)
        after = self._state_ptrs()
        if after != before:
            changed = next((b for a, b in zip(before, after) if a != b), ("a state tensor", 0))
            restore()
            err = CaptureError(
                f"'{changed[0]}' was re-allocated inside the captured step, so a replay would write memory nothing "
                "reads. Typical causes: zero_grad(set_to_none=True) or `param.grad = None` inside training_step or "
                "a hook it calls, or a parameter replaced in forward. Zero gradients in place "
                "(optimizer.zero_grad(set_to_none=False)) and keep parameters fixed.",
                rule="reallocation",
            )
            return self._handle_capture_error(err, err, fn, batch)
        out_leaves, out_spec = flatten(out)
        entry = GraphEntry(graph, inputs, out_spec, out_leaves, phase)
        self.cache.put(key, entry)
        self._ptrs = after
        self.stats.captures += 1
        self.stats.graphs = len(self.cache)
        if self.on_capture is not None:
            self.on_capture(entry)
        self.stats.capture_time_s += time.perf_counter() - t0
        # Capture records the step without running it: run it now for this batch.
        graph.replay()
        return entry.outputs()

    def _handle_capture_error(self, err: CaptureError, exc: BaseException, fn: StepFn, batch: Any) -> Any:
        if self.config.on_capture_error == "raise":
            raise err from exc
        self.disable(str(err).splitlines()[0])
        self.stats.count_eager("capture error")
        return fn(batch)

    def _verified_replay(self, entry: GraphEntry, batch: Any, quiet_fn: StepFn) -> Any:
        """Replay, then run the same step eagerly from the same state and compare."""
        self._verify_left -= 1
        state = [p for _, p in self.named_params] + [
            p.grad for _, p in self.named_params if p.grad is not None
        ] + list(self.state_fn())
        snap = [t.detach().clone() for t in state]
        rng = torch.cuda.get_rng_state(self.device)
        restore_host = self.host_state()
        entry.graph.replay()
        self.stats.replays += 1
        out_graph = entry.outputs()
        graph_vals = _metrics(out_graph, self.named_params)
        post_graph = [p.detach().clone() for _, p in self.named_params]
        # Same state, same random numbers, eagerly.
        with torch.no_grad():
            for t, s in zip(state, snap):
                t.copy_(s)
        torch.cuda.set_rng_state(rng, self.device)
        out_eager = quiet_fn(batch)
        restore_host()
        eager_vals = _metrics(out_eager, self.named_params)
        rtol = self.config.verify_rtol
        problems = []
        for k in graph_vals:
            a, b = graph_vals[k], eager_vals.get(k)
            if b is None or not _close(a, b, rtol):
                problems.append(f"{k}: graph {a!r} vs eager {b!r}")
        for (name, p), g in zip(self.named_params, post_graph):
            if not _close_t(g, p.detach(), rtol):
                diff = (g.float() - p.detach().float()).abs().max().item()
                problems.append(f"parameter '{name}' after the step: max |graph - eager| = {diff:.3e}")
                break
        self.stats.verified_steps += 1
        if problems:
            raise ParityError(
                "verify_steps: the graphed step differs from the same step run eagerly (rtol="
                f"{rtol}):\n  " + "\n  ".join(problems) + "\nThe step does something a replay does not repeat "
                "(Python-side state, a host value frozen at capture, an unregistered random generator). "
                "Set on_capture_error='eager' or CaptureConfig(enabled=False) for this model, and please report it."
            )
        if self.after_replay is not None:
            self.after_replay(entry)
        return out_graph


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
