"""torch's own fused Adam/AdamW update (``fused=True``) inside a graph: the bits of the user's eager step.

torch's fused update (``torch/optim/adam.py``: ``_fused_adam``) keeps its step counters on the device, increments them
there and computes the bias corrections in its kernel; the only value the host hands it that changes during training
is the learning rate, a float64 kernel argument. So the update here is torch's own call, ``adam()`` with the group's
settings, with one change: inside a capture the learning rate is a sentinel (:mod:`.kernel_args`) that the graph's
kernel nodes receive, and the backend sets those nodes' argument to the group's current float ``lr`` before each replay
after it changed. Eager steps pass the float itself. A group whose ``lr`` is a tensor (the kernel reads it from the
device) passes a device tensor of the same dtype that takes the group's value before each step (``fill_`` from the
user's tensor, wherever it lives and whichever object the group holds now): the kernel reads what it reads eagerly.
A group whose ``lr`` turns from a float into a tensor or back is another kernel: the engine re-captures. Betas, eps and
weight decay are constants of the graph (the engine re-captures when one changes).

Scope (else the plugin's capturable preparation is used and the summary says the graphed math differs):
``torch.optim.Adam``/``AdamW`` with torch's own ``step``, torch 2.11 - 2.13, every param group fused with a float or tensor
``lr`` and float ``betas``, not differentiable, and on CUDA a driver layer that can read and set captured kernels'
arguments (``cuda-bindings``, CUDA 12.4+). With ``nan_action="skip"`` the optimizer's ``found_inf`` is set, which torch's
fused kernel reads on the device: a step whose gradients went non-finite is skipped, any other is the user's.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _cuda_nodes
from ._torch_compat import adam_functional, adam_init_group
from .adam_step import not_torchs_adam, plain_float32_params
from .kernel_args import HostScalars
from .user_step import UserStep

__all__ = ["UserMathFusedAdam", "all_fused", "why_not"]

#: the parameter dtypes torch's fused Adam kernel takes (it groups the tensors by dtype itself)
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def all_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Every param group of ``optimizer`` runs torch's fused update."""
    return bool(optimizer.param_groups) and all(g.get("fused") for g in optimizer.param_groups)


def why_not(optimizer: torch.optim.Optimizer, device_type: str = "cuda", skip_nonfinite: bool = False) -> Optional[str]:
    """Why the user's own fused update cannot be captured for ``optimizer`` (``None``: it can)."""
    if (why := not_torchs_adam(optimizer)) is not None:
        return why
    # nan_action="skip": the fused kernel reads found_inf itself (OptimizerPrep sets it); with no non-finite gradient
    # the update is the same
    if device_type == "cuda" and (why := _cuda_nodes.scalar_args_unavailable()) is not None:
        return f"its learning rate cannot be set in the graph before each replay ({why})"
    for i, g in enumerate(optimizer.param_groups):
        if not g.get("fused"):
            return f"param group {i} is not fused while another is"
        if g.get("differentiable"):
            return f"param group {i} is differentiable"
        if any(isinstance(b, Tensor) for b in g["betas"]):
            return f"param group {i} has tensor betas"
        if (why := plain_float32_params(i, g, device_type, set(), FUSED_DTYPES)) is not None:
            return why
    return None


class UserMathFusedAdam(UserStep):
    """Captures the user's own fused Adam/AdamW update (see the module docstring): installed on the optimizer instance
    for as long as graphs may be captured; :meth:`sync` before every step (a float compare per group).

    ``previous``: the update this one replaces on the same optimizer (prepared again after a loaded state); its host
    scalars are kept, so graphs captured before keep receiving the current learning rates."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device,
                 previous: Optional[UserStep] = None) -> None:
        super().__init__(optimizer, device)
        n = len(optimizer.param_groups)
        if isinstance(previous, UserMathFusedAdam) and len(previous.lrs.values) == n:
            # prepared again (a loaded state): the graphs captured before keep their sentinels, this object's values
            # and its lr tensors
            self.lrs = previous.lrs
            self.lr_tensors = previous.lr_tensors
        else:
            self.lrs = HostScalars(0.0 if isinstance(g["lr"], Tensor) else float(g["lr"])
                                   for g in optimizer.param_groups)
            #: per group: the device tensor the kernel reads where the group's ``lr`` is a tensor, else ``None``
            self.lr_tensors: list[Optional[Tensor]] = [self._lr_tensor(g) for g in optimizer.param_groups]

    def _lr_tensor(self, group: dict) -> Optional[Tensor]:
        lr = group["lr"]
        if not isinstance(lr, Tensor):
            return None
        device = group["params"][0].device if group["params"] else self.device
        return torch.empty((), dtype=lr.dtype, device=device)

    def install(self) -> None:
        """Step counters on the device (where torch's fused update keeps them; a checkpoint of a non-fused run holds
        CPU ones) and the instance's ``step`` taken over."""
        for p, state in self.optimizer.state.items():
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, Tensor) and step.device != p.device:
                state["step"] = step.to(device=p.device, dtype=torch.float32)
        self.sync()
        self._take_step()

    def sync(self) -> Optional[str]:
        """Before every step: the groups' float ``lr`` as the graphs' kernels will receive it, a tensor ``lr`` copied
        into the tensor they read (on the device, no host sync). Returns what changed kind (a float ``lr`` became a
        tensor or back): graphs captured before hold the other kernel."""
        lrs, changed = self.lrs, None
        for i, g in enumerate(self.optimizer.param_groups):
            lr, own = g["lr"], self.lr_tensors[i]
            if isinstance(lr, Tensor) != (own is not None) or (own is not None and own.dtype != lr.dtype):
                self.lr_tensors[i] = own = self._lr_tensor(g)
                changed = f"param group {i}: lr is now a {'tensor' if own is not None else 'float'}"
            if own is not None:
                own.fill_(lr.reshape(()))
            else:
                lrs.set(i, lr)
        return changed

    def tensors(self) -> list[tuple[str, Tensor]]:
        return [(f"param group {i} lr tensor", t) for i, t in enumerate(self.lr_tensors) if t is not None]

    def _update(self, opt: torch.optim.Optimizer) -> None:
        for i, group in enumerate(opt.param_groups):
            lists = adam_init_group(opt, group)
            if lists.params:
                own = self.lr_tensors[i]
                adam_functional(opt, group, *lists, lr=self.lrs.argument(i) if own is None else own)
