"""torch's own (non-capturable) Adam/AdamW update inside a graph: the bits of the user's eager step.

torch's non-capturable update (``torch/optim/adam.py``: ``_multi_tensor_adam`` and ``_single_tensor_adam`` with
``capturable=False``) computes its scalars on the host in float64 from a CPU step counter and passes them to its kernels
as Python numbers::

    bias_correction1 = 1 - beta1 ** step            # host libm pow
    bias_correction2 = 1 - beta2 ** step
    step_size = (lr / bias_correction1) * -1        # for-loop: value=-(lr / bias_correction1), the same double
    bias_correction2_sqrt = bias_correction2 ** 0.5 # host libm pow, not sqrt
    param *= 1 - lr * weight_decay                  # AdamW's decoupled decay

A graph would freeze those numbers. Here they come from device memory, equal bit for bit:

* ``1 - beta ** step`` and ``(1 - beta2 ** step) ** 0.5`` are the host's own float64 values, computed by Python as torch
  computes them and copied into a device table (:class:`ScalarTable`) indexed by the device step counter: no device
  ``pow``/``sqrt`` decides a bit. The host fills the table ahead of the steps (a chunk at a time, between steps, from
  the optimizer-step count it already knows: no host sync per step).
* ``lr`` is a float64 device tensor that the host sets before each step from the group's float ``lr`` (schedulers keep
  assigning floats, as without graphs). ``(lr / bc1) * -1`` and ``1 - lr * weight_decay`` are float64 ``/``, ``*`` and
  ``-`` on the device: IEEE operations, correctly rounded on both sides, so the same doubles as the host's.
* Each scalar is rounded to float32 where torch's CUDA kernel converts its Python scalar to its opmath type (float32
  for float32 parameters), and read by a kernel that computes what the eager kernel computes: ``_foreach_mul_`` with a
  float32 0-d tensor (the same float32 multiply), ``_foreach_div_``/``div_`` likewise, and the final ``addcdiv`` (whose
  ScalarList/``value`` argument no torch kernel reads from the device without a sync) by
  :class:`~.adam_tail.EagerAdamTail`, the same IEEE division and FMA as torch's CUDA kernel. On the CPU (the tape
  backend of the tests) the CPU kernels' order is mirrored instead (``p + (s * m) / d``, no FMA).
* The for-loop path's denominator ``(v.sqrt() / bias_correction2_sqrt).add_(eps)`` divides by a Python float. On
  CUDA that division (a CPU scalar divisor, ``div_true_kernel_cuda``) is a multiply by a reciprocal computed once on
  the host: ``float32(1.0 / bc2_sqrt)`` in double on the torch of the GPU host, ``1.0f / float32(bc2_sqrt)`` in older
  ones. Which one this torch computes is measured once per device (``_torch_compat.scalar_division``); the same
  reciprocal is formed on the device from the table's double and the kernel multiplies by it (its ``reciprocal``
  mode), then ends as the multi-tensor path does. On the CPU torch divides, and so does the mirror.
* BFloat16 parameters (and moments): torch's kernels compute each operation in float32 with the same float32 scalars
  and store BFloat16. The kernel rounds the denominator (either path's) to BFloat16 after each of its operations and
  the parameter once; AdamW's decay multiplies by the float32 factor in a kernel of its own (torch's ``mul_`` with a
  float32 0-d CUDA tensor would round the factor to BFloat16 first). On the CPU the update's end is computed in
  float32 and stored once, as torch's CPU ``addcdiv`` does.

Every other operation (step increment, ``lerp_``, ``mul_``, ``addcmul_``, the coupled decay, ``maximize``'s negation,
amsgrad's maximum) is torch's own call with torch's own Python-float arguments, which a graph may freeze: betas, eps and
weight decay are constants (the engine re-captures when one changes; the table follows betas).

Scope (else the plugin's capturable preparation is used and the summary says the graphed math differs):
``torch.optim.Adam``/``AdamW`` with torch's own ``step``, torch 2.11 - 2.13, float ``betas``, a float ``lr`` (or a
one-element float32/float64 tensor: torch's for-loop update then computes with it as a tensor, :class:`TensorLr`),
non-fused groups (the multi-tensor update and the for-loop one; ``amsgrad``, ``maximize``, weight decay), float32 or
BFloat16 parameters (one dtype) on one device, Triton on CUDA, no ``nan_action="skip"`` (that needs the fused kernel's
``found_inf``). Optimizers whose groups are all fused: :mod:`.user_fused_adam`. The step counters live on the device
while the update is installed and go back to the CPU after fit, where torch's non-fused update keeps them
(:meth:`.optim.OptimizerPrep.restore`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor

from ._torch_compat import (
    adam_init_group,
    runs_foreach,
    scalar_division,
)
from .adam_step import not_torchs_adam, plain_float32_params
from .adam_tail import TAIL_DTYPES, EagerAdamTail, tail_applies
from .finite import triton_available
from .user_step import SKIP_NONFINITE, UserStep

__all__ = ["ScalarTable", "UserMathAdam", "device_scalars", "host_bias_corrections", "update", "why_not"]

#: ring slots of the bias-correction table (steps k live in slot k % SLOTS): 1 MiB per (beta1, beta2)
SLOTS = 1 << 16
#: steps the host computes at a time, ahead of the steps taken
CHUNK = 4096


def host_bias_corrections(beta1: float, beta2: float, steps: Sequence[int]) -> tuple[list[float], list[float]]:
    """``1 - beta1 ** step`` and ``(1 - beta2 ** step) ** 0.5`` as torch's non-capturable update computes them (Python
    floats: libm ``pow``, the step a float as ``_get_value`` returns it)."""
    bc1 = [1 - beta1 ** float(k) for k in steps]
    bc2_sqrt = [(1 - beta2 ** float(k)) ** 0.5 for k in steps]
    return bc1, bc2_sqrt


class ScalarTable:
    """The host's bias corrections for one ``(beta1, beta2)`` on the device: ``values[0, k % SLOTS]`` is
    ``1 - beta1 ** k``, ``values[1, k % SLOTS]`` is ``(1 - beta2 ** k) ** 0.5`` for the steps filled so far."""

    def __init__(self, beta1: float, beta2: float, device: torch.device) -> None:
        self.betas = (beta1, beta2)
        self.values = torch.zeros(2, SLOTS, dtype=torch.float64, device=device)
        #: steps ``(filled_to - SLOTS, filled_to]`` are valid
        self.filled_to = 0

    def fill_to(self, last: int) -> None:
        """Make steps up to ``last`` valid (between steps only: the copies are ordered on the current stream)."""
        first = self.filled_to + 1
        if last < first:
            return
        first = max(first, last - SLOTS + 1)
        bc1, bc2s = host_bias_corrections(*self.betas, range(first, last + 1))
        host = torch.tensor([bc1, bc2s], dtype=torch.float64)
        if self.values.is_cuda:
            host = host.pin_memory()  # the caching host allocator keeps it until the copy has run
        at, done = first % SLOTS, 0
        while done < host.shape[1]:
            n = min(SLOTS - at, host.shape[1] - done)
            self.values[:, at:at + n].copy_(host[:, done:done + n], non_blocking=True)
            done, at = done + n, 0
        self.filled_to = last


def reciprocal(divisor: Tensor, kind: Optional[str], dtype: torch.dtype = torch.float32) -> Tensor:
    """The reciprocal torch's CUDA kernel multiplies by when it divides a ``dtype`` tensor by the Python float
    ``divisor`` (given as float64), ``kind`` as :func:`._torch_compat.scalar_division` names it: formed in double and
    rounded once (``"double"``; a float64 tensor's always), or ``1.0f / float32(divisor)`` (``"float32"``)."""
    if kind == "double" or (kind == "float32" and dtype == torch.float64):
        return (1.0 / divisor).to(dtype)
    if kind == "float32":
        return 1.0 / divisor.to(torch.float32)
    raise ValueError(f"no reciprocal {kind!r}")


def divided(x: Tensor, divisor: Tensor, kind: Optional[str]) -> Tensor:
    """``x / d`` for a Python float ``d`` (given as the float64 ``divisor``) as torch's kernel computes it: an IEEE
    division by ``d`` in ``x``'s dtype (``"divide"``), else a multiply by its :func:`reciprocal`."""
    if kind == "divide":
        return x / divisor.to(x.dtype)
    return x * reciprocal(divisor, kind, x.dtype)


class TensorLr:
    """A param group's tensor ``lr`` as torch's for-loop update uses it (torch runs that update for a tensor ``lr``
    when ``foreach`` is unset): ``step_size = lr / bias_correction1`` is a tensor operation in ``lr``'s dtype, on
    ``lr``'s device, whose value ``addcdiv_`` then reads as its Python scalar; AdamW's ``param.mul_(1 - lr *
    weight_decay)`` multiplies by a 0-d tensor.

    ``value`` is a device copy of the user's tensor in its dtype, filled before every step without a host sync
    (:meth:`fill`). Where the user's tensor lives on the CPU while the parameters are on a GPU (``on_host``), torch's
    eager operations on it run on the CPU: the step size divides as the CPU does, and the decay factor is computed on
    the host with the CPU's own operations and read by the kernels as the float32 a CPU scalar becomes
    (:attr:`factor`)."""

    def __init__(self, lr: Tensor, device: torch.device) -> None:
        self.dtype = lr.dtype
        self.on_host = self._on_host(lr, device)
        self.value = torch.zeros((), dtype=lr.dtype, device=device)
        #: how the step size's division by the host's bias correction is computed (on the CPU where ``on_host``)
        self.division = scalar_division(torch.device("cpu") if self.on_host else device)
        #: ``on_host``: ``float32(1 - lr * weight_decay)`` as the CPU computes it, on the device
        self.factor = torch.ones((), dtype=torch.float32, device=device)
        self._host: Optional[tuple[float, float]] = None

    @staticmethod
    def _on_host(lr: Tensor, device: torch.device) -> bool:
        return lr.device.type == "cpu" and device.type != "cpu"

    def matches(self, lr: Tensor, device: torch.device) -> bool:
        """Whether ``lr`` is still a tensor of this kind (dtype, where it lives)."""
        return lr.dtype == self.dtype and self._on_host(lr, device) == self.on_host

    def fill(self, lr: Tensor, weight_decay: float) -> None:
        """Before a step: ``value`` from the user's tensor (a device copy, or a CPU read: no device sync); the
        host's decay factor when it changed."""
        self.value.fill_(lr.detach().reshape(()))
        if self.on_host:
            key = (float(lr), weight_decay)
            if key != self._host:
                self.factor.fill_(float(1 - lr.detach().reshape(()) * weight_decay))
                self._host = key

    def decay_factor(self, weight_decay: float) -> Tensor:
        """AdamW's ``1 - lr * weight_decay`` with torch's own operations on the copy (where the user's tensor lives
        on the parameters' device: the same kernels, in its dtype)."""
        return 1 - self.value * weight_decay

    def step_size(self, bias_correction1: Tensor) -> Tensor:
        """Per tensor: the float32 ``-(lr / bc1)`` that torch's ``addcdiv_(..., value=-step_size)`` receives, from the
        host's doubles ``bias_correction1``."""
        return (-divided(self.value.expand(bias_correction1.shape), bias_correction1, self.division)).to(torch.float32)


def device_scalars(table: Tensor, steps: Tensor, lr: Union[Tensor, TensorLr],
                   kind: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """Per tensor: the float32 step size ``float32((lr / bc1) * -1)`` and ``float32(bc2_sqrt)`` for device step
    counters ``steps`` (float, already incremented), from ``table`` (:attr:`ScalarTable.values`) and a float64 ``lr``
    (a :class:`TensorLr`: its :meth:`~TensorLr.step_size`).
    With ``kind`` the second is the float32 that CUDA's division by the Python float ``bc2_sqrt`` multiplies by
    instead (its :func:`reciprocal`): ``"double"``: ``float32(1.0 / bc2_sqrt)``; ``"float32"``:
    ``1.0f / float32(bc2_sqrt)``.

    The float64 ``/`` and ``*`` are IEEE operations (the host's doubles); the casts round to nearest, as torch's
    ``Scalar.to<float>()`` does when a kernel receives a Python float.
    """
    row = table.index_select(1, steps.to(torch.int64).remainder_(SLOTS))
    step_size = lr.step_size(row[0]) if isinstance(lr, TensorLr) else ((lr / row[0]) * -1).to(torch.float32)
    if kind is not None:
        return step_size, reciprocal(row[1], kind)
    return step_size, row[1].to(torch.float32)


def decay_factor(lr: Tensor, weight_decay: float) -> Tensor:
    """``float32(1 - lr * weight_decay)``: the host's double (two IEEE operations), rounded as the kernel rounds it."""
    return (1 - lr * weight_decay).to(torch.float32)


def _tensor_lr_why_not(i: int, group: dict, device_type: str) -> Optional[str]:
    """Why param group ``i``'s tensor ``lr`` keeps the capturable math (``None``: torch's for-loop update with it is
    captured as the user runs it)."""
    lr = group["lr"]
    if runs_foreach(group, group["params"]):
        return f"param group {i} has a tensor lr with foreach=True"  # torch refuses that itself
    if lr.numel() != 1 or lr.dtype not in (torch.float32, torch.float64) or lr.requires_grad:
        return f"param group {i}'s tensor lr is not one float32 or float64 element without grad"
    if lr.device.type not in ("cpu", device_type):
        return f"param group {i}'s tensor lr lives on {lr.device}"
    return None


def why_not(optimizer: torch.optim.Optimizer, device_type: str = "cuda", skip_nonfinite: bool = False) -> Optional[str]:
    """Why the user's own update cannot be captured for ``optimizer`` (``None``: it can)."""
    name = type(optimizer).__name__
    if (why := not_torchs_adam(optimizer)) is not None:
        return why
    if skip_nonfinite:
        return SKIP_NONFINITE
    if device_type == "cuda" and not triton_available():
        return "Triton is not available (the update's last operation needs its kernel)"
    devices = set()
    for i, g in enumerate(optimizer.param_groups):
        if g.get("fused"):  # every group fused: user_fused_adam
            return f"param group {i} is fused while another is not"
        off = [k for k in ("capturable", "differentiable") if g.get(k)]
        if off:
            return f"param group {i} is {', '.join(off)}"
        if any(isinstance(b, Tensor) for b in g["betas"]):
            return f"param group {i} has tensor betas"
        if isinstance(g["lr"], Tensor) and (why := _tensor_lr_why_not(i, g, device_type)) is not None:
            return why
        if (why := plain_float32_params(i, g, device_type, devices, TAIL_DTYPES)) is not None:
            return why
    if len({d for d, _ in devices}) > 1:
        return f"{name}'s parameters live on {len({d for d, _ in devices})} devices"
    if len(devices) > 1:
        return f"{name}'s parameters mix dtypes ({', '.join(sorted(str(t) for _, t in devices))})"
    for_loop = any(not runs_foreach(g, g["params"]) for g in optimizer.param_groups)
    if devices and for_loop and device_type == "cuda" and triton_available():
        device = torch.device(next(iter(devices))[0])
        if scalar_division(device) is None:
            return (f"{name}'s for-loop update divides by a Python float in a way not known here (this torch's CUDA "
                    f"division is neither a multiply by a reciprocal nor an IEEE division)")
    return None


def update(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
           max_exp_avg_sqs: list[Tensor], steps: list[Tensor], *, foreach: bool, amsgrad: bool, maximize: bool,
           beta1: float, beta2: float, lr: Union[Tensor, TensorLr], weight_decay: float, eps: float,
           decoupled_weight_decay: bool, table: Tensor, tail: Optional[EagerAdamTail] = None) -> None:
    """One non-capturable Adam/AdamW update (torch's ``foreach`` or for-loop path) with the host's scalars read from
    the device: ``lr`` a float64 0-d tensor (the group's float), or a :class:`TensorLr` (a tensor ``lr``: the
    for-loop path), ``table`` a :class:`ScalarTable`'s values. See the module docstring."""
    if not params:
        return
    if maximize:
        grads = torch._foreach_neg(grads) if foreach else [-g for g in grads]
    torch._foreach_add_(steps, 1)  # for-loop: step_t += 1 per tensor, the same float32 add
    source = max_exp_avg_sqs if amsgrad else exp_avg_sqs
    use_tail = tail is not None and tail_applies(params, exp_avgs, source, dtypes=TAIL_DTYPES)
    # the for-loop path's division by a Python float as this torch computes it on the device (why_not refuses a kind
    # it does not know): CUDA multiplies by a reciprocal formed on the host, a "divide" is the multi-tensor division
    kind = None if foreach or not use_tail else scalar_division(params[0].device)
    multiplies = kind in ("double", "float32")
    step_size, bc2_sqrt = device_scalars(table, torch.stack(steps), lr, kind if multiplies else None)
    if weight_decay != 0:
        if decoupled_weight_decay and isinstance(lr, TensorLr) and not lr.on_host:
            factor = lr.decay_factor(weight_decay)
            for p in params:
                p.mul_(factor)  # a 0-d tensor on the parameters' device, as in the eager step
        elif decoupled_weight_decay:
            # the float32 a Python scalar (or a CPU 0-d tensor) becomes in the multiply
            factor = lr.factor if isinstance(lr, TensorLr) else decay_factor(lr, weight_decay)
            if params[0].dtype == torch.bfloat16 and params[0].device.type != "cpu":
                # CUDA's ``_foreach_mul_``/``mul_`` with a float32 0-d tensor would round it to BFloat16 first (the
                # CPU's reads it as a scalar in float32, as a Python float)
                if tail is None or not tail_applies(params, dtypes=TAIL_DTYPES):
                    raise RuntimeError("the eager-math Adam update needs its Triton kernel for these tensors")
                tail.scale(params, factor)
            elif foreach:
                torch._foreach_mul_(params, factor)
            else:
                for p in params:
                    p.mul_(factor)
        elif foreach:
            if maximize:
                torch._foreach_add_(grads, params, alpha=weight_decay)
            else:
                grads = torch._foreach_add(grads, params, alpha=weight_decay)
        else:
            grads = [g.add(p, alpha=weight_decay) for g, p in zip(grads, params)]
    if foreach:
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    else:
        for m, v, g in zip(exp_avgs, exp_avg_sqs, grads):
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    del grads
    if amsgrad:
        if foreach:
            torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        else:
            for mx, v in zip(max_exp_avg_sqs, exp_avg_sqs):
                torch.maximum(mx, v, out=mx)
    if use_tail:
        # the denominator from v as CUDA computes it: the multi-tensor path divides by the ScalarList's float32, the
        # for-loop path's division by a Python float multiplies by the reciprocal torch forms on the host
        tail(params, exp_avgs, source, bc2_sqrt, step_size, eps, reciprocal=multiplies)
        return
    if params[0].device.type == "cuda":
        # why_not refuses CUDA without Triton; a tensor the kernel cannot take (not contiguous): no exact route
        raise RuntimeError("the eager-math Adam update needs its Triton kernel for these tensors")
    if foreach:
        denom = torch._foreach_sqrt(source)
        torch._foreach_div_(denom, list(bc2_sqrt.unbind()))  # the ScalarList's float32 division
        torch._foreach_add_(denom, eps)
    else:  # the for-loop update: torch's CPU division by a Python float divides (by its float32)
        denom = [v.sqrt().div_(bc2_sqrt[j]).add_(eps) for j, v in enumerate(source)]
    # torch's CPU addcdiv: ``self + value * t1 / t2`` = ``p + (s * m) / d``, each operation in float32 (the opmath
    # type of BFloat16 too), the result stored once in the parameter's dtype.
    for p, m, d, s in zip(params, exp_avgs, denom, step_size.unbind()):
        p.copy_(p.float() + (s * m.float()) / d.float())


class _Group:
    """Per param group: the device lr (a float's float64, or a tensor's :class:`TensorLr`), the float's host value,
    the table and the step bounds the host knows."""

    def __init__(self, lr: Any, table: ScalarTable, device: torch.device, lo: int, hi: int) -> None:
        self.lr_value: Any = None
        self.lr = torch.zeros((), dtype=torch.float64, device=device)
        self.tensor_lr: Optional[TensorLr] = TensorLr(lr, device) if isinstance(lr, Tensor) else None
        self.table = table
        self.lo, self.hi = lo, hi  # the smallest and the largest step counter when last read (or state created)


class UserMathAdam(UserStep):
    """Captures the user's own Adam/AdamW update (see the module docstring): installed on the optimizer instance for
    as long as graphs may be captured (:meth:`install` / :meth:`remove`), so eager warm-up steps and replays run the
    same operations; :meth:`sync` before every step (cheap: float compares, a table chunk every :data:`CHUNK` steps).

    Args:
        step_count: the number of optimizer steps taken so far as the host counts them (Lightning's
            ``trainer.global_step``); without it every :meth:`sync` counts as one step (an upper bound: with gradient
            accumulation the counters are read again, one host sync, when the bound runs far ahead).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device,
                 step_count: Optional[Callable[[], int]] = None, fused_tail: Optional[bool] = None) -> None:
        super().__init__(optimizer, device)
        self.step_count = step_count
        use = triton_available() and device.type == "cuda" if fused_tail is None else fused_tail
        self.tail: Optional[EagerAdamTail] = EagerAdamTail() if use else None
        self.groups: list[_Group] = []
        self._count0 = 0
        self._calls = 0

    # -- setup ---------------------------------------------------------------------------------
    def install(self) -> None:
        """Move the step counters to the device, build the tables and take over the instance's ``step``."""
        opt = self.optimizer
        if self.tail is not None:
            self.tail.warm(self.device, sorted({p.dtype for g in opt.param_groups for p in g["params"]}, key=str))
        bounds = self._read_counters()
        tables: dict[tuple[float, float], ScalarTable] = {}
        self.groups = []
        for g, (lo, hi) in zip(opt.param_groups, bounds):
            betas = (float(g["betas"][0]), float(g["betas"][1]))
            table = tables.get(betas) or tables.setdefault(betas, ScalarTable(*betas, self.device))
            self.groups.append(_Group(g["lr"], table, self.device, lo, hi))
        self._count0 = self.step_count() if self.step_count is not None else 0
        self._calls = 0
        self.sync()
        self._take_step()

    def _read_counters(self) -> list[tuple[int, int]]:
        """Per group: (smallest, largest) step counter, moving CPU counters to the device (one host read in all)."""
        opt = self.optimizer
        per_group: list[list[Tensor]] = []
        for g in opt.param_groups:
            steps = []
            for p in g["params"]:
                state = opt.state.get(p)
                if state and isinstance(state.get("step"), Tensor):
                    if state["step"].device != p.device:
                        state["step"] = state["step"].to(device=p.device)
                    steps.append(state["step"])
            per_group.append(steps)
        flat = [s for steps in per_group for s in steps]
        values = torch.stack([s.reshape(()).to(torch.float64) for s in flat]).tolist() if flat else []
        out, i = [], 0
        for steps in per_group:
            vals = [int(v) for v in values[i:i + len(steps)]] or [0]
            i += len(steps)
            out.append((min(vals), max(vals)))
        return out

    # -- per step ------------------------------------------------------------------------------
    def sync(self) -> Optional[str]:
        """Before every step: copy changed float ``lr`` values (a tensor ``lr``: its value) to the device and fill the
        tables ahead. Returns what changed kind (a float ``lr`` became a tensor or back, a tensor of another dtype or
        place): graphs captured before hold other operations."""
        taken = self.step_count() - self._count0 if self.step_count is not None else self._calls
        self._calls += 1
        changed = None
        for i, (group, g) in enumerate(zip(self.optimizer.param_groups, self.groups)):
            b1, b2 = group["betas"]
            if (b1, b2) != g.table.betas:  # a new constant: the engine re-captures (OptimizerPrep's frozen scalars)
                g.table = ScalarTable(float(b1), float(b2), self.device)
            lr = group["lr"]
            if isinstance(lr, Tensor):
                if g.tensor_lr is None or not g.tensor_lr.matches(lr, self.device):
                    g.tensor_lr = TensorLr(lr, self.device)
                    changed = f"param group {i}: lr is now a {lr.dtype} tensor on {lr.device.type}"
                g.tensor_lr.fill(lr, group["weight_decay"])
            else:
                if g.tensor_lr is not None:
                    g.tensor_lr, g.lr_value = None, None
                    changed = f"param group {i}: lr is now a float"
                if lr != g.lr_value:
                    g.lr.fill_(float(lr))
                    g.lr_value = lr
            upper = g.hi + taken + 1  # no counter can be past this after the coming step
            table = g.table
            if upper > table.filled_to:
                if upper + CHUNK - SLOTS >= g.lo:  # the ring would overwrite steps a counter may still be at
                    self._reread()
                    again = self.sync()
                    return changed or again
                table.fill_to(upper + CHUNK)
        return changed

    def _reread(self) -> None:
        for g, (lo, hi) in zip(self.groups, self._read_counters()):
            g.lo, g.hi = lo, hi
        self._count0 = self.step_count() if self.step_count is not None else 0
        self._calls = 0

    def tensors(self) -> list[tuple[str, Tensor]]:
        """The device tensors a captured step reads besides the optimizer state (for address checks)."""
        out: list[tuple[str, Tensor]] = []
        for i, g in enumerate(self.groups):
            out.append((f"param group {i} lr (float64) tensor", g.lr))
            if g.tensor_lr is not None:
                out.append((f"param group {i} tensor lr copy", g.tensor_lr.value))
                out.append((f"param group {i} decay factor", g.tensor_lr.factor))
            out.append((f"param group {i} bias-correction table", g.table.values))
        return out

    # -- the step ------------------------------------------------------------------------------
    def _update(self, opt: torch.optim.Optimizer) -> None:
        for group, g in zip(opt.param_groups, self.groups):
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, _ = adam_init_group(opt, group)
            for j, s in enumerate(steps):
                if s.device != params[j].device:  # state created now, with a CPU counter (0): on the device
                    steps[j] = opt.state[params[j]]["step"] = torch.zeros((), dtype=s.dtype, device=params[j].device)
                    g.lo = 0
            foreach = runs_foreach(group, params)
            beta1, beta2 = group["betas"]
            update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=bool(foreach),
                   amsgrad=group["amsgrad"], maximize=group["maximize"], beta1=beta1, beta2=beta2,
                   lr=g.tensor_lr if g.tensor_lr is not None else g.lr,
                   weight_decay=group["weight_decay"], eps=group["eps"],
                   decoupled_weight_decay=group["decoupled_weight_decay"], table=g.table.values, tail=self.tail)
