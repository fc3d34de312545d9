"""torch's capturable Adam/AdamW update with one bias-correction scalar per param group (``fast_adam=True``).

torch's capturable multi-tensor update (``torch/optim/adam.py``, ``_multi_tensor_adam``) computes the bias
corrections once per parameter, as 0-d tensors from each parameter's step counter, and then divides the
second-moment denominators by them twice with ``_foreach_div_(tensors, list_of_0d_tensors)``. The two lists'
shapes differ, so torch falls back to one division kernel per parameter: 2 x N kernels per step, about 1.2 ms of
an 8 ms compiled HF Llama 156 M step on an H200 (75 parameters).

Every parameter of a group that steps has taken the same number of steps (unless parameters joined the group
late), so their corrections are the same numbers. :func:`update` computes them once per group, with torch's own
kernels on a one-element list, and divides with ``_foreach_div_(tensors, tensor)``: one multi-tensor kernel, the
same IEEE division. Every other operation is torch's, in torch's order, on the same tensors, so parameters and
optimizer states come out as the same bits. Where Triton runs, the last five operations (the denominator and the
parameter update) are one kernel that rounds each operation as torch's kernels do (:mod:`.adam_tail`): eight passes
over the parameters fewer, and no parameter-sized temporary.

Scope (anything else keeps torch's step): ``torch.optim.Adam``/``AdamW`` whose class does not override ``step``,
torch 2.11 - 2.13 (:data:`~._torch_compat.ADAM_STEP_SHAPE`), every group ``capturable`` multi-tensor (not fused),
without ``amsgrad``, ``maximize`` or ``differentiable``, float32 parameters on one CUDA device. A group whose
counters differ, or one where this step creates the state of some parameters but not of others, is updated by
torch's own function in that step.

The step is installed on the optimizer instance only while a graph is captured (:class:`GroupScalarAdam`); eager
steps run torch's. Nothing is patched on a class.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Optional, Union

import torch
from torch import Tensor

from ._torch_compat import (
    ADAM_STEP_SHAPE,
    TORCH_VERSION,
    adam_functional,
    adam_init_group,
    adam_step_is_torchs,
)
from .adam_tail import FusedAdamTail, tail_applies
from .finite import triton_available
from .warn import warn_once

__all__ = ["GroupScalarAdam", "update", "why_not"]

Hyper = Union[float, Tensor]
_ABSENT = object()


def not_torchs_adam(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why ``optimizer`` is not a torch Adam/AdamW whose step this package mirrors (``None``: it is)."""
    lo, hi = ADAM_STEP_SHAPE
    if not isinstance(optimizer, torch.optim.Adam) or not adam_step_is_torchs(optimizer):
        return f"{type(optimizer).__name__} is not torch.optim.Adam/AdamW with torch's own step()"
    if not lo <= TORCH_VERSION <= hi:
        return f"torch {TORCH_VERSION} is outside {lo.base_version} - {hi.major}.{hi.minor}, whose Adam step it mirrors"
    return None


def why_not(optimizer: torch.optim.Optimizer, device_type: str = "cuda") -> Optional[str]:
    """Why the group-scalar update cannot stand in for ``optimizer``'s step, or ``None`` when it can.

    ``device_type``: where graphs are captured (the engine's backend; ``"cpu"`` for the CPU stand-in).
    """
    name = type(optimizer).__name__
    if (why := not_torchs_adam(optimizer)) is not None:
        return why
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return f"{name} has grad_scale/found_inf set (those run the fused kernel)"
    devices = set()
    for i, g in enumerate(optimizer.param_groups):
        off = [k for k in ("fused", "amsgrad", "maximize", "differentiable") if g.get(k)]
        # torch runs the multi-tensor update for foreach=True, and for foreach=None only when fused is None too.
        multi = g.get("foreach") is True or (g.get("foreach") is None and g.get("fused") is None)
        if off or not g.get("capturable") or not multi:
            return f"param group {i} is not capturable multi-tensor Adam ({', '.join(off) or 'capturable/foreach off'})"
        # foreach=None means multi-tensor for plain CUDA tensors, as torch decides it (subclasses differ).
        if (why := plain_float32_params(i, g, device_type, devices)) is not None:
            return why
    if len(devices) > 1:
        return f"{name}'s parameters live on {len(devices)} devices"
    return None


def plain_float32_params(i: int, group: dict, device_type: str, devices: set,
                         dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> Optional[str]:
    """Why param group ``i`` holds a parameter other than a plain tensor of ``dtypes`` (float32) on ``device_type``
    (``None``: it holds none); the devices and dtypes seen are added to ``devices`` (``(device, dtype)`` pairs where
    more than one dtype is allowed)."""
    allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    for p in group["params"]:
        if p.dtype not in dtypes or p.device.type != device_type or type(p) not in (Tensor, torch.nn.Parameter):
            return f"param group {i} holds a parameter that is not a {allowed} {device_type} tensor ({p.dtype}, {p.device})"
        devices.add(p.device if len(dtypes) == 1 else (p.device, p.dtype))
    return None


def update(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
           steps: list[Tensor], *, beta1: Hyper, beta2: Hyper, lr: Hyper, weight_decay: float, eps: float,
           decoupled_weight_decay: bool, tail: Optional[FusedAdamTail] = None) -> None:
    """One capturable Adam/AdamW update of tensors on one device and of one dtype whose ``steps`` are all equal.

    The operations of torch's ``_multi_tensor_adam`` (``capturable=True``, no amsgrad/maximize), except that the
    bias corrections are computed from ``steps[0]`` alone and divided by as one tensor. With ``tail`` (and tensors
    it takes) the last five operations run as its one kernel (:mod:`.adam_tail`).
    """
    if not params:
        return
    # As torch: 1-element hyperparameter tensors become 0-d; a device beta1 is used on the parameters' device.
    lr, beta1, beta2 = (x.squeeze() if isinstance(x, Tensor) and x.dim() else x for x in (lr, beta1, beta2))
    device = params[0].device
    device_beta1 = beta1.to(device=device, non_blocking=True) if (
        isinstance(beta1, Tensor) and beta1.device.type != "cpu" and beta1.device != device) else beta1

    torch._foreach_add_(steps, 1)
    if weight_decay != 0:
        if decoupled_weight_decay:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - device_beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    if isinstance(beta2, Tensor):
        scaled, value = torch._foreach_mul(grads, 1 - beta2), 1.0
    else:
        scaled, value = grads, 1 - beta2
    torch._foreach_addcmul_(exp_avg_sqs, scaled, grads, value)
    del grads, scaled

    # The group's corrections, from one counter, with the kernels torch runs on every counter.
    one = steps[:1]
    bias_correction1 = torch._foreach_pow(beta1, one)
    bias_correction2 = torch._foreach_pow(beta2, one)
    torch._foreach_sub_(bias_correction1, 1)
    torch._foreach_sub_(bias_correction2, 1)
    torch._foreach_neg_(bias_correction2)
    torch._foreach_div_(bias_correction1, lr)
    torch._foreach_reciprocal_(bias_correction1)
    torch._foreach_sqrt_(bias_correction2)
    step_size, bias_correction2_sqrt = bias_correction1[0], bias_correction2[0]

    if tail is not None and tail_applies(params, exp_avgs, exp_avg_sqs):
        tail(params, exp_avgs, exp_avg_sqs, bias_correction2_sqrt, step_size, eps)
        return
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)  # one kernel for all tensors (torch: one per parameter)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(denom, step_size)  # likewise
    torch._foreach_addcdiv_(params, exp_avgs, denom)


def _equal_counters(optimizer: torch.optim.Optimizer) -> list[bool]:
    """Per param group: whether every parameter with state has the same step count (one host read in all)."""
    per_group = [[optimizer.state[p]["step"] for p in g["params"] if optimizer.state.get(p)]
                 for g in optimizer.param_groups]
    flat = [s for steps in per_group for s in steps]
    if not flat:
        return [True] * len(per_group)
    if flat[0].is_cuda:
        torch.cuda.synchronize(flat[0].device)  # the warm-up may have stepped on another stream
    values = torch.stack([s.reshape(()).to(torch.float32) for s in flat]).tolist()
    out, i = [], 0
    for steps in per_group:
        vals = values[i:i + len(steps)]
        i += len(steps)
        out.append(len(set(vals)) <= 1)
    return out


class GroupScalarAdam:
    """Stands in for one Adam/AdamW's ``step`` while graphs are captured (see the module docstring).

    :meth:`during_capture` is a context manager for the capture engine: it reads the step counters (before the
    capture starts), sets the instance's ``step`` and removes it afterwards. ``counted_groups`` counts the group
    updates done by the group-scalar update, ``torch_groups`` those left to torch (for tests and diagnostics).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device_type: str = "cuda",
                 fused_tail: Optional[bool] = None) -> None:
        self.optimizer = optimizer
        self.device_type = device_type
        self.reason = why_not(optimizer, device_type)
        # The update's last five operations as one Triton kernel (adam_tail.py): by default where Triton runs.
        use = triton_available() and device_type == "cuda" if fused_tail is None else fused_tail
        self.tail: Optional[FusedAdamTail] = FusedAdamTail() if use else None
        self.counted_groups = 0
        self.torch_groups = 0
        self._equal: list[bool] = []
        # torch's hook runner (step pre/post hooks, the profiler range) around this step, as around its own.
        self._step: Callable[..., Any] = torch.optim.Optimizer.profile_hook_step(self._run)

    @contextlib.contextmanager
    def during_capture(self) -> Iterator[None]:
        opt = self.optimizer
        self.reason = why_not(opt, self.device_type)  # groups and settings may have changed since the last capture
        if self.reason is not None:
            yield
            return
        self._equal = _equal_counters(opt)
        if self.tail is not None:
            try:
                self.tail.warm(next(p.device for g in opt.param_groups for p in g["params"]))
            except Exception as exc:  # noqa: BLE001 - a Triton that cannot build or launch it: torch's operations
                self.tail = None
                warn_once("fast_adam-tail", f"fast_adam: the fused Adam tail kernel did not run ({type(exc).__name__}: "
                          f"{exc}); the captured update ends with torch's operations instead (the same bits).")
        # This instance only (Lightning calls opt.step(closure=...)). An LR scheduler keeps a wrapper of its own in
        # the instance's step: it is put back after the capture.
        own = opt.__dict__.get("step", _ABSENT)
        opt.step = functools.partial(self._step, opt)
        try:
            yield
        finally:
            if own is _ABSENT:
                opt.__dict__.pop("step", None)
            else:
                opt.step = own

    def _run(self, opt: torch.optim.Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for i, group in enumerate(opt.param_groups):
                equal = i < len(self._equal) and self._equal[i]  # a group added since: torch's update
                stepping = [p for p in group["params"] if p.grad is not None]
                # A step that creates some parameters' state but not others' leaves their counters unequal.
                new = sum(1 for p in stepping if not opt.state.get(p))
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, has_complex = adam_init_group(opt, group)
                if equal and new in (0, len(stepping)) and not has_complex:
                    beta1, beta2 = group["betas"]
                    update(params, grads, exp_avgs, exp_avg_sqs, steps, beta1=beta1, beta2=beta2, lr=group["lr"],
                           weight_decay=group["weight_decay"], eps=group["eps"],
                           decoupled_weight_decay=group["decoupled_weight_decay"], tail=self.tail)
                    self.counted_groups += 1
                else:
                    adam_functional(opt, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                                    has_complex)
                    self.torch_groups += 1
        return loss
