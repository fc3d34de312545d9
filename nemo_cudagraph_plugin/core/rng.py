"""Graph-safe random numbers.

``torch.cuda.graph`` registers the default CUDA generator of the capture device by itself: each
replay advances its Philox offset, so dropout masks differ from step to step exactly as in eager
mode. Any *other* ``torch.Generator`` used inside the step (a model-parallel RNG tracker, a custom
dropout generator) would replay the same numbers forever unless it is registered with the graph
through ``CUDAGraph.register_generator_state`` (torch >= 2.5). :class:`GeneratorRegistry` keeps
that list and registers it with every graph the engine captures.
"""

from __future__ import annotations

import torch

__all__ = ["GeneratorRegistry", "supports_extra_generators"]


def supports_extra_generators() -> bool:
    """True when this torch can register extra generators with a CUDA graph."""
    return hasattr(torch.cuda.CUDAGraph, "register_generator_state")


class GeneratorRegistry:
    """Extra CUDA generators to register with every captured graph."""

    def __init__(self, device_type: str = "cuda") -> None:
        # The device whose graphs these generators serve ("cpu" only for a stand-in graph in tests).
        self.device_type = device_type
        self._gens: list[torch.Generator] = []

    def register(self, generator: torch.Generator) -> None:
        """Add a CUDA generator used inside the captured step.

        Raises:
            TypeError: not a CUDA ``torch.Generator``.
            RuntimeError: this torch cannot make extra generators graph-safe (upgrade to >= 2.5).
        """
        if not isinstance(generator, torch.Generator) or generator.device.type != self.device_type:
            raise TypeError(
                f"register_generator expects a {self.device_type.upper()} torch.Generator, got {generator!r}"
            )
        if self.device_type == "cuda" and not supports_extra_generators():
            raise RuntimeError(
                f"torch {torch.__version__} cannot register extra generators with a CUDA graph "
                "(CUDAGraph.register_generator_state appeared in torch 2.5). Replays would reuse the same random "
                "numbers: upgrade torch or draw random numbers from the default CUDA generator."
            )
        if any(g is generator for g in self._gens):
            return
        self._gens.append(generator)

    def apply(self, graph: torch.cuda.CUDAGraph) -> None:
        """Register every generator with ``graph`` (call before its capture begins)."""
        for gen in self._gens:
            graph.register_generator_state(gen)

    def states(self) -> list[torch.Tensor]:
        """Each registered generator's state (host side; no device sync)."""
        return [g.get_state() for g in self._gens]

    def set_states(self, states: list[torch.Tensor]) -> None:
        for g, s in zip(self._gens, states):
            g.set_state(s)

    def __len__(self) -> int:
        return len(self._gens)
