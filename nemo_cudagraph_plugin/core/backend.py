"""The device calls the engine makes, in one small interface.

:class:`CudaBackend` is what training uses: ``torch.cuda`` graphs, streams, the shared memory pool,
``set_sync_debug_mode("error")`` and the CUDA RNG. The engine never calls ``torch.cuda`` itself, so
its decisions (keys, guards, copies, counters, re-capture) can be exercised on a machine without a
GPU by a stand-in backend whose "graph" re-runs the recorded tensor operations on the same memory
(``tests/_tape.py``); nothing in the package uses a stand-in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch

__all__ = ["CudaBackend", "GraphBackend"]


class GraphBackend:
    """What the engine needs from a device. Every method is called outside the replay hot path
    except ``replay`` (a method of the graph object ``new_graph`` returns)."""

    #: device type this backend captures on ("cuda")
    device_type: str = "cuda"

    def new_graph(self) -> Any:
        """A graph object with ``replay()`` and ``register_generator_state(gen)``."""
        raise NotImplementedError

    def pool(self) -> Any:
        """A memory-pool handle shared by every graph of one engine."""
        raise NotImplementedError

    def capture(self, graph: Any, pool: Any, stream: Any) -> contextlib.AbstractContextManager:
        """Context in which the step runs once and is recorded into ``graph``."""
        raise NotImplementedError

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


class CudaBackend(GraphBackend):
    """``torch.cuda`` graphs (the only backend the package uses)."""

    device_type = "cuda"

    def new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, graph: Any, pool: Any, stream: Any) -> contextlib.AbstractContextManager:
        # thread_local: other threads (a dataloader's pin-memory thread) may keep using CUDA.
        return torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local")

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


def default_backend(backend: Optional[GraphBackend]) -> GraphBackend:
    return backend if backend is not None else CudaBackend()
