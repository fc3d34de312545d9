"""The plumbing shared by the captured user updates (:mod:`.user_adam`, :mod:`.user_sgd`): taking over one optimizer
instance's ``step`` while graphs may be captured, and giving torch's own back for a reference step.

Nothing is patched on a class: the instance's ``step`` attribute is set and removed. An LR scheduler's wrapper of the
instance's ``step`` (it counts calls) comes back with the instance's own attribute.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import Tensor

from . import kernel_args
from ._torch_compat import mark_step_called

__all__ = ["SKIP_NONFINITE", "UserStep"]

#: why ``nan_action="skip"`` keeps the plugin's preparation, for every captured user update
SKIP_NONFINITE = "nan_action='skip' runs the fused kernel (it reads found_inf on the device)"

_ABSENT = object()


class UserStep:
    """Base of a captured user update: subclasses implement :meth:`_update` (the step, torch's operations with the
    host's scalars read from the device), :meth:`sync` (before every step) and :meth:`tensors`."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.device = device
        self.installed = False
        self._own: Any = _ABSENT
        self._step: Callable[..., Any] = torch.optim.Optimizer.profile_hook_step(self._run)
        #: called before an update that runs eagerly (not in a capture), after the closure: the owner copies what code
        #: inside the step assigned (an ``lr`` set in Lightning's ``optimizer_step``) to the device values the update
        #: reads, so this update uses it, as torch's own step would
        self.before_update: Optional[Callable[[], None]] = None

    def _run(self, opt: torch.optim.Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
        """What torch's ``step`` does around its update: the closure with gradients on, the call counted (an LR
        scheduler checks the order), the update without autograd."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        mark_step_called(opt)
        if self.before_update is not None and not kernel_args.capture_open():
            self.before_update()
        with torch.no_grad():
            self._update(opt)
        return loss

    def _update(self, opt: torch.optim.Optimizer) -> None:
        """Every param group's update: torch's operations with the host's scalars read from the device."""
        raise NotImplementedError

    def sync(self) -> Optional[str]:
        """Before every step: copy the host's changed float hyperparameters to the device. Returns what changed such
        that graphs captured before no longer run the user's update (``None``: nothing)."""
        raise NotImplementedError

    def tensors(self) -> list[tuple[str, Tensor]]:
        """The device tensors a captured step reads besides the optimizer state (for address checks)."""
        raise NotImplementedError

    def _take_step(self) -> None:
        if self.installed:
            return
        opt = self.optimizer
        self._own = opt.__dict__.get("step", _ABSENT)
        opt.step = functools.partial(self._step, opt)  # this instance only; an LR scheduler's wrapper comes back
        if getattr(self._own, "_wrapped_by_lr_sched", False):
            opt.step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        self.installed = True

    def remove(self) -> None:
        """Give the instance its ``step`` back."""
        if not self.installed:
            return
        if self._own is _ABSENT:
            self.optimizer.__dict__.pop("step", None)
        else:
            self.optimizer.step = self._own
        self._own = _ABSENT
        self.installed = False

    @contextlib.contextmanager
    def torchs_step(self) -> Iterator[None]:
        """Run torch's own ``step`` inside the block (the reference of ``verify_steps``)."""
        if not self.installed:
            yield
            return
        self.remove()
        try:
            yield
        finally:
            self._take_step()
