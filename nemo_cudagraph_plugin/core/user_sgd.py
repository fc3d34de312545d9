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

Everything else is torch's own call with torch's own float arguments, in torch's order: ``maximize``'s negation, the
coupled weight decay ``_foreach_add(grads, params, alpha=weight_decay)``, the momentum buffers (created by a clone on
their first step, then ``_foreach_mul_(bufs, momentum)`` and ``_foreach_add_(bufs, grads, alpha=1 - dampening)``) and
Nesterov's ``_foreach_add_(grads, bufs, alpha=momentum)``. Those constants may be frozen: the engine re-captures when
one changes.

Scope (else the plugin's capturable preparation is used and the summary says the graphed math differs):
``torch.optim.SGD`` with torch's own ``step``, torch 2.11 - 2.13, a float ``lr``, not fused, not differentiable,
float32 parameters on one device, Triton on CUDA, no ``nan_action="skip"`` (that needs the fused kernel's
``found_inf``).
"""

from __future__ import annotations

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
from .adam_tail import EagerSgdTail, tail_applies
from .finite import triton_available
from .user_step import UserStep

__all__ = ["UserMathSGD", "add_scaled", "fma_f32", "update", "why_not"]


def why_not(optimizer: torch.optim.Optimizer, device_type: str = "cuda", skip_nonfinite: bool = False) -> Optional[str]:
    """Why the user's own SGD update cannot be captured for ``optimizer`` (``None``: it can)."""
    name = type(optimizer).__name__
    lo, hi = ADAM_STEP_SHAPE
    if not isinstance(optimizer, torch.optim.SGD) or not sgd_step_is_torchs(optimizer):
        return f"{name} is not torch.optim.SGD with torch's own step()"
    if not lo <= TORCH_VERSION <= hi:
        return f"torch {TORCH_VERSION} is outside {lo.base_version} - {hi.major}.{hi.minor}, whose SGD step it mirrors"
    if skip_nonfinite:
        return "nan_action='skip' runs the fused kernel (it reads found_inf on the device)"
    if device_type == "cuda" and not triton_available():
        return "Triton is not available (the update's last operation needs its kernel)"
    devices: set = set()
    for i, g in enumerate(optimizer.param_groups):
        off = [k for k in ("fused", "differentiable") if g.get(k)]
        if off:
            return f"param group {i} is {', '.join(off)}"
        if isinstance(g["lr"], Tensor):
            return f"param group {i} has a tensor lr"
        if (why := plain_float32_params(i, g, device_type, devices)) is not None:
            return why
    if len(devices) > 1:
        return f"{name}'s parameters live on {len(devices)} devices"
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


def add_scaled(params: list[Tensor], grads: list[Tensor], alpha: Tensor, tail: Optional[EagerSgdTail] = None) -> None:
    """``p += alpha * g`` for each pair as torch's ``add`` with a Python ``alpha`` computes it (one FMA), ``alpha`` a
    float32 0-d device tensor."""
    if any(p.numel() == 0 for p in params):  # nothing to update (and no kernel takes them)
        kept = [(p, g) for p, g in zip(params, grads) if p.numel()]
        params, grads = [p for p, _ in kept], [g for _, g in kept]
        if not params:
            return
    if tail is not None and tail_applies(params, grads):
        tail(params, grads, alpha)
    elif params[0].device.type == "cpu":
        for p, g in zip(params, grads):
            p.copy_(fma_f32(g, alpha, p))
    else:  # why_not refuses CUDA without Triton; a tensor the kernel cannot take (not contiguous): no exact route
        raise RuntimeError("the eager-math SGD update needs its Triton kernel for these tensors")


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
            self.tail.warm(self.device)
        self.groups = [_Lr(float(g["lr"]), self.device) for g in self.optimizer.param_groups]
        self._take_step()

    def sync(self) -> None:
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
            foreach = runs_foreach(group, params)
            update(params, grads, bufs, foreach=bool(foreach), weight_decay=group["weight_decay"],
                   momentum=group["momentum"], dampening=group["dampening"], nesterov=group["nesterov"],
                   maximize=group["maximize"], lr=g.tensor, tail=self.tail)
            if group["momentum"] != 0:  # as SGD.step: the buffers made on the first step become state
                for p, b in zip(params, bufs):
                    opt.state[p]["momentum_buffer"] = b
