"""AdamW with FP32 master weights for TransformerEngine FP8 primary weights, capturable whole.

FP8 primary weights (``te.quantized_model_init``) need FP32 masters: an update applied to the FP8 value itself is
rounded back to FP8 and every change smaller than the FP8 spacing is lost (the fit refuses torch's own optimizers on
them). TE's ``FusedAdam(master_weights=True)`` keeps masters but cannot step FP8 weights inside a CUDA graph (TE
refuses ``capturable=True`` with them). :class:`MasterWeightAdamW` can:

- its param groups hold the model's parameters, so zero-grad, Lightning's clipping, the NaN guard and the FP8
  refresh see the model's gradients and names;
- each step copies the gradients into FP32 master gradients, runs torch's AdamW (``foreach``; ``capturable`` on a
  GPU) on the FP32 masters, and writes each weight back from its master: an FP8 ``Float8Tensor`` with per-tensor
  current scaling (``fp8 max / amax(master)``, the bytes and ``scale_inv`` in place, ``_reset_caches()`` first), any
  other weight by a copy. A float32 parameter is its own master;
- with ``capturable``, each group's ``lr`` is a float32 device tensor: schedulers write it in place, and a graph
  replay reads the current value. The graphed step is the same update as the eager one.

What it does not cover: FP8 formats other than per-tensor ``Float8Tensor`` (block scaling, MXFP8, NVFP4) are refused
when the optimizer is built; its state lives on each parameter's device (no sharding, no distributed optimizer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch
from torch import Tensor

from . import _te_compat as te

__all__ = ["MasterWeightAdamW"]

_SYNCED = ("betas", "eps", "weight_decay", "amsgrad", "maximize", "capturable")


def _device_lr(lr: Any, device: torch.device) -> Tensor:
    """``lr`` as the float32 tensor on ``device`` that a capturable update reads (itself when it is one)."""
    if isinstance(lr, Tensor) and lr.device == device and lr.dtype == torch.float32 and lr.dim() == 0:
        return lr  # (a tensor's device always has its index, as a parameter's does)
    return torch.tensor(float(lr), dtype=torch.float32, device=device)


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW on FP32 master weights that writes FP8 (and other low-precision) weights from them after each update.

    Args:
        params: the model's parameters or param groups, as for ``torch.optim.AdamW``: TE ``Float8Tensor`` weights
            (per-tensor FP8, from ``te.quantized_model_init``), and any plain weights.
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW`` (decoupled weight decay).
        capturable: run the capturable update (step counts and ``lr`` on the device; what a CUDA graph needs).
            ``None``: on when the parameters are on a CUDA device.

    Raises:
        ValueError: a parameter is a quantized format this optimizer does not write (block-scaled FP8, MXFP8, NVFP4,
            an FP8 tensor without row-wise data), named by its place in the param groups.

    ``state_dict()`` holds the FP32 masters and the moments (``lr`` as floats); ``load_state_dict`` puts them back
    without rounding them to the parameters' dtype.
    """

    def __init__(
        self,
        params: Union[Iterable[Tensor], Iterable[dict[str, Any]]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        capturable: Optional[bool] = None,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
                    "maximize": maximize, "capturable": capturable}
        super().__init__(params, defaults)  # each group through add_param_group below

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (also after construction, e.g. layers unfrozen in fine-tuning): its masters are made now."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        if group["capturable"] is None:
            group["capturable"] = any(p.device.type == "cuda" for p in group["params"])
        lr = group["lr"]
        if group["capturable"] and group["params"]:
            group["lr"] = _device_lr(lr, group["params"][0].device)
        masters, written = [], []
        for pi, p in enumerate(group["params"]):
            m = self._master_of(p, f"param group {gi}, #{pi}")
            masters.append(m)
            if m is not p:
                fmt = te.fp8_element_format(p) if te.quantized_tensor_class(p) is not None else None
                written.append((p, m, m.grad, fmt))
        inner = {"params": masters, "lr": float(lr), "foreach": True, **{k: group[k] for k in _SYNCED}}
        if not hasattr(self, "_inner"):
            #: torch's AdamW over the FP32 masters (one group per group here, in the same order)
            self._inner = torch.optim.AdamW([inner])
            #: per group: (parameter, its master, the master's gradient buffer, FP8 format or None) for every
            #: parameter that is not its own master
            self._written: list[list[tuple[Tensor, Tensor, Tensor, Optional[tuple[torch.dtype, float]]]]] = []
        else:
            self._inner.add_param_group(inner)
        self._written.append(written)

    @staticmethod
    def _master_of(p: Tensor, where: str) -> Tensor:
        kind = te.quantized_tensor_class(p)
        if kind is not None and (not te.is_fp8_tensor(p) or kind != "Float8Tensor"):
            raise ValueError(
                f"MasterWeightAdamW: {where} is a TransformerEngine {kind}; it writes per-tensor FP8 weights "
                "(Float8Tensor, te.quantized_model_init with DelayedScaling() or Float8CurrentScaling()) and plain "
                "ones. Build the model with one of those recipes, or train this format with TransformerEngine's "
                "FusedAdam(master_weights=True) without CUDA graphs."
            )
        if kind is not None:
            if te.rowwise_data(p) is None or te.fp8_element_format(p) is None:
                raise ValueError(
                    f"MasterWeightAdamW: {where} is a Float8Tensor without row-wise E4M3/E5M2 data (column-wise-only "
                    "storage), which it cannot write; quantize the weights with row-wise usage."
                )
            value = te.high_precision_value(p)
        elif p.dtype == torch.float32:
            return p  # its own master: AdamW updates it in place
        else:
            value = p
        m = value.detach().to(device=p.device, dtype=torch.float32).clone()
        m.grad = torch.zeros_like(m)  # one buffer for the whole fit: a graph reads it at a fixed address
        return m

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """One AdamW update of the masters, then the write-back of each weight that had a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dst: list[Tensor] = []
        src: list[Tensor] = []
        for group, inner, written in zip(self.param_groups, self._inner.param_groups, self._written):
            for k in _SYNCED:
                inner[k] = group[k]
            lr = group["lr"]
            if inner["capturable"] and group["params"]:
                # a float assigned by the user: into a device tensor, where the capturable update reads it
                group["lr"] = lr = _device_lr(lr, group["params"][0].device)
            inner["lr"] = lr if inner["capturable"] else float(lr)
            for p, m, buf, _ in written:
                m.grad = None if p.grad is None else buf  # no gradient, no update (as AdamW skips the parameter)
                if p.grad is not None:
                    dst.append(buf)
                    src.append(p.grad)
        if dst:
            torch._foreach_copy_(dst, src)
        self._inner.step()
        dst, src = [], []
        for written in self._written:
            for p, m, _, fmt in written:
                if p.grad is None:
                    continue
                if fmt is not None:
                    self._write_fp8(p, m, fmt)
                else:
                    dst.append(p)
                    src.append(m)
        if dst:
            torch._foreach_copy_(dst, src)
        return loss

    def _write_fp8(self, p: Tensor, m: Tensor, fmt: tuple[torch.dtype, float]) -> None:
        te.write_per_tensor_fp8(p, m, fmt)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: ``param_groups`` (``lr`` as a float) and ``state`` per parameter index, each with its
        moments, step count and, where the parameter is not its own, its FP32 ``master``."""
        sd = super().state_dict()
        for g in sd["param_groups"]:
            if isinstance(g["lr"], Tensor):
                g["lr"] = float(g["lr"])
        state: dict[int, dict[str, Any]] = {}
        index = 0
        for group, inner in zip(self.param_groups, self._inner.param_groups):
            for p, m in zip(group["params"], inner["params"]):
                entry = dict(self._inner.state.get(m, {}))
                if m is not p:
                    entry["master"] = m
                if entry:
                    state[index] = entry
                index += 1
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Groups' hyperparameters as torch loads them; masters and moments copied in as saved (FP32 stays FP32)."""
        state = state_dict.get("state", {})
        lrs = [g["lr"] for g in self.param_groups]
        super().load_state_dict({**state_dict, "state": {}})
        index = 0
        for group, inner, old in zip(self.param_groups, self._inner.param_groups, lrs):
            if isinstance(old, Tensor):  # keep the device tensor a scheduler and a graph hold
                old.fill_(float(group["lr"]))
                group["lr"] = old
            for m in inner["params"]:
                saved = state.get(index, state.get(str(index)))
                index += 1
                if saved is None:
                    self._inner.state.pop(m, None)
                    continue
                if "master" in saved:
                    m.copy_(saved["master"])
                # torch keeps a non-capturable update's step count on the host
                on = {k: m.device if inner["capturable"] or k != "step" else torch.device("cpu") for k in saved}
                self._inner.state[m] = {
                    k: (v.to(device=on[k], dtype=torch.float32) if isinstance(v, Tensor) else v)
                    for k, v in saved.items() if k != "master"
                }
