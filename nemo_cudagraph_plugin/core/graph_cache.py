"""A bounded, least-recently-used map from input signature to captured graph."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, Optional, TypeVar

__all__ = ["GraphCache"]

V = TypeVar("V")


class GraphCache(Generic[V]):
    """Keeps at most ``max_graphs`` entries; :meth:`get` marks an entry as most recently used.

    The cache never decides to run eagerly or to evict by itself: the engine asks
    :meth:`full` and then either runs the step eagerly or calls :meth:`evict_lru`.
    """

    def __init__(self, max_graphs: int) -> None:
        if max_graphs < 1:
            raise ValueError("max_graphs must be >= 1")
        self.max_graphs = max_graphs
        self._entries: OrderedDict[Hashable, V] = OrderedDict()

    def get(self, key: Hashable) -> Optional[V]:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def peek(self, key: Hashable) -> Optional[V]:
        """The entry for ``key`` without marking it used."""
        return self._entries.get(key)

    def pop(self, key: Hashable) -> V:
        return self._entries.pop(key)

    def put(self, key: Hashable, value: V) -> None:
        if key not in self._entries and self.full():
            raise RuntimeError("GraphCache is full; evict first")
        self._entries[key] = value
        self._entries.move_to_end(key)

    def full(self) -> bool:
        return len(self._entries) >= self.max_graphs

    def evict_lru(self) -> tuple[Hashable, V]:
        return self._entries.popitem(last=False)

    def clear(self) -> list[V]:
        values = list(self._entries.values())
        self._entries.clear()
        return values

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> Iterator[Hashable]:
        return iter(self._entries.keys())
