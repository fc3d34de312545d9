"""The last five operations of torch's capturable Adam update in one Triton kernel, with the same bits.

torch's capturable multi-tensor update ends (``torch/optim/adam.py``, ``_multi_tensor_adam``)::

    denom = _foreach_sqrt(exp_avg_sqs)              # reads v, writes denom
    _foreach_div_(denom, bias_correction2_sqrt)     # reads and writes denom
    _foreach_add_(denom, eps)                       # reads and writes denom
    _foreach_div_(denom, step_size)                 # reads and writes denom
    _foreach_addcdiv_(params, exp_avgs, denom)      # reads p, m, denom, writes p

twelve passes over parameter-sized memory, and a parameter-sized ``denom`` allocated. This kernel reads ``v``, ``m``
and ``p`` once and writes ``p`` once, computing each element with the same float32 operations in the same order,
each rounded as torch's CUDA kernels round it: ``sqrt_rn`` (torch's ``sqrtf``), ``div_rn`` (its IEEE division), an
add, ``div_rn``, and ``p + m / denom`` (torch's addcdiv with value 1). Nothing is contracted (there is no multiply
to fuse), so the parameters come out as the same bits, eight passes fewer.

Metadata: one int64 table per tensor set (addresses of ``p``, ``m``, ``v``, sizes, first program of each tensor, and
each program's tensor), built on the host; inside a capture the graph copies it from pinned memory before the
kernel (a copy node re-run by every replay), and :class:`FusedAdamTail` keeps both alive with itself.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .finite import capturing

__all__ = ["EagerAdamTail", "EagerSgdTail", "FusedAdamTail", "tail_applies"]

# Elements per load and loads per program: 16 KiB of each of the three tensors per program.
BLOCK, ITERS, NUM_WARPS = 1024, 4, 4


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # Not specialised on the tensor count: a capture must never meet a new variant of the kernel (compiling and
    # loading a module while a graph captures); FusedAdamTail.warm compiles the one the run uses before it.
    @triton.jit(do_not_specialize=["n_tensors"])
    def adam_tail_kernel(table, n_tensors, bc2s_ptr, step_size_ptr, eps, ref,
                         BLOCK: tl.constexpr, ITERS: tl.constexpr):
        c = tl.program_id(0)
        t = tl.load(table + 5 * n_tensors + c)
        p = tl.multiple_of(tl.load(table + t).to(ref.dtype), 16)
        m = tl.multiple_of(tl.load(table + n_tensors + t).to(ref.dtype), 16)
        v = tl.multiple_of(tl.load(table + 2 * n_tensors + t).to(ref.dtype), 16)
        numel = tl.load(table + 3 * n_tensors + t)
        start = (c - tl.load(table + 4 * n_tensors + t)) * (BLOCK * ITERS)  # int64: tensors may exceed 2**31
        bc2s = tl.load(bc2s_ptr)
        step_size = tl.load(step_size_ptr)
        if start + BLOCK * ITERS <= numel:  # a whole chunk: no mask (a mask of unknown alignment splits vectors)
            for i in tl.static_range(ITERS):
                offs = start + i * BLOCK + tl.arange(0, BLOCK)
                d = tl.math.div_rn(tl.math.div_rn(tl.math.sqrt_rn(tl.load(v + offs)), bc2s) + eps, step_size)
                tl.store(p + offs, tl.load(p + offs) + tl.math.div_rn(tl.load(m + offs), d))
        else:  # the tensor's last, partial chunk
            for i in tl.static_range(ITERS):
                offs = start + i * BLOCK + tl.arange(0, BLOCK)
                mask = offs < numel
                d = tl.math.div_rn(
                    tl.math.div_rn(tl.math.sqrt_rn(tl.load(v + offs, mask=mask, other=1.0)), bc2s) + eps, step_size)
                x = tl.load(p + offs, mask=mask, other=0.0) + tl.math.div_rn(tl.load(m + offs, mask=mask, other=0.0), d)
                tl.store(p + offs, x, mask=mask)

    return adam_tail_kernel


@functools.lru_cache(maxsize=1)
def _eager_kernel() -> Any:
    import triton
    import triton.language as tl

    # torch's non-capturable update ends with ``p.addcdiv_(m, d, value=s)`` (for-loop) or
    # ``_foreach_addcdiv_(ps, ms, ds, scalars)`` (multi-tensor), ``s`` a Python float. Both CUDA kernels convert ``s``
    # to float32 (opmath) and compute ``p + s * (m / d)`` in float32: an IEEE division, then ``a + s * q`` which nvcc
    # contracts into one FMA (torch >= 2.12 writes ``std::fma`` itself): one rounding, mirrored by ``fma``. Here ``s``
    # and ``bias_correction2_sqrt`` are read from device memory, one float32 per tensor.
    # The denominator is computed here from ``v``. The multi-tensor one: ``_foreach_sqrt`` (``sqrtf``),
    # ``_foreach_div_`` by the ScalarList (IEEE division by the float32 scalar), ``_foreach_add_(eps)`` (float32 add).
    # RECIP, the for-loop one: ``(v.sqrt() / bias_correction2_sqrt).add_(eps)``, whose CUDA division by a Python float
    # (a CPU scalar: ``div_true_kernel_cuda``) multiplies by a float32 reciprocal the host computed once (in double
    # or in float32, by torch version: the caller forms the same one and passes it in ``bc2s_ptr``), then adds eps: a
    # multiply and an add, each rounded (launched without FP fusion, which would contract them into one FMA).
    # BFloat16 tensors (ROUND): each operation computes in float32 (opmath) and stores BFloat16, so the denominator is
    # rounded to BFloat16 after the square root, the division (or multiply) and the add, and the parameter once
    # after the FMA. RNE: round to nearest even as c10's float -> BFloat16 conversion, on the float32's bits (add
    # 0x7FFF plus the lowest kept bit, clear the low half; NaN kept), the same on a GPU and in Triton's interpreter
    # (whose float32 -> bfloat16 cast truncates); the final cast is then exact.
    @triton.jit(do_not_specialize=["n_tensors"])
    def eager_adam_tail_kernel(table, n_tensors, bc2s_ptr, step_size_ptr, eps, ref, RECIP: tl.constexpr,
                               ROUND: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        c = tl.program_id(0)
        t = tl.load(table + 5 * n_tensors + c)
        p = tl.multiple_of(tl.load(table + t).to(ref.dtype), 16)
        m = tl.multiple_of(tl.load(table + n_tensors + t).to(ref.dtype), 16)
        x = tl.multiple_of(tl.load(table + 2 * n_tensors + t).to(ref.dtype), 16)
        numel = tl.load(table + 3 * n_tensors + t)
        start = (c - tl.load(table + 4 * n_tensors + t)) * (BLOCK * ITERS)
        s = tl.load(step_size_ptr + t)
        bc2s = tl.load(bc2s_ptr + t)
        for i in tl.static_range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < numel
            d = tl.load(x + offs, mask=mask, other=1.0).to(tl.float32)
            if ROUND:  # each rounded to BFloat16 as the bits of a float32 (see RNE below)
                d = tl.math.sqrt_rn(d)
                u = d.to(tl.uint32, bitcast=True)
                u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
                d = tl.where(d != d, d, u.to(tl.float32, bitcast=True))
                if RECIP:
                    d = d * bc2s  # RECIP: bc2s holds the reciprocal the for-loop's division multiplies by
                else:
                    d = tl.math.div_rn(d, bc2s)
                u = d.to(tl.uint32, bitcast=True)
                u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
                d = tl.where(d != d, d, u.to(tl.float32, bitcast=True))
                d = d + eps
                u = d.to(tl.uint32, bitcast=True)
                u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
                d = tl.where(d != d, d, u.to(tl.float32, bitcast=True))
            elif RECIP:
                d = tl.math.sqrt_rn(d) * bc2s + eps  # the reciprocal; two roundings: FP fusion is off here
            else:
                d = tl.math.div_rn(tl.math.sqrt_rn(d), bc2s) + eps
            q = tl.math.div_rn(tl.load(m + offs, mask=mask, other=0.0).to(tl.float32), d)
            new = tl.math.fma(s, q, tl.load(p + offs, mask=mask, other=0.0).to(tl.float32))
            if ROUND:
                u = new.to(tl.uint32, bitcast=True)
                u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
                new = tl.where(new != new, new, u.to(tl.float32, bitcast=True)).to(tl.bfloat16)  # exact now
            tl.store(p + offs, new, mask=mask)

    return eager_adam_tail_kernel


@functools.lru_cache(maxsize=1)
def _sgd_kernel() -> Any:
    import triton
    import triton.language as tl

    # torch's non-capturable SGD ends with ``_foreach_add_(params, grads, alpha=-lr)`` (multi-tensor) or
    # ``param.add_(grad, alpha=-lr)`` (for-loop), ``lr`` a Python float. Both CUDA kernels convert ``alpha`` to float32
    # (opmath) and compute ``p + alpha * g`` (``BinaryOpListAlphaFunctor``; the ufunc ``add``), which nvcc contracts
    # into one FMA: one rounding, mirrored by ``fma``. Here ``alpha`` is read from device memory (one float32 per
    # launch: a param group's).
    # BFloat16 tensors (ROUND): the same float32 alpha and FMA on the elements converted to float32 (opmath), the
    # result stored as BFloat16 (c10's round to nearest even, done on the float32's bits as in the Adam tail, since
    # Triton's interpreter truncates; the final cast is then exact).
    @triton.jit(do_not_specialize=["n_tensors"])
    def eager_sgd_tail_kernel(table, n_tensors, alpha_ptr, ref, ROUND: tl.constexpr, BLOCK: tl.constexpr,
                              ITERS: tl.constexpr):
        c = tl.program_id(0)
        t = tl.load(table + 5 * n_tensors + c)
        p = tl.multiple_of(tl.load(table + t).to(ref.dtype), 16)
        g = tl.multiple_of(tl.load(table + n_tensors + t).to(ref.dtype), 16)
        numel = tl.load(table + 3 * n_tensors + t)
        start = (c - tl.load(table + 4 * n_tensors + t)) * (BLOCK * ITERS)
        alpha = tl.load(alpha_ptr)
        for i in tl.static_range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < numel
            x = tl.load(p + offs, mask=mask, other=0.0)
            if ROUND:
                new = tl.math.fma(tl.load(g + offs, mask=mask, other=0.0).to(tl.float32), alpha, x.to(tl.float32))
                u = new.to(tl.uint32, bitcast=True)
                u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # RNE of the SGD update
                new = tl.where(new != new, new, u.to(tl.float32, bitcast=True)).to(tl.bfloat16)  # exact now
                tl.store(p + offs, new, mask=mask)
            else:
                tl.store(p + offs, tl.math.fma(tl.load(g + offs, mask=mask, other=0.0), alpha, x), mask=mask)

    return eager_sgd_tail_kernel


@functools.lru_cache(maxsize=1)
def _scale_kernel() -> Any:
    import triton
    import triton.language as tl

    # ``_foreach_mul_(params, f)`` with a Python float ``f`` on BFloat16 tensors (this kernel takes those only): ``f`` converted to float32 (opmath),
    # ``float32(p) * f`` rounded to float32, then to BFloat16 (round to nearest even). Here ``f`` is read from the
    # device (torch's own ``_foreach_mul_`` with a float32 0-d tensor would first round it to BFloat16).
    @triton.jit(do_not_specialize=["n_tensors"])
    def scale_kernel(table, n_tensors, factor_ptr, ref, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        c = tl.program_id(0)
        t = tl.load(table + 5 * n_tensors + c)
        p = tl.multiple_of(tl.load(table + t).to(ref.dtype), 16)
        numel = tl.load(table + 3 * n_tensors + t)
        start = (c - tl.load(table + 4 * n_tensors + t)) * (BLOCK * ITERS)
        f = tl.load(factor_ptr)
        for i in tl.static_range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < numel
            x = tl.load(p + offs, mask=mask, other=0.0).to(tl.float32) * f
            u = x.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # RNE, as in the Adam tail
            tl.store(p + offs, tl.where(x != x, x, u.to(tl.float32, bitcast=True)).to(tl.bfloat16), mask=mask)

    return scale_kernel


#: parameter dtypes the eager-math kernels take (one per launch)
TAIL_DTYPES = (torch.float32, torch.bfloat16)


def tail_applies(*lists: Sequence[Tensor], dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether the kernel can take these tensors: one dtype of ``dtypes``, contiguous, 16-byte aligned, non-empty,
    one device."""
    first = lists[0][0] if lists and lists[0] else None
    if first is None or first.dtype not in dtypes:
        return False
    return all(t.dtype == first.dtype and t.is_contiguous() and t.numel() > 0 and t.data_ptr() % 16 == 0
               and t.device == first.device for ts in lists for t in ts)


class FusedAdamTail:
    """Runs the tail of the update for one group's tensors (see the module docstring).

    A graph reads the table of the step it captured on every replay: the tables of captured launches stay allocated
    as long as this object lives (one per param group and capture, a few KiB each).
    """

    def __init__(self, block: int = BLOCK, iters: int = ITERS, num_warps: int = NUM_WARPS) -> None:
        self.block, self.iters, self.num_warps = block, iters, num_warps
        self._kept: list[tuple[Tensor, Tensor]] = []  # the tables of captured launches (host source, device copy)
        self._warm: set[Any] = set()

    def _table(self, params: Sequence[Tensor], exp_avgs: Sequence[Tensor],
               exp_avg_sqs: Sequence[Tensor]) -> tuple[Tensor, int]:
        per_program = self.block * self.iters
        rows: list[list[int]] = [[], [], [], [], [], []]
        for j, (p, m, v) in enumerate(zip(params, exp_avgs, exp_avg_sqs)):
            rows[0].append(p.data_ptr())
            rows[1].append(m.data_ptr())
            rows[2].append(v.data_ptr())
            rows[3].append(p.numel())
            rows[4].append(len(rows[5]))
            rows[5].extend([j] * -(-p.numel() // per_program))
        host = torch.tensor([x for row in rows for x in row], dtype=torch.int64)
        device = params[0].device
        if device.type == "cuda":
            host = host.pin_memory()
        # Pinned + non_blocking: no host sync. Inside a capture this copy is a node of the graph, re-run by every
        # replay before the kernel: the table is rewritten even where the graph's earlier kernels used its memory.
        table = host.to(device, non_blocking=True)
        if capturing(device):
            self._kept.append((host, table))  # the graph reads both on every replay
        return table, len(rows[5])

    def __call__(self, params: Sequence[Tensor], exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
                 bias_correction2_sqrt: Tensor, step_size: Tensor, eps: float) -> None:
        """``p += m / ((sqrt(v) / bias_correction2_sqrt + eps) / step_size)`` for each triple, as torch does it."""
        table, programs = self._table(params, exp_avgs, exp_avg_sqs)
        # params[0] only selects the pointer type (never read through); detached: a plain tensor for Triton's launcher
        _kernel()[(programs,)](table, len(params), bias_correction2_sqrt, step_size, float(eps), params[0].detach(),
                               BLOCK=self.block, ITERS=self.iters, num_warps=self.num_warps)

    def warm(self, device: torch.device) -> None:
        """Compile the kernel before any capture on ``device`` (a first launch inside a capture would compile)."""
        if device in self._warm:
            return
        p, m, v = (torch.ones(64, dtype=torch.float32, device=device) for _ in range(3))
        one = torch.ones((), dtype=torch.float32, device=device)
        self([p], [m], [v], one, one, 1e-8)  # not capturing: nothing is kept
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._warm.add(device)


class EagerAdamTail(FusedAdamTail):
    """The last operations of torch's *non-capturable* Adam update, with its Python scalars read from the device.

    ``p += s * (m / d)`` with ``s`` (the step size, one float32 per tensor) from device memory, rounded as torch's
    CUDA ``addcdiv`` rounds it (see :func:`_eager_kernel`); ``d`` computed from ``v`` (``bias_correction2_sqrt`` one
    float32 per tensor) as the multi-tensor path does, or as the for-loop path does on CUDA (``reciprocal=True``: the
    second tensor holds the float32 reciprocal the division by the Python float multiplies by,
    :func:`.user_adam.device_scalars`).
    """

    def __call__(self, params: Sequence[Tensor], exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],  # type: ignore[override]
                 bias_correction2_sqrt: Tensor, step_size: Tensor, eps: float, reciprocal: bool = False) -> None:
        table, programs = self._table(params, exp_avgs, exp_avg_sqs)
        # the for-loop denominator's multiply and add are two roundings: no FP fusion (an FMA) in that variant
        options = {"enable_fp_fusion": False} if reciprocal else {}
        _eager_kernel()[(programs,)](table, len(params), bias_correction2_sqrt, step_size, float(eps),
                                     params[0].detach(), RECIP=reciprocal,
                                     ROUND=params[0].dtype == torch.bfloat16, BLOCK=self.block, ITERS=self.iters,
                                     num_warps=self.num_warps, **options)

    def scale(self, params: Sequence[Tensor], factor: Tensor) -> None:
        """``p *= factor`` for BFloat16 ``params`` as torch's ``_foreach_mul_`` with a Python float computes it,
        ``factor`` a float32 0-d device tensor (see :func:`_scale_kernel`)."""
        table, programs = self._table(params, params, params)
        _scale_kernel()[(programs,)](table, len(params), factor, params[0].detach(), BLOCK=self.block,
                                     ITERS=self.iters, num_warps=self.num_warps)

    def warm(self, device: torch.device, dtypes: Sequence[torch.dtype] = (torch.float32,)) -> None:
        """Compile the variants :func:`.user_adam.update` launches for parameters of ``dtypes`` (the multi-tensor and
        the for-loop denominator; BFloat16's decay) before any capture on ``device``."""
        if (device, tuple(dtypes)) in self._warm:
            return
        for dtype in dtypes:
            p, m, v = (torch.ones(64, dtype=dtype, device=device) for _ in range(3))
            one = torch.ones(1, dtype=torch.float32, device=device)
            for reciprocal in (False, True):
                self([p], [m], [v], one, one, 1e-8, reciprocal=reciprocal)
            if dtype == torch.bfloat16:
                self.scale([p], one.reshape(()))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._warm.add((device, tuple(dtypes)))


class EagerSgdTail(FusedAdamTail):
    """The last operation of torch's SGD update, ``p += alpha * g`` with ``alpha = float32(-lr)`` read from the device,
    rounded as torch's CUDA ``add`` with ``alpha`` rounds it (one FMA, then BFloat16's rounding for BFloat16 tensors;
    see :func:`_sgd_kernel`)."""

    def __call__(self, params: Sequence[Tensor], grads: Sequence[Tensor], alpha: Tensor) -> None:  # type: ignore[override]
        table, programs = self._table(params, grads, grads)
        _sgd_kernel()[(programs,)](table, len(params), alpha, params[0].detach(), ROUND=params[0].dtype == torch.bfloat16,
                                   BLOCK=self.block, ITERS=self.iters, num_warps=self.num_warps)

    def warm(self, device: torch.device, dtypes: Sequence[torch.dtype] = (torch.float32,)) -> None:
        """Compile the variants for parameters of ``dtypes`` before any capture on ``device``."""
        if (device, tuple(dtypes)) in self._warm:
            return
        for dtype in dtypes:
            p, g = (torch.ones(64, dtype=dtype, device=device) for _ in range(2))
            self([p], [g], torch.ones((), dtype=torch.float32, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._warm.add((device, tuple(dtypes)))
