"""Many byte-matrix transposes in one kernel launch (the fused FP8 transpose refresh).

Why: refreshing a model's FP8 transposes one ``_create_transpose()`` at a time costs one kernel per
weight. At the sizes of a small GPT those kernels are latency-bound (measured on an H200 with TE
2.20.2: 48 weights, 81 MiB, 175 us per refresh, about 3.6 us per kernel against about 0.9 us of
memory traffic each), so the refresh's share of the step grows with the number of weights, not
their bytes. One launch that walks all ``(source, destination)`` pairs tile by tile removes the
per-kernel cost.

What it computes, per pair: ``dst.view(K, M)[k, m] = src.view(M, K)[m, k]`` on raw bytes, which is
TE's ``fp8_transpose`` layout (data ``[*M, K]`` -> transpose ``[K, *M]``). It reads the pointers
recorded at build time: a :class:`MultiTranspose` is built once, outside any graph capture (the
metadata goes to the device with an asynchronous copy from pinned memory: no host sync), and launched
as often as needed, captured or not.
The caller keeps it alive as long as a graph that launched it can replay (the kernel reads its
metadata tensors).

The kernel is Triton's (shipped with CUDA builds of PyTorch). Without Triton or on the CPU,
:meth:`MultiTranspose.run` does the same with one ``copy_`` per pair.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..core.finite import triton_available

__all__ = ["MultiTranspose", "plan_tiles", "triton_available"]

# Tile (rows x columns of the source, in bytes) and warps per program: the fastest of 10 tile shapes x
# 1/2/4/8 warps on an H200 for the small and medium presets' weights (1.7 TB/s; 64x64 with 4 warps: 1.5 TB/s).
BLOCK_M, BLOCK_K, NUM_WARPS = 32, 64, 1


def plan_tiles(
    shapes: Sequence[tuple[int, int]], block_m: int = BLOCK_M, block_k: int = BLOCK_K
) -> tuple[list[int], list[int], list[int]]:
    """Tile bookkeeping for ``shapes`` (``(M, K)`` of each source).

    Returns ``(tile_start, k_tiles, owner)``: the first global tile index of each pair, how many
    tiles span its ``K`` dimension, and for every global tile the pair it belongs to. Tile ``i`` of
    pair ``p`` covers rows ``(i // k_tiles[p]) * block_m ...`` and columns ``(i % k_tiles[p]) * block_k ...``.
    """
    tile_start: list[int] = []
    k_tiles: list[int] = []
    owner: list[int] = []
    total = 0
    for p, (m, k) in enumerate(shapes):
        if m <= 0 or k <= 0:
            raise ValueError(f"pair {p}: empty matrix {m}x{k}")
        mt, kt = -(-m // block_m), -(-k // block_k)
        tile_start.append(total)
        k_tiles.append(kt)
        owner.extend([p] * (mt * kt))
        total += mt * kt
    return tile_start, k_tiles, owner


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def multi_transpose_kernel(
        owner_ptr, tile_start_ptr, src_ptrs, dst_ptrs, rows_ptr, cols_ptr, k_tiles_ptr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        p = tl.load(owner_ptr + pid)
        local = pid - tl.load(tile_start_ptr + p)
        m_rows = tl.load(rows_ptr + p)
        k_cols = tl.load(cols_ptr + p)
        n_kt = tl.load(k_tiles_ptr + p)
        offs_m = (local // n_kt) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = (local % n_kt) * BLOCK_K + tl.arange(0, BLOCK_K)
        src = tl.load(src_ptrs + p).to(tl.pointer_type(tl.uint8))
        dst = tl.load(dst_ptrs + p).to(tl.pointer_type(tl.uint8))
        x = tl.load(
            src + offs_m[:, None] * k_cols + offs_k[None, :],
            mask=(offs_m[:, None] < m_rows) & (offs_k[None, :] < k_cols),
            other=0,
        )
        tl.store(
            dst + offs_k[:, None] * m_rows + offs_m[None, :],
            tl.trans(x),
            mask=(offs_k[:, None] < k_cols) & (offs_m[None, :] < m_rows),
        )

    return multi_transpose_kernel


class MultiTranspose:
    """Transpose every ``(src, dst)`` pair in one launch; build once, :meth:`run` many times.

    Args:
        pairs: ``(src, dst)`` tensors with 1-byte elements on one device. ``src`` is contiguous and
            read as ``[M, K]`` (``K = src.shape[-1]``); ``dst`` is contiguous with ``M * K`` elements
            and written as ``[K, M]``.
        use_triton: ``None`` picks Triton on CUDA when it imports; ``False`` forces the per-pair
            ``copy_`` path (what runs on the CPU).
        block_m, block_k: source tile in bytes (powers of two, >= 16).
        num_warps: warps per tile program.

    Raises:
        ValueError: a pair has the wrong element size, layout, size or device.
        RuntimeError: built while a CUDA graph is capturing (the metadata needs a host copy).
    """

    def __init__(
        self,
        pairs: Sequence[tuple[Tensor, Tensor]],
        *,
        use_triton: bool | None = None,
        block_m: int = BLOCK_M,
        block_k: int = BLOCK_K,
        num_warps: int = NUM_WARPS,
    ) -> None:
        for b in (block_m, block_k):
            if b < 16 or b & (b - 1):
                raise ValueError(f"tile edge {b}: use a power of two >= 16")
        self.block_m, self.block_k, self.num_warps = block_m, block_k, num_warps
        if not pairs:
            raise ValueError("MultiTranspose needs at least one (src, dst) pair")
        device = pairs[0][0].device
        shapes: list[tuple[int, int]] = []
        self._views: list[tuple[Tensor, Tensor]] = []
        for i, (src, dst) in enumerate(pairs):
            if src.element_size() != 1 or dst.element_size() != 1:
                raise ValueError(f"pair {i}: expected 1-byte elements, got {src.dtype} -> {dst.dtype}")
            if not (src.is_contiguous() and dst.is_contiguous()):
                raise ValueError(f"pair {i}: source and destination must be contiguous")
            if src.device != device or dst.device != device:
                raise ValueError(f"pair {i}: all tensors must be on {device}")
            k = src.shape[-1] if src.dim() else 1
            if src.numel() == 0 or dst.numel() != src.numel():
                raise ValueError(f"pair {i}: source has {src.numel()} bytes, destination {dst.numel()}")
            m = src.numel() // k
            shapes.append((m, k))
            self._views.append((src.view(torch.uint8).view(m, k), dst.view(torch.uint8).view(k, m)))
        self.device = device
        self.shapes = shapes
        self.key = tuple((s.data_ptr(), d.data_ptr(), m, k) for (s, d), (m, k) in zip(self._views, shapes))
        want = triton_available() if use_triton is None else use_triton
        self.uses_triton = bool(want and device.type == "cuda")
        if self.uses_triton:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("MultiTranspose must be built outside CUDA graph capture (its metadata is copied from the host)")
            tile_start, k_tiles, owner = plan_tiles(shapes, block_m, block_k)

            def upload(values: list[int], dtype: torch.dtype = torch.int64) -> Tensor:
                # Pinned + non_blocking: no host sync (this may run in a step checked by sync-debug mode);
                # torch's pinned allocator keeps the staging block until the copy has run.
                return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)

            self._args = (
                upload(owner, torch.int32),
                upload(tile_start),
                upload([s.data_ptr() for s, _ in self._views]),
                upload([d.data_ptr() for _, d in self._views]),
                upload([m for m, _ in shapes]),
                upload([k for _, k in shapes]),
                upload(k_tiles),
            )
            self._grid = (len(owner),)
            self._launch = _kernel()[self._grid]

    def __len__(self) -> int:
        return len(self.shapes)

    def run(self) -> None:
        """Write every transpose (one kernel on the current stream with Triton; captured when capturing)."""
        if self.uses_triton:
            self._launch(*self._args, BLOCK_M=self.block_m, BLOCK_K=self.block_k, num_warps=self.num_warps)
            return
        for src, dst in self._views:
            dst.copy_(src.t())
