"""torch's own SGD update inside a graph: the bits of the user's eager step.

torch's SGD (``torch/optim/sgd.py``: ``_multi_tensor_sgd``, torch's default on CUDA, and ``_single_tensor_sgd``, the
for-loop update) takes every hyperparameter as a Python float. Only one of them changes during training: ``lr``,
which enters the last operation::

    _foreach_add_(params, grads, alpha=-lr)      # for-loop: param.add_(grad, alpha=-lr)

and a graph would freeze it. Here ``lr`` is a float64 device tensor that the host sets before each step from the
group's float (schedulers keep assigning floats, as without graphs); ``alpha = float32(-lr)`` is computed on the
device (a negation, exact, then the round to nearest torch's kernel does when it converts its Python scalar to the
float32 opmath type), and the update ``p + alpha * g`` is rounded as torch's kernels round it: one FMA on CUDA
(:class:`~.adam_tail.EagerSgdTail`, a Triton kernel) and on the CPU (the tape backend of the tests; torch's CPU ``add``
is a vectorised ``fmadd`` there too), where :func:`fma_f32` computes it exactly from float64 operations.

BFloat16 parameters: on CUDA both kernels compute in float32 (opmath) with the same float32 ``alpha``, one FMA, and
store the result as BFloat16 (round to nearest even); the Triton kernel does the same. torch's CPU ``add`` differs
(measured against torch 2.13 bit for bit, :func:`add_bf16_cpu`): it converts ``alpha`` to BFloat16, computes the
vectorised lanes as a float32 FMA rounded to BFloat16, and the last ``numel % (2 * lanes)`` elements of each thread's
range (all of them on the DEFAULT capability) in BFloat16 arithmetic: the product rounded to BFloat16, then the sum.

Everything else is torch's own call with torch's own float arguments, in torch's order: ``maximize``'s negation, the
coupled weight decay ``_foreach_add(grads, params, alpha=weight_decay)``, the momentum buffers (created by a clone on
their first step, then ``_foreach_mul_(bufs, momentum)`` and ``_foreach_add_(bufs, grads, alpha=1 - dampening)``) and
Nesterov's ``_foreach_add_(grads, bufs, alpha=momentum)``. Those constants may be frozen: the engine re-captures when
one changes.

Scope (else the plugin's capturable preparation is used and the summary says the graphed math differs):
``torch.optim.SGD`` with torch's own ``step``, torch 2.11 - 2.13, a float ``lr``, not fused, not differentiable,
float32 or BFloat16 parameters (one dtype) on one device, Triton on CUDA, no ``nan_action="skip"`` (that needs the
fused kernel's ``found_inf``); BFloat16 on the CPU: an x86 CPU capability (DEFAULT, AVX2, AVX512) and OpenMP or
torch's native thread pool, whose kernel layout :func:`add_bf16_cpu` mirrors.
"""

from __future__ import annotations

import functools
import platform
from typing import Optional

import torch
from torch import Tensor

from ._torch_compat import (
    ADAM_STEP_SHAPE,
    TORCH_VERSION,
    runs_foreach,
    sgd_init_group,
    sgd_step_is_torchs,
)
from .adam_step import plain_float32_params
from .adam_tail import TAIL_DTYPES, EagerSgdTail, tail_applies
from .finite import triton_available
from .user_step import SKIP_NONFINITE, UserStep

__all__ = ["UserMathSGD", "add_bf16_cpu", "add_scaled", "fma_f32", "update", "why_not"]

#: Half the BFloat16 elements torch's CPU ``add`` takes per vectorised step, per x86 CPU capability, measured with
#: torch 2.13 (which elements of an ``n``-element add store the vectorised NaN, 0xFFFF): 32 per step with the AVX2
#: kernels and with the AVX512 ones too (an AMD EPYC with AVX512-BF16), not the 64 that ``Vectorized<BFloat16>``'s
#: 32 AVX512 lanes would suggest; DEFAULT's generic ``Vectorized`` computes element by element in BFloat16, as the
#: scalar loop does (0: no vectorised lanes)
BF16_LANES = {"DEFAULT": 0, "AVX2": 16, "AVX512": 16}
#: ``at::internal::GRAIN_SIZE``: TensorIterator splits a range among threads only above it
GRAIN_SIZE = 32768
#: the BFloat16 NaN that c10's scalar conversion and the vectorised ``cvtfp32_bf16`` store
NAN_SCALAR, NAN_VECTOR = 0x7FC0, 0xFFFF


def cpu_capability() -> str:
    """The kernels torch's CPU dispatch picked (``ATEN_CPU_CAPABILITY`` may lower it)."""
    return torch.backends.cpu.get_cpu_capability()


@functools.lru_cache(maxsize=1)
def parallel_backend() -> str:
    """ATen's intra-op backend (``"OpenMP"``, ``"native thread pool"``), as ``torch.__config__`` names it."""
    for line in torch.__config__.parallel_info().splitlines():
        if line.startswith("ATen parallel backend:"):
            return line.split(":", 1)[1].strip()
    return ""


def bf16_cpu_why_not() -> Optional[str]:
    """Why :func:`add_bf16_cpu` cannot mirror torch's CPU ``add`` of BFloat16 tensors here (``None``: it can)."""
    machine, cap, backend = platform.machine(), cpu_capability(), parallel_backend()
    what = "torch's CPU add of bfloat16 tensors is mirrored"
    if machine not in ("x86_64", "AMD64") or cap not in BF16_LANES:
        return f"{what} on x86 (DEFAULT, AVX2, AVX512), not on {machine} with CPU capability {cap}"
    if backend not in ("OpenMP", "native thread pool"):
        return f"{what} with OpenMP or the native thread pool, not {backend!r}"
    return None


def why_not(optimizer: torch.optim.Optimizer, device_type: str = "cuda", skip_nonfinite: bool = False) -> Optional[str]:
    """Why the user's own SGD update cannot be captured for ``optimizer`` (``None``: it can)."""
    name = type(optimizer).__name__
    lo, hi = ADAM_STEP_SHAPE
    if not isinstance(optimizer, torch.optim.SGD) or not sgd_step_is_torchs(optimizer):
        return f"{name} is not torch.optim.SGD with torch's own step()"
    if not lo <= TORCH_VERSION <= hi:
        return f"torch {TORCH_VERSION} is outside {lo.base_version} - {hi.major}.{hi.minor}, whose SGD step it mirrors"
    if skip_nonfinite:
        return SKIP_NONFINITE
    if device_type == "cuda" and not triton_available():
        return "Triton is not available (the update's last operation needs its kernel)"
    devices: set = set()
    for i, g in enumerate(optimizer.param_groups):
        off = [k for k in ("fused", "differentiable") if g.get(k)]
        if off:
            return f"param group {i} is {', '.join(off)}"
        if isinstance(g["lr"], Tensor):
            return f"param group {i} has a tensor lr"
        if (why := plain_float32_params(i, g, device_type, devices, TAIL_DTYPES)) is not None:
            return why
    if len({d for d, _ in devices}) > 1:
        return f"{name}'s parameters live on {len({d for d, _ in devices})} devices"
    if len(devices) > 1:
        return f"{name}'s parameters mix dtypes ({', '.join(sorted(str(t) for _, t in devices))})"
    if device_type == "cpu" and any(t == torch.bfloat16 for _, t in devices):
        return bf16_cpu_why_not()
    return None


def fma_f32(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """float32 ``a * b + c`` rounded once (an FMA), from float64 operations: the product is exact in float64, the sum
    is rounded to odd (TwoSum's error decides the last bit), and round-to-odd followed by a round to float32 is the
    correctly rounded float32 result (53 >= 2 * 24 + 2 bits)."""
    x = a.double() * b.double()
    y = c.double()
    s = x + y
    bp = s - x
    err = (x - (s - bp)) + (y - bp)  # s + err == x + y exactly
    inexact_even = (err != 0) & ((s.view(torch.int64) & 1) == 0) & s.isfinite()
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where(inexact_even, torch.nextafter(s, toward), s).to(torch.float32)


def _bf16_bits(x: Tensor, nan: int) -> Tensor:
    """The BFloat16 bits (int64, 0 - 0xFFFF) of float32 ``x`` rounded to nearest even as c10 and the vectorised
    conversion round it (on the float32's bits: add 0x7FFF plus the lowest kept bit, keep the high half), NaN as
    ``nan``."""
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(x.isnan(), nan, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)


def _as_bf16(bits: Tensor) -> Tensor:
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


def _vectorised_spans(n: int, lanes: int) -> list[tuple[int, int]]:
    """The elements of a contiguous ``n``-element ``add`` that torch's CPU kernel computes in vectorised lanes:
    TensorIterator hands each thread a range (``at::parallel_for``'s split above :data:`GRAIN_SIZE`) and
    ``vectorized_loop`` takes ``2 * lanes`` elements at a time from its start, the rest element by element."""
    if not lanes:
        return []
    threads = torch.get_num_threads()
    if n <= GRAIN_SIZE or threads == 1:
        size = n
    elif parallel_backend() == "OpenMP":  # ParallelOpenMP.h: min(threads, ceil(n / grain)) equal ranges
        size = -(-n // min(threads, -(-n // GRAIN_SIZE)))
    else:  # ParallelNative.cpp: ceil(n / threads), at least the grain
        size = max(GRAIN_SIZE, -(-n // threads))
    step = 2 * lanes
    spans = [(b, b + (min(n, b + size) - b) // step * step) for b in range(0, n, size)]
    return [(b, e) for b, e in spans if e > b]


def add_bf16_cpu(p: Tensor, g: Tensor, alpha: Tensor) -> Tensor:
    """torch's CPU ``p.add(g, alpha=a)`` of BFloat16 tensors, bit for bit (NaN patterns too), for a Python ``a`` whose
    float32 is ``alpha`` (0-d): the ufunc kernel converts ``a`` to BFloat16 (``Scalar.to<BFloat16>()``: double ->
    float -> BFloat16); its vectorised lanes compute ``fmadd(g, a, p)`` in float32 and round once to BFloat16
    (``cvtfp32_bf16``), the remaining elements ``p + a * g`` in BFloat16 arithmetic (each operation rounded)."""
    if not (p.is_contiguous() and g.is_contiguous()) or p.shape != g.shape:
        raise RuntimeError("the eager-math SGD update of BFloat16 parameters on the CPU needs contiguous tensors")
    a = _as_bf16(_bf16_bits(alpha.to(torch.float32), NAN_SCALAR)).float()
    pf, gf = p.reshape(-1).float(), g.reshape(-1).float()
    out = _bf16_bits(pf + _as_bf16(_bf16_bits(gf * a, NAN_SCALAR)).float(), NAN_SCALAR)
    lanes = BF16_LANES.get(cpu_capability(), 0)
    spans = _vectorised_spans(p.numel(), lanes)
    if spans:
        vec = _bf16_bits(fma_f32(gf, a, pf), NAN_VECTOR)
        for b, e in spans:
            out[b:e] = vec[b:e]
    return _as_bf16(out).view(p.shape)


def add_scaled(params: list[Tensor], grads: list[Tensor], alpha: Tensor, tail: Optional[EagerSgdTail] = None) -> None:
    """``p += alpha * g`` for each pair as torch's ``add`` with a Python ``alpha`` computes it (one FMA; BFloat16 on
    the CPU: :func:`add_bf16_cpu`), ``alpha`` a float32 0-d device tensor."""
    if any(p.numel() == 0 for p in params):  # nothing to update (and no kernel takes them)
        kept = [(p, g) for p, g in zip(params, grads) if p.numel()]
        params, grads = [p for p, _ in kept], [g for _, g in kept]
        if not params:
            return
    if tail is not None and tail_applies(params, grads, dtypes=TAIL_DTYPES):
        tail(params, grads, alpha)
    elif params[0].device.type != "cpu":
        # why_not refuses CUDA without Triton; a tensor the kernel cannot take (not contiguous): no exact route
        raise RuntimeError("the eager-math SGD update needs its Triton kernel for these tensors")
    elif params[0].dtype == torch.bfloat16:
        for p, g in zip(params, grads):
            p.copy_(add_bf16_cpu(p, g, alpha))
    else:
        for p, g in zip(params, grads):
            p.copy_(fma_f32(g, alpha, p))


def update(params: list[Tensor], grads: list[Tensor], bufs: list[Optional[Tensor]], *, foreach: bool,
           weight_decay: float, momentum: float, dampening: float, nesterov: bool, maximize: bool, lr: Tensor,
           tail: Optional[EagerSgdTail] = None) -> None:
    """One SGD update (torch's multi-tensor or for-loop path) with ``lr`` a float64 0-d device tensor; ``bufs`` (the
    momentum buffers, ``None`` before their first step) is filled in place as torch fills it."""
    if not params:
        return
    if foreach:
        if maximize:
            grads = torch._foreach_neg(grads)
        if weight_decay != 0:
            if maximize:
                torch._foreach_add_(grads, params, alpha=weight_decay)
            else:
                grads = torch._foreach_add(grads, params, alpha=weight_decay)
        if momentum != 0:
            if all(b is not None for b in bufs):
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, grads, alpha=1 - dampening)
            else:
                for i, b in enumerate(bufs):
                    if b is None:
                        bufs[i] = grads[i].detach().clone()
                    else:
                        b.mul_(momentum).add_(grads[i], alpha=1 - dampening)
            if nesterov:
                torch._foreach_add_(grads, bufs, alpha=momentum)
            else:
                grads = list(bufs)
    else:
        out = []
        for i, p in enumerate(params):
            g = grads[i] if not maximize else -grads[i]
            if weight_decay != 0:
                g = g.add(p, alpha=weight_decay)
            if momentum != 0:
                b = bufs[i]
                if b is None:
                    b = bufs[i] = g.detach().clone()
                else:
                    b.mul_(momentum).add_(g, alpha=1 - dampening)
                g = g.add(b, alpha=momentum) if nesterov else b
            out.append(g)
        grads = out
    add_scaled(params, grads, (-lr).to(torch.float32), tail)  # the float32 a Python -lr becomes in the kernel


class _Lr:
    """A param group's float ``lr`` (the host's) and its float64 device copy."""

    def __init__(self, lr: float, device: torch.device) -> None:
        self.value = lr
        self.tensor = torch.tensor(lr, dtype=torch.float64, device=device)


class UserMathSGD(UserStep):
    """Captures the user's own SGD update (see the module docstring): installed on the optimizer instance for as long
    as graphs may be captured (:meth:`install` / :meth:`remove`); :meth:`sync` before every step (float compares)."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device,
                 fused_tail: Optional[bool] = None) -> None:
        super().__init__(optimizer, device)
        use = triton_available() and device.type == "cuda" if fused_tail is None else fused_tail
        self.tail: Optional[EagerSgdTail] = EagerSgdTail() if use else None
        self.groups: list[_Lr] = []

    def install(self) -> None:
        """Make the device lr tensors and take over the instance's ``step``."""
        if self.tail is not None:
            dtypes = {p.dtype for g in self.optimizer.param_groups for p in g["params"]}
            self.tail.warm(self.device, sorted(dtypes, key=str))
        self.groups = [_Lr(float(g["lr"]), self.device) for g in self.optimizer.param_groups]
        self._take_step()

    def sync(self) -> Optional[str]:
        for group, g in zip(self.optimizer.param_groups, self.groups):
            lr = group["lr"]
            if lr != g.value:
                g.tensor.fill_(float(lr))
                g.value = lr

    def tensors(self) -> list[tuple[str, Tensor]]:
        return [(f"param group {i} lr (float64) tensor", g.tensor) for i, g in enumerate(self.groups)]

    def _update(self, opt: torch.optim.Optimizer) -> None:
        for group, g in zip(opt.param_groups, self.groups):
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Optional[Tensor]] = []
            if sgd_init_group(opt, group, params, grads, bufs):
                raise RuntimeError("a sparse gradient cannot be updated inside a graph (its shape changes)")
            foreach = runs_foreach(group, params, adam=False)
            update(params, grads, bufs, foreach=bool(foreach), weight_decay=group["weight_decay"],
                   momentum=group["momentum"], dampening=group["dampening"], nesterov=group["nesterov"],
                   maximize=group["maximize"], lr=g.tensor, tail=self.tail)
            if group["momentum"] != 0:  # as SGD.step: the buffers made on the first step become state
                for p, b in zip(params, bufs):
                    opt.state[p]["momentum_buffer"] = b
