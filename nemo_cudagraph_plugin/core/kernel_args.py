"""Float kernel arguments that change between replays of one graph: a fused optimizer's learning rate.

A CUDA graph replays every kernel with the arguments it was captured with. torch's fused Adam/AdamW kernel takes the
learning rate as a float64 kernel argument (a tensor ``lr`` it reads as float32, which is not the user's double), so a
graph would replay the capture's learning rate for ever, and no device tensor gives the kernel the user's bits.

Here such an argument is captured as a *sentinel*, a NaN whose payload names it (:meth:`HostScalars.argument`, inside
a backend's :func:`capture_scope`). After the capture the backend finds the kernel nodes that received a sentinel
(``_cuda_nodes.ScalarArgs``: each node's arguments, sized by ``cuFuncGetParamInfo``) and, before each replay in which a
value changed, writes the host's current double into those nodes of the executable graph
(``cuGraphExecKernelNodeSetParams``). The kernel then receives exactly the double the eager step passes: no device
memory, no host sync, and torch's own kernel.

A sentinel is a NaN so that a launch the update missed cannot train silently: its parameters become NaN, which the
NaN guard names. A capture whose sentinels are not all found fails (the backend raises), as any other capture error.

What is captured: the kernels and every other argument as at capture (betas, eps and weight decay are constants; the
engine re-captures when one changes). Not captured: the values of these scalars, which the host owns.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import struct
import threading
from collections.abc import Iterable, Iterator
from typing import Optional

__all__ = ["HostScalars", "capture_open", "capture_scope", "float_bits", "live_slot"]

# A quiet NaN (exponent all ones, bit 51 set) with a marker in the high payload bits and a counter in the low ones:
# no arithmetic produces these bits, and two slots never share them.
_MARK = 0x7FFC_6A50_0000_0000
_counter = itertools.count(1)
_local = threading.local()


def float_bits(x: float) -> int:
    """The 64 bits of the double ``x`` (a sentinel as a kernel argument holds them)."""
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", b))[0]


class HostScalars:
    """Float kernel arguments owned by the host, one per slot (a param group's ``lr``).

    :meth:`set` before every step (a float compare per slot); :meth:`argument` where the kernel's caller passes the
    value: the value itself when no capture is open, else the slot's sentinel (recorded in the capture's scope).
    ``version`` counts the changes, so a graph rewrites its nodes only after one.
    """

    def __init__(self, values: Iterable[float]) -> None:
        self.values: list[float] = [float(v) for v in values]
        self.version = 0
        self.sentinels: list[float] = []
        self._bits: list[int] = []
        for _ in self.values:
            b = _MARK | next(_counter)
            self._bits.append(b)
            self.sentinels.append(_from_bits(b))

    def set(self, i: int, value: float) -> None:
        """Slot ``i`` now holds ``value`` (a Python float: the user's double)."""
        cur = self.values[i]
        # bit equality: 0.0 and -0.0 compare equal but are different arguments
        if value != cur or math.copysign(1.0, value) != math.copysign(1.0, cur):
            self.values[i] = float(value)
            self.version += 1

    def argument(self, i: int) -> float:
        """What to pass the kernel for slot ``i``: its value, or inside a capture its sentinel."""
        used = getattr(_local, "used", None)
        if used is None:
            return self.values[i]
        used[self._bits[i]] = (self, i)
        return self.sentinels[i]


@contextlib.contextmanager
def capture_scope() -> Iterator[dict[int, tuple[HostScalars, int]]]:
    """Open while a backend captures a graph: yields the sentinels passed to kernels in it (bits -> (scalars, slot)),
    filled as the step runs. Scopes do not nest (the inner one hides the outer until it closes)."""
    prev = getattr(_local, "used", None)
    used: dict[int, tuple[HostScalars, int]] = {}
    _local.used = used
    try:
        yield used
    finally:
        _local.used = prev


def capture_open() -> bool:
    """Whether a backend is capturing a graph on this thread (CUDA's or a stand-in: the scope both open)."""
    return getattr(_local, "used", None) is not None


def live_slot(value: object) -> Optional[tuple[HostScalars, int]]:
    """The slot whose sentinel ``value`` is, in the open capture scope (``None``: not a sentinel of it)."""
    used = getattr(_local, "used", None)
    if not used or not isinstance(value, float) or value == value:  # sentinels are NaNs
        return None
    return used.get(float_bits(value))

