"""The device calls the engine makes, in one small interface.

:class:`CudaBackend` is what training uses: ``torch.cuda`` graphs, streams, the shared memory pool,
``set_sync_debug_mode("error")`` and the CUDA RNG; each graph it captures has its memset nodes rewritten as
fill kernels (option ``memsets_as_kernels``) and copy nodes added for the batch and the outputs (option
``io_in_graph``) before it is instantiated (``_cuda_nodes``). The engine never
calls ``torch.cuda`` itself, so its decisions (keys, guards, copies, counters, re-capture) can be exercised on a
machine without a GPU by a stand-in backend whose "graph" re-runs the recorded tensor operations on the same memory
(``tests/_tape.py``); nothing in the package uses a stand-in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

from . import _cuda_nodes, kernel_args
from .config import CaptureConfig
from .warn import warn_once

__all__ = ["CapturePool", "CudaBackend", "GraphBackend"]


class GraphBackend:
    """What the engine needs from a device. Every method is called outside the replay hot path
    except ``replay`` (a method of the graph object ``new_graph`` returns)."""

    #: device type this backend captures on ("cuda")
    device_type: str = "cuda"
    #: memset nodes of its captured graphs that it rewrote as fill kernels, over every capture
    memsets_rewritten: int = 0
    #: a capture runs the work as it records it (a stand-in; CUDA only records): a capture that fails has written
    #: what it ran, which the caller puts back before running the work eagerly
    capture_runs_work: bool = False

    def new_graph(self) -> Any:
        """A graph object with ``replay()`` and ``register_generator_state(gen)``."""
        raise NotImplementedError

    def pool(self) -> Any:
        """A memory-pool handle shared by every graph of one engine."""
        raise NotImplementedError

    def capture(self, graph: Any, pool: Any, stream: Any) -> contextlib.AbstractContextManager:
        """Context in which the step runs once and is recorded into ``graph``; a :func:`.kernel_args.capture_scope`
        is open inside it, and ``graph.host_scalars`` is set to its sentinels when it closes without error."""
        raise NotImplementedError

    def finish(self, graph: Any, io: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> Any:
        """Make a graph whose capture the engine keeps ready to replay; its ``replay()`` then first gives the kernels
        that received a host scalar's sentinel (``graph.host_scalars``) the scalar's current value. Raises where it
        cannot (the graph must not be replayed).

        ``io``: the graph's input buffers and outputs (the engine always passes them; ``None`` where a caller has
        none). Where this backend lets the graph copy them itself (its ``io_in_graph`` choice, made once at
        construction, and the tensors allow it), returns an object whose ``bind(batch, fresh)`` makes the next replay copy the batch tensors ``batch`` into the input
        buffers before its first node and the outputs into ``fresh`` after its last; ``None``: the engine copies
        them around the replay.
        """
        return None

    def side_stream(self, device: torch.device) -> Any:
        raise NotImplementedError

    def current_stream(self, device: torch.device) -> Any:
        raise NotImplementedError

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def sync_errors(self) -> contextlib.AbstractContextManager:
        """Context in which an operation that waits for the device on the host raises."""
        raise NotImplementedError

    def rng_state(self, device: torch.device) -> Any:
        raise NotImplementedError

    def set_rng_state(self, state: Any, device: torch.device) -> None:
        raise NotImplementedError


class CapturePool:
    """The memory pool a series of captures share, renewed where torch would refuse the next capture into it.

    * Once every graph captured into it is gone: torch refuses a capture into a pool whose graphs were all destroyed
      while tensors allocated in it (gradients, a guard's tables) still live.
    * After a capture that failed: a capture that a CUDA error invalidated (a host read, an uncapturable call) ends
      without the caching allocator ending its routing into the pool (torch 2.11), and the next capture into that
      pool fails (``beginAllocateToPool: already recording to mempool_id``) however capturable it is.

    * After :meth:`seal`: the next capture begins a new series (a later capture into a pool may be handed the memory
      of earlier captures' temporaries, which is safe only while the pool's graphs replay in the order they were
      captured; graphs captured at another time replay among the others). Except a capture with
      ``keeps_nothing=True``: a graph that keeps no memory of the pool past its replay (the optimizer side, the adds
      into ``.grad``) writes only blocks that hold no live tensor while it replays, so it takes the current pool,
      which stays sealed.

    Graphs of different pools share no memory; each graph keeps the memory it reads alive, whichever pool it is in.

    Args:
        backend: makes the handles.
        live: whether a graph captured into the current handle still lives.
    """

    def __init__(self, backend: GraphBackend, live: Callable[[], bool]) -> None:
        self._backend, self._live = backend, live
        self._handle: Any = None
        self._sealed = False

    def get(self, keeps_nothing: bool = False) -> Any:
        """The handle of the next capture (``keeps_nothing``: see the class docstring)."""
        if self._handle is None or not self._live() or (self._sealed and not keeps_nothing):
            self._handle = self._backend.pool()
            self._sealed = False
        return self._handle

    def seal(self) -> None:
        """The captures so far keep their pool to themselves: the next capture (but one with ``keeps_nothing=True``)
        takes a new one."""
        self._sealed = True

    @contextlib.contextmanager
    def capture(self, graph: Any, stream: Any, keeps_nothing: bool = False) -> Iterator[None]:
        """``backend.capture`` of ``graph`` into the current handle; a capture that raises makes the next one take a
        new handle."""
        try:
            with self._backend.capture(graph, self.get(keeps_nothing), stream):
                yield
        except BaseException:
            self._handle = None
            raise


class CudaBackend(GraphBackend):
    """``torch.cuda`` graphs (the only backend the package uses).

    Args:
        memsets_as_kernels: rewrite each captured graph's memset nodes as fill kernels that write the same bytes.
        io_in_graph: add copy kernel nodes for the batch (before the graph's first node) and the outputs (after its
            last) whose addresses are set before each replay (``_cuda_nodes.GraphIO``), for contiguous tensors.

    Both need the driver API through ``cuda-bindings`` (a CUDA driver >= 12.3) and ``CUDAGraph(keep_graph=True)``
    (torch >= 2.8); without them graphs stay as captured (one warning says why) and the engine copies around the
    replay. A rewrite that fails leaves the graph as captured (one warning).
    """

    device_type = "cuda"

    def __init__(self, memsets_as_kernels: bool = True, io_in_graph: bool = True) -> None:
        surgery = "torch < 2.8 has no CUDAGraph(keep_graph=True)" if not _keep_graph_supported() else _cuda_nodes.unavailable()
        self._surgery = surgery
        #: why captured graphs keep their memset nodes; None: they run them as fill kernels
        self.memsets_kept: Optional[str] = "memsets_as_kernels=False" if not memsets_as_kernels else surgery
        #: why the batch and outputs are copied around the replay; None: by the graph (where the tensors allow)
        self.io_kept: Optional[str] = "io_in_graph=False" if not io_in_graph else surgery
        self.memsets_rewritten = 0
        if surgery is not None and (memsets_as_kernels or io_in_graph):
            warn_once("graph-rewrites", f"captured graphs stay as captured (their memset nodes stay, the batch and "
                      f"outputs are copied around each replay): {surgery}")

    def new_graph(self) -> torch.cuda.CUDAGraph:
        # keep_graph: captured but not instantiated, so its nodes can still be read and changed (instantiated in
        # finish()) wherever the driver layer is there, for the rewrites and for host scalars (kernel_args).
        if self._surgery is None:
            return _Graph(keep_graph=True)
        return torch.cuda.CUDAGraph()

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: Any, stream: Any) -> Iterator[None]:
        prev = torch.cuda.current_stream()
        try:
            # thread_local: other threads (a dataloader's pin-memory thread) may keep using CUDA.
            with kernel_args.capture_scope() as scalars:
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    yield
            graph.host_scalars = scalars
        finally:
            # A capture that fails leaves torch.cuda.graph's stream current (capture_end raises before it is
            # restored): the eager code after it must run where it would have.
            if torch.cuda.current_stream() != prev:
                torch.cuda.set_stream(prev)

    def finish(self, graph: Any, io: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> Any:
        scalars = getattr(graph, "host_scalars", None)
        if self._surgery is not None:
            if scalars:
                raise RuntimeError(f"host scalars were passed to kernels in a capture, which cannot be set before "
                                   f"replays here: {self._surgery}")
            return None  # instantiated by torch at the end of the capture
        raw = graph.raw_cuda_graph()
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        # Each rewrite is all or nothing: a RewriteError leaves the graph as captured (GraphDamaged, where undoing
        # failed too, is raised: the capture fails as any other).
        if self.memsets_kept is None:
            try:
                self.memsets_rewritten += _cuda_nodes.rewrite_memsets(raw, sms).replaced
            except _cuda_nodes.RewriteError as exc:
                warn_once("memsets-as-kernels", f"memset nodes of a captured graph stay memsets: {exc}")
        nodes = None
        if self.io_kept is None and io is not None and _copyable(io[0]) and _copyable(io[1]):
            try:
                nodes = _cuda_nodes.GraphIO(raw, _spans(io[0]), _spans(io[1]), sms)
            except _cuda_nodes.RewriteError as exc:
                warn_once("io-in-graph", f"the batch and outputs are copied around the replay: {exc}")
        args = None
        if scalars:
            try:
                args = _cuda_nodes.ScalarArgs(raw, scalars)
            except _cuda_nodes.RewriteError as exc:  # the graph holds sentinels: it must not run
                raise RuntimeError(f"the captured kernels' host scalars (a fused optimizer's learning rate) cannot be "
                                   f"set before replays: {exc}") from exc
        graph.instantiate()
        if nodes is not None:
            nodes.instantiated(graph.raw_cuda_graph_exec())
        if args is not None:
            args.instantiated(graph.raw_cuda_graph_exec())
            graph.args = args
        return nodes

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    @contextlib.contextmanager
    def sync_errors(self) -> Iterator[None]:
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(prev)

    def rng_state(self, device: torch.device) -> torch.Tensor:
        return torch.cuda.get_rng_state(device)

    def set_rng_state(self, state: Any, device: torch.device) -> None:
        torch.cuda.set_rng_state(state, device)


class _Graph(torch.cuda.CUDAGraph):
    """A CUDA graph whose replay first sets the kernels' host scalars (:class:`._cuda_nodes.ScalarArgs`) where it has
    any: one attribute read otherwise."""

    args: Optional[_cuda_nodes.ScalarArgs] = None

    def replay(self) -> None:
        args = self.args
        if args is not None:
            args.bind()
        super().replay()


def default_backend(backend: Optional[GraphBackend], config: CaptureConfig) -> GraphBackend:
    """``backend``, or the CUDA backend for ``config``: the one place that reads the options ``memsets_as_kernels``
    and ``io_in_graph`` (the engine asks the backend, never the options)."""
    return backend if backend is not None else CudaBackend(config.memsets_as_kernels, config.io_in_graph)


def _copyable(tensors: list[torch.Tensor]) -> bool:
    """A copy node moves one contiguous span of device memory per tensor (a batch tensor of the same signature has the
    same strides, so it is contiguous too)."""
    return all(t.is_cuda and t.is_contiguous() for t in tensors)


def _spans(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]


def _keep_graph_supported() -> bool:
    """torch >= 2.8 can capture a graph without instantiating it (``CUDAGraph(keep_graph=True)``)."""
    import inspect

    try:
        return "keep_graph" in inspect.signature(torch.cuda.CUDAGraph.__new__).parameters
    except (TypeError, ValueError):
        return False
