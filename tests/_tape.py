"""A CPU stand-in for a CUDA graph, so the engine's real replay logic runs in CPU tests.

``TapeBackend`` implements :class:`nemo_cudagraph_plugin.core.backend.GraphBackend` on CPU tensors. Its
"graph" (:class:`TapeGraph`) is a faithful model of what a CUDA graph is to the code around it:

* **capture** runs the step once (a real capture only records; the engine replays once right after capture,
  so the first replay after a capture is a no-op here) under a ``TorchDispatchMode`` that records every aten
  op with the *memory* of its tensor arguments and outputs: each tensor is recorded as a storage-bound alias
  (same storage, offset, sizes, strides) made at capture time. A graph sees addresses, not Python objects: if
  user code later does ``p.data = new`` or ``torch.utils.swap_tensors``, the tape keeps reading and writing
  the old memory, exactly like a CUDA graph.
* **replay** re-executes the recorded ops on those aliases (under ``no_grad``; autograd already ran at
  capture, its backward ops are on the tape), with no Python of the step. Ops that returned new tensors are
  recomputed and copied into the memory recorded for their outputs; views, in-place and ``out=`` ops just
  re-execute on the recorded memory. ``empty*`` ops are skipped (a graph's allocation is not a kernel).
* **Python values are baked**: a float learning rate, a Python branch, a counter read in ``training_step``,
  the result of ``.item()`` when ``sync_in_capture="bake"`` — all keep their capture-time value, the hazard
  real graphs have. By default a host sync during capture raises like CUDA does ("operation not permitted
  when stream is capturing").
* **random numbers**: ops drawing from the default CPU generator draw again on each replay (CUDA advances
  the default generator's Philox offset per replay, so replays draw what eager steps would). An explicit
  ``generator=`` that was registered with :meth:`TapeGraph.register_generator_state` advances too; an
  unregistered one replays the numbers of the capture every time (its capture-time state is put back
  before the op and its live state after it), so skipping the registration is caught on CPU.
* :meth:`TapeBackend.sync_errors` raises ``RuntimeError("... called a synchronizing CUDA operation ...")`` on
  the ops that synchronise the host with a CUDA device (``.item()``/``float(t)``/``bool(t)``, ``nonzero``,
  boolean-mask indexing, ``masked_select``, ``unique``, ``torch.equal``, ``repeat_interleave`` without
  ``output_size``, ``bincount``) and on host data created on the device (``torch.tensor(data, device=...)``,
  ``torch.as_tensor(data, device=...)``: on CUDA a blocking host-to-device copy). A tensor built on the host
  without ``device=`` is a host tensor and allowed (the tape cannot tell a later ``.to(device)`` apart from
  a no-op: CPU is both host and device here). The same ops fail a capture (``sync_in_capture="raise"``).
  The frames of this file are removed from the traceback, so the engine's error points at the user's line
  as it does on CUDA.

* **memory pools** (:class:`_Pool`) hand a capture the memory of earlier captures' temporaries, as torch's caching
  allocator does within a private pool; a graph replayed out of its pool's capture order overwrites what a later
  capture keeps there, as on CUDA.

Streams are trivial, the RNG state is ``torch.get_rng_state()``.
Nothing in the package imports this file.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from nemo_cudagraph_plugin.core import kernel_args
from nemo_cudagraph_plugin.core._torch_compat import ObservingMode
from nemo_cudagraph_plugin.core.backend import GraphBackend
from nemo_cudagraph_plugin.core.rng import GeneratorRegistry

__all__ = ["TapeBackend", "TapeGraph", "CpuGeneratorRegistry", "CompiledCalls"]

aten = torch.ops.aten
_HERE = os.path.abspath(__file__)

# Ops whose result is read on the host (a device -> host copy and wait on CUDA).
_HOST_READS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.allclose.default,
}
# Ops whose output shape depends on values (CUDA must copy a count to the host).
_DYNAMIC = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
    aten._unique.default,
    aten._unique2.default,
    aten.bincount.default,
}
_EMPTY = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}
_INDEX_OPS = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


def _syncs(func: Any, args: tuple, kwargs: dict) -> bool:
    """Would this op wait for a CUDA device on the host (or copy host data to it, blocking)?"""
    if func in _HOST_READS or func in _DYNAMIC:
        return True
    if func is aten.repeat_interleave.Tensor or func is aten.repeat_interleave.self_Tensor:
        return kwargs.get("output_size") is None
    if func in _INDEX_OPS:
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(t, Tensor) and t.dtype in (torch.bool, torch.uint8) for t in idx or ())
    return False


class _HostDataOnDevice:
    """While active, ``torch.tensor``/``torch.as_tensor`` of host data with ``device=`` the tape device raise:
    on CUDA they are a blocking host-to-device copy. (Not a dispatcher op: the data becomes a tensor before
    any op runs, so this is the one check made at the Python level.)"""

    _NAMES = ("tensor", "as_tensor")

    def __init__(self, message: str) -> None:
        self.message = message
        self._orig: dict[str, Any] = {}

    def __enter__(self) -> None:
        for name in self._NAMES:
            fn = self._orig[name] = getattr(torch, name)
            setattr(torch, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Any) -> Any:
        message = self.message

        def checked(data: Any, *args: Any, **kwargs: Any) -> Tensor:
            dev = kwargs.get("device", args[1] if name == "as_tensor" and len(args) > 1 else None)
            if dev is not None and not isinstance(data, Tensor) and torch.device(dev).type == "cpu":
                raise RuntimeError(f"torch.{name}(<host data>, device={str(dev)!r}): {message}")
            return fn(data, *args, **kwargs)

        return checked

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._orig.items():
            setattr(torch, name, fn)
        self._orig.clear()


def _strip_own_frames(exc: BaseException) -> None:
    """Drop this file's frames from ``exc``'s traceback: on CUDA the error comes from C++, so the innermost
    Python frame is the user's line (what the engine's locator reports)."""
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == _HERE:
        tb = tb.tb_next
    head = tb
    while tb is not None:
        nxt = tb.tb_next
        while nxt is not None and os.path.abspath(nxt.tb_frame.f_code.co_filename) == _HERE:
            nxt = nxt.tb_next
        tb.tb_next = nxt
        tb = nxt
    exc.__traceback__ = head


_SYNC_MSG = "called a synchronizing CUDA operation (TapeBackend sync check)"
_CAPTURE_MSG = "CUDA error: operation not permitted when stream is capturing (TapeBackend)"


class _SyncErrors(ObservingMode):
    """``torch.cuda.set_sync_debug_mode("error")`` for the tape device (torch.compile'd code runs compiled under it,
    as under CUDA's check)."""

    def __init__(self) -> None:
        super().__init__()
        self._host_data = _HostDataOnDevice(_SYNC_MSG)

    def __enter__(self) -> Any:
        self._host_data.__enter__()
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            raise RuntimeError(f"{func}: {_SYNC_MSG}")
        return func(*args, **kwargs)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        self._host_data.__exit__()
        if exc is not None:
            _strip_own_frames(exc)
        return super().__exit__(exc_type, exc, tb)


# ----------------------------------------------------------------------------------------------------------
# the graph
# ----------------------------------------------------------------------------------------------------------
def _alias(t: Tensor) -> Tensor:
    """A new tensor object on the same memory as ``t`` (storage, offset, sizes, strides)."""
    with _disable_current_modes(), torch.no_grad():
        a = torch.empty(0, dtype=t.dtype, device=t.device)
        a.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    return a


def _map(obj: Any, fn: Any) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(o, fn) for o in obj)
    return obj


def _tensors(obj: Any) -> list[Optional[Tensor]]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        out: list[Optional[Tensor]] = []
        for o in obj:
            out.extend(_tensors(o) if isinstance(o, (Tensor, list, tuple)) else [None])
        return out
    return []


def _same_memory(a: Tensor, b: Tensor) -> bool:
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


class _Op:
    __slots__ = ("func", "args", "kwargs", "outs", "gens")

    def __init__(self, func: Any, args: tuple, kwargs: dict, outs: list[Optional[Tensor]], gens: list) -> None:
        self.func, self.args, self.kwargs, self.outs, self.gens = func, args, kwargs, outs, gens


class TapeGraph:
    """What a captured CUDA graph is to the engine, on CPU (see the module docstring).

    Attributes:
        ops: the recorded aten ops.
        replays: replays that re-executed the tape (the no-op replay right after capture is not counted).
    """

    def __init__(self, tally: Optional[list[int]] = None) -> None:
        self.ops: list[_Op] = []
        self.registered: list[torch.Generator] = []
        self.replays = 0
        self._fresh = False
        self._tally = tally if tally is not None else [0]  # replays over every graph of its backend
        self.io: Optional[TapeIO] = None
        self.host_scalars: dict = {}  # the capture's sentinels (kernel_args), as CUDA graphs keep them
        self.args: Optional[TapeScalarArgs] = None

    def register_generator_state(self, generator: torch.Generator) -> None:
        """Like ``CUDAGraph.register_generator_state``: replays advance ``generator``."""
        if not any(g._cdata == generator._cdata for g in self.registered):
            self.registered.append(generator)

    def _advances(self, gen: torch.Generator) -> bool:
        # The dispatcher hands ops a new Python wrapper of the generator: compare the C++ object.
        return gen._cdata == torch.default_generator._cdata or any(g._cdata == gen._cdata for g in self.registered)

    def replay(self) -> None:
        """Re-execute the tape on the recorded memory (the first call after a capture does nothing: capture
        already ran the step once, where a CUDA capture only records it)."""
        io = self.io
        if self.args is not None:
            self.args.bind()
        if self._fresh:
            self._fresh = False
            if io is not None:
                io.copy_out()
            return
        with torch.no_grad():
            if io is not None:
                io.copy_in()
            for op in self.ops:
                fixed = [(g, s, g.get_state()) for g, s in op.gens if not self._advances(g)]
                for g, s, _ in fixed:
                    g.set_state(s)
                try:
                    new = op.func(*op.args, **op.kwargs)
                finally:
                    for g, _, live in fixed:
                        g.set_state(live)
                for rec, t in zip(op.outs, _tensors(new)):
                    if rec is not None and t is not None and not _same_memory(rec, t):
                        rec.copy_(t)
            if io is not None:
                io.copy_out()
        self.replays += 1
        self._tally[0] += 1


class TapeScalarArgs:
    """What ``core._cuda_nodes.ScalarArgs`` is to a graph: the recorded ops' float arguments that are a host scalar's
    sentinel (``core.kernel_args``) take the scalar's current value before a replay after one changed, and keep it."""

    def __init__(self, graph: TapeGraph, sentinels: dict) -> None:
        self.sites: list[tuple[_Op, Any, Any, int]] = []  # (op, position or kwarg name, scalars, slot)
        found = set()
        for op in graph.ops:
            places = [(k, v) for k, v in enumerate(op.args)] + list(op.kwargs.items())
            for where, v in places:
                if isinstance(v, float) and v != v and (b := kernel_args.float_bits(v)) in sentinels:
                    self.sites.append((op, where, *sentinels[b]))
                    found.add(b)
        if len(found) != len(sentinels):
            raise RuntimeError(f"{len(sentinels) - len(found)} host scalar(s) passed in the capture were found in no "
                               "recorded op")
        self.owners = list({id(o): o for o, _ in sentinels.values()}.values())
        self.bound: Any = None
        self.binds = 0

    def bind(self) -> None:
        version = tuple(o.version for o in self.owners)
        if version == self.bound:
            return
        for op, where, owner, slot in self.sites:
            if isinstance(where, int):
                args = list(op.args)
                args[where] = owner.values[slot]
                op.args = tuple(args)
            else:
                op.kwargs[where] = owner.values[slot]
        self.bound = version
        self.binds += 1


class TapeIO:
    """What ``core._cuda_nodes.GraphIO`` is to the engine: the graph itself copies the bound batch into its input
    buffers before its ops and its outputs into the bound tensors after them (each replay, until bound again)."""

    def __init__(self, inputs: list[Tensor], outputs: list[Tensor]) -> None:
        self.inputs, self.outputs = inputs, outputs
        self.srcs: list[Tensor] = list(inputs)
        self.dsts: list[Tensor] = list(outputs)
        self.binds = 0

    def bind(self, srcs: list[Tensor], dsts: list[Tensor]) -> None:
        self.srcs, self.dsts = list(srcs), list(dsts)
        self.binds += 1

    def copy_in(self) -> None:
        for buf, src in zip(self.inputs, self.srcs):
            if not _same_memory(buf, src):
                buf.copy_(src)

    def copy_out(self) -> None:
        with torch.no_grad():
            for dst, out in zip(self.dsts, self.outputs):
                if not _same_memory(dst, out):
                    dst.copy_(out)


class _Recorder(ObservingMode):  # compiled code runs compiled under it, as under CUDA's capture
    def __init__(self, graph: TapeGraph, sync_in_capture: str, pool: Optional[_Pool] = None) -> None:
        super().__init__()
        self.graph = graph
        self.sync_in_capture = sync_in_capture
        self.pool = pool
        self._host_data = _HostDataOnDevice(_CAPTURE_MSG) if sync_in_capture == "raise" else None

    def __enter__(self) -> Any:
        if self._host_data is not None:
            self._host_data.__enter__()
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "profiler":  # record_function markers: not device work
            return func(*args, **kwargs)
        if _syncs(func, args, kwargs):
            if self.sync_in_capture == "raise":
                raise RuntimeError(f"{func}: {_CAPTURE_MSG}")
            # "bake": runs; a host value it returns stays in the Python that used it (not on the tape)
        gens = [(g, g.get_state()) for g in [*args, *kwargs.values()] if isinstance(g, torch.Generator)]
        # A host scalar's sentinel is what the recorded op keeps (as a CUDA kernel node does); the capture's own run
        # (a CUDA capture runs nothing) takes the scalar's value.
        run_args = tuple(s[0].values[s[1]] if (s := kernel_args.live_slot(a)) else a for a in args)
        run_kwargs = {k: s[0].values[s[1]] if (s := kernel_args.live_slot(v)) else v for k, v in kwargs.items()}
        out = func(*run_args, **run_kwargs)
        pool = self.pool
        if pool is not None and all(r.alias_info is None for r in func._schema.returns):
            inputs = {t.untyped_storage().data_ptr() for t in _tensors(list(args) + list(kwargs.values()))
                      if t is not None}
            fresh = {id(t): pool.allocated(t) for t in _tensors(out)
                     if t is not None and t.numel() and t.untyped_storage().data_ptr() not in inputs
                     and t.untyped_storage().nbytes() == t.numel() * t.element_size()}
            if fresh:
                out = _map(out, lambda t: fresh.get(id(t), t))
        outs = _tensors(out)
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        # empty*: allocation only, nothing to re-run (its memory is the output's recorded memory).
        # Ops that neither write an argument nor return a tensor (sizes, flags) do no device work.
        if func not in _EMPTY and (writes or any(t is not None for t in outs)):
            memo: dict[int, Tensor] = {}

            def alias(t: Tensor) -> Tensor:
                a = memo.get(id(t))
                if a is None:
                    a = memo[id(t)] = _alias(t)
                    if pool is not None:
                        pool.aliased(t, a)
                return a

            rec_outs = [None if t is None else alias(t) for t in outs]
            rec_kwargs = {k: _map(v, alias) for k, v in kwargs.items()}
            self.graph.ops.append(_Op(func, _map(args, alias), rec_kwargs, rec_outs, gens))
        return out

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        if self._host_data is not None:
            self._host_data.__exit__()
        if exc is not None:
            _strip_own_frames(exc)
        return super().__exit__(exc_type, exc, tb)


class _Pool:
    """A graph memory-pool handle: the graphs captured into it (weakly), whether any ever was, whether a failed
    capture left the allocator recording into it, and its memory, reused as torch's caching allocator reuses a private
    pool's: what a capture allocates comes from a block of the same size that earlier captures into the pool allocated
    and nothing but graphs addresses any more (an earlier graph's temporaries), where there is one.

    A CUDA graph keeps writing its temporaries on every replay, so a later capture that is handed their memory and
    keeps a tensor in it (activations its backward reads) finds it overwritten whenever the earlier graph replays
    between: torch's rule that graphs sharing a pool replay in the order they were captured. The tape's replay writes
    the same memory, so breaking that rule gives wrong numbers here too."""

    def __init__(self) -> None:
        self.graphs: weakref.WeakSet[TapeGraph] = weakref.WeakSet()
        self.used = False
        self.stuck = False
        #: storages allocated by captures into this pool, with the tapes' aliases of each (weakly)
        self._blocks: dict[int, tuple[Any, list[weakref.ref[Tensor]]]] = {}
        self._free: dict[int, list[Any]] = {}  # by size: blocks free when the running capture began

    def begin(self) -> None:
        """At a capture's start: the blocks only tapes address (a block's own reference, one per live alias)."""
        self._free = {}
        for storage, aliases in self._blocks.values():
            live = sum(1 for a in aliases if a() is not None)
            if torch._C._storage_Use_Count(storage._cdata) <= live + 1:
                self._free.setdefault(storage.nbytes(), []).append(storage)

    def allocated(self, t: Tensor) -> Tensor:
        """``t``, a fresh output of an operator in a capture, in a free block of its size if there is one (a new
        block of the pool otherwise)."""
        own = t.untyped_storage()
        free = self._free.get(own.nbytes())
        if not free:
            self._blocks[own.data_ptr()] = (own, [])
            return t
        storage = free.pop()
        with _disable_current_modes(), torch.no_grad():
            n = torch.empty(0, dtype=t.dtype, device=t.device)
            n.set_(storage, t.storage_offset(), t.size(), t.stride())
            n.copy_(t)
        return n

    def aliased(self, t: Tensor, a: Tensor) -> None:
        block = self._blocks.get(t.untyped_storage().data_ptr())
        if block is not None:
            block[1].append(weakref.ref(a))


class _Stream:
    """Streams are an ordering concept on a GPU; the tape device has one queue."""

    def wait_stream(self, other: Any) -> None:
        pass


_capturing = [0]  # tape captures running now (CompiledCalls.in_capture)


class CompiledCalls:
    """A ``torch.compile`` backend standing in for Inductor on the CPU: AOTAutograd's forward and backward graphs as
    Inductor gets them (its runtime, donated buffers included), run operator by operator (the tape sees them, as
    CUDA capture sees Inductor's kernels), and a count of the compiled code's runs. A call that dynamo runs
    uncompiled instead (a frame it skips) is not counted. ``in_capture`` counts the graphs compiled while a tape
    captures (on CUDA, Inductor's first run of new kernels inside a capture fails it)."""

    def __init__(self) -> None:
        self.runs = 0
        self.compiles = 0
        self.in_capture = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        from torch._dynamo.backends.debugging import aot_eager

        self.compiles += 1
        self.in_capture += _capturing[0] > 0
        compiled = aot_eager(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.runs += 1
            return compiled(*args)

        return run


class TapeBackend(GraphBackend):
    """A :class:`GraphBackend` whose graphs are :class:`TapeGraph` tapes on CPU tensors.

    Args:
        sync_in_capture: ``"raise"`` (like CUDA: a host sync inside a capture fails it) or ``"bake"`` (the host
            value read at capture stays in the Python that used it, for tests of that hazard).
        io_in_graph: graphs copy the batch in and their outputs out themselves (:class:`TapeIO`), as CUDA graphs
            with ``core._cuda_nodes.GraphIO`` nodes do.

    Memory pools follow torch's caching allocator: a pool handle lives while a graph captured into it lives; capturing
    into a pool all of whose graphs were destroyed fails (torch: ``it->second->use_count > 0 INTERNAL ASSERT FAILED``
    in ``capture_begin`` while tensors allocated in that pool are still alive), so an engine must take a new handle
    once it has dropped every graph. A capture that fails leaves its pool refusing every later capture (torch 2.11
    ends a capture that a CUDA error invalidated without ending the allocator's routing into the pool, and the next
    capture into that pool fails with ``beginAllocateToPool: already recording to mempool_id``).

    Attributes:
        graphs: weak references to every graph captured through this backend, in order.
    """

    device_type = "cpu"
    capture_runs_work = True  # a capture runs the step once (module docstring)

    def __init__(self, sync_in_capture: str = "raise", io_in_graph: bool = False) -> None:
        if sync_in_capture not in ("raise", "bake"):
            raise ValueError("sync_in_capture must be 'raise' or 'bake'")
        self.sync_in_capture = sync_in_capture
        self.io_in_graph = io_in_graph
        self.graphs: list[weakref.ref[TapeGraph]] = []
        self._tally = [0]

    def new_graph(self) -> TapeGraph:
        return TapeGraph(self._tally)

    def pool(self) -> _Pool:
        return _Pool()

    @contextlib.contextmanager
    def capture(self, graph: TapeGraph, pool: Any, stream: Any) -> Iterator[None]:
        if isinstance(pool, _Pool):
            if pool.used and not len(pool.graphs):
                raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (tape stand-in of torch's caching "
                                   "allocator: capture into a pool whose graphs were all destroyed)")
            if pool.stuck:
                raise RuntimeError("beginAllocateToPool: already recording to mempool_id (tape stand-in of torch's "
                                   "caching allocator after a failed capture into this pool)")
            pool.used = True
            pool.graphs.add(graph)
            pool.begin()
        graph.ops.clear()
        _capturing[0] += 1
        try:
            with kernel_args.capture_scope() as scalars, _Recorder(graph, self.sync_in_capture,
                                                                   pool if isinstance(pool, _Pool) else None):
                yield
        except BaseException:
            if isinstance(pool, _Pool):
                pool.stuck = True
            raise
        finally:
            _capturing[0] -= 1
        graph._fresh = True
        graph.host_scalars = scalars
        self.graphs.append(weakref.ref(graph))

    def finish(self, graph: TapeGraph, io: Any) -> Optional[TapeIO]:
        if graph.host_scalars:
            graph.args = TapeScalarArgs(graph, graph.host_scalars)
        if not self.io_in_graph or io is None:
            return None
        graph.io = TapeIO(list(io[0]), list(io[1]))
        return graph.io

    def side_stream(self, device: torch.device) -> _Stream:
        return _Stream()

    def current_stream(self, device: torch.device) -> _Stream:
        return _Stream()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def sync_errors(self) -> contextlib.AbstractContextManager:
        return _SyncErrors()

    def rng_state(self, device: torch.device) -> Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: Any, device: torch.device) -> None:
        torch.set_rng_state(state)

    @property
    def replays(self) -> int:
        """Tape re-executions over every graph of this backend."""
        return self._tally[0]


def CpuGeneratorRegistry() -> GeneratorRegistry:  # noqa: N802 - kept as the tests' constructor name
    """The package's :class:`GeneratorRegistry` for the stand-in graph's CPU generators."""
    return GeneratorRegistry(device_type="cpu")
