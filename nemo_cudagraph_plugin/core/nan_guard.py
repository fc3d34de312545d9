"""Device-side NaN/Inf detection that never syncs the host inside a step.

Inside the captured step the guard only *adds* into device accumulators: the loss into one
scalar, each parameter's gradient max-abs into one slot of a vector. NaN and Inf propagate through
a sum, so a non-finite accumulator after N steps means a non-finite value in one of those steps.
Per step this is one kernel for the loss and, for the gradients, one multi-tensor reduction per
gradient dtype plus a ``stack`` and an ``add_`` — one read of the gradients and no host work; the
accumulators are allocated once, outside every graph. The host reads the accumulators every ``check_every`` steps and at
epoch end (one sync per read) and only then maps a bad slot to its parameter's name, so naming
costs nothing per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from ._torch_compat import foreach_max_abs
from .errors import NonFiniteError

__all__ = ["NanGuard"]


class _Plan:
    """How to reduce one set of present gradients into the accumulator (built once per set)."""

    __slots__ = ("groups", "index", "_host")

    def __init__(self, params: list[Tensor], present: tuple[int, ...], device: torch.device) -> None:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in present:
            by_dtype.setdefault(params[i].grad.dtype, []).append(i)
        self.groups = list(by_dtype.values())
        order = [i for ids in self.groups for i in ids]
        self.index: Optional[Tensor] = None
        self._host: Optional[Tensor] = None
        if order != list(range(len(params))):
            # Copied from pinned host memory without a host sync (safe inside the sync-checked
            # warm-up). Inside a capture the copy is a graph node re-run by every replay, so the
            # index never depends on memory another graph may reuse.
            host = torch.tensor(order, dtype=torch.long)
            if device.type == "cuda":
                host = host.pin_memory()
            self._host = host  # the copy reads it asynchronously: keep it alive
            self.index = host.to(device, non_blocking=True)


class NanGuard:
    """Accumulate on the device; report on demand.

    Args:
        named_params: ``(name, parameter)`` pairs whose gradients are checked, in report order.
        device: where the accumulators live.
        mode: ``"loss"`` (loss only) or ``"full"`` (also every gradient, before clipping).
    """

    def __init__(self, named_params: Sequence[tuple[str, Tensor]], device: torch.device, mode: str = "full") -> None:
        if mode not in ("loss", "full"):
            raise ValueError("NanGuard mode must be 'loss' or 'full'")
        self.mode = mode
        self.names = [n for n, p in named_params if p.requires_grad]
        self.params = [p for _, p in named_params if p.requires_grad]
        self.device = device
        # Allocated here, outside any graph pool, so every graph and eager step writes the same memory.
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.grad_sum = torch.zeros(len(self.params), dtype=torch.float32, device=device)
        self.skipped = torch.zeros((), dtype=torch.float32, device=device)
        self._plans: dict[tuple[int, ...], _Plan] = {}

    def observe_loss(self, loss: Tensor) -> None:
        """Add the loss into the accumulator (one kernel; safe inside capture)."""
        self.loss_sum.add_(loss.detach().reshape(()))

    def observe_grads(self, found_inf: Optional[Tensor] = None) -> None:
        """Add every gradient's max |g| into its slot (``mode="full"``; device ops only).

        If ``found_inf`` is given (``nan_action="skip"``) it is set to 1.0 when any gradient is
        non-finite, so that a fused optimizer skips this update on the device.
        """
        if self.mode != "full" and found_inf is None:
            return
        params = self.params
        present = tuple(i for i, p in enumerate(params) if p.grad is not None)
        if not present:
            return
        plan = self._plans.get(present)
        if plan is None:
            plan = self._plans[present] = _Plan(params, present, self.device)
        parts = [torch.stack(foreach_max_abs([params[i].grad for i in ids])) for ids in plan.groups]
        vals = parts[0] if len(parts) == 1 else torch.cat([p.float() for p in parts])
        if plan.index is None:
            self.grad_sum.add_(vals)
        else:
            self.grad_sum.index_add_(0, plan.index, vals.float())
        if found_inf is not None:
            bad = torch.isfinite(vals.sum()).logical_not_()
            found_inf.copy_(bad.to(found_inf.dtype).reshape(found_inf.shape))
            self.skipped.add_(bad)

    # -- host side ---------------------------------------------------------------------------
    def check(self, raise_on_bad: bool = True, window: str = "") -> Optional[str]:
        """Read the accumulators (one host sync); raise :class:`NonFiniteError` or return a report.

        Returns ``None`` when everything was finite. With ``raise_on_bad=False`` (skip mode) the
        report is returned and the accumulators are cleared.
        """
        ok = torch.isfinite(torch.cat([self.loss_sum.reshape(1), self.grad_sum])).cpu()
        if bool(ok.all()):
            self.reset()
            return None
        loss_bad = not bool(ok[0])
        bad_idx = torch.nonzero(~ok[1:]).flatten().tolist()
        bad_params = [self.names[i] for i in sorted(bad_idx)]
        if bad_params:
            extra = f" (and {len(bad_params) - 1} more)" if len(bad_params) > 1 else ""
            what = f"non-finite gradient in parameter '{bad_params[0]}'{extra}"
            if loss_bad:
                what = "non-finite loss and " + what
        else:
            what = "non-finite loss" + (
                "" if self.mode == "full" else " (nan_guard='loss' does not check gradients; nan_guard=True names the parameter)"
            )
        report = f"NaN guard: {what}{(' ' + window) if window else ''}."
        if raise_on_bad:
            raise NonFiniteError(
                report + " Lower the learning rate, check the data of those steps, or enable gradient clipping; "
                "nan_action='skip' skips such updates instead.",
                parameter=bad_params[0] if bad_params else None,
            )
        self.reset()
        return report

    def skipped_steps(self) -> int:
        return int(self.skipped.item())

    def reset(self) -> None:
        self.loss_sum.zero_()
        self.grad_sum.zero_()
