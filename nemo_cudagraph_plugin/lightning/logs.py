"""``self.log`` inside a captured step: recorded at capture, re-emitted after every replay.

While a step runs through the runner, ``LightningModule.log`` of the module instance is redirected
to :meth:`StepLogs.record`. A tensor value becomes an output of the step (a detached copy, so the
graph writes this step's value there on every replay; a bf16/fp16 one is copied in the dtype
Lightning converts it to anyway, ``_compat.logged_copy``); a Python value is kept as it was. After
the step (eager or replayed) :meth:`StepLogs.emit` makes the real ``self.log`` calls with those
values, so the progress bar, loggers, ``callback_metrics`` and ``on_epoch`` reduction see each
step's numbers. Records of an eager step are used once; those of a capture are kept for every
replay of its graph.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import Tensor

from . import _compat

__all__ = ["StepLogs"]


class _LogRecord:
    __slots__ = ("fx", "name", "args", "kwargs", "tensor", "key", "batch_size")

    def __init__(self, fx: Any, name: str, args: tuple, kwargs: dict, tensor: bool) -> None:
        self.fx, self.name, self.args, self.kwargs, self.tensor = fx, name, args, kwargs, tensor
        # what the fast re-emission needs, made once (a kept record is emitted after every replay)
        self.key, self.batch_size = f"{fx}.{name}", kwargs.get("batch_size")


class StepLogs:
    """Records and re-emits one module's ``self.log`` calls made inside the step."""

    def __init__(self, pl_module: Any) -> None:
        self.pl_module = pl_module
        self._records: dict[int, list[_LogRecord]] = {}
        self._kept: set[int] = set()
        self._next = 0
        self.last_token = 0
        self._frozen_warned: set[str] = set()

    def run(self, call: Callable[[], Any], quiet: bool) -> tuple[Any, list[Tensor], int]:
        """Run ``call`` with ``self.log`` recorded; return (outputs, logged tensors, token)."""
        pl_module = self.pl_module
        records: list[_LogRecord] = []
        values: list[Tensor] = []

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            is_t = isinstance(value, Tensor)
            rec = _LogRecord(_compat.current_fx(pl_module), name, args, kwargs, is_t)
            if is_t:
                # A copy (later in-place changes to the source within the step cannot alter it) that becomes an output
                # of its own, made in the dtype Lightning keeps: a replay then hands it over without a conversion.
                values.append(_compat.logged_copy(value))
            else:
                rec.args = (value, *args)
            records.append(rec)

        with _compat.redirect_log(pl_module, log):
            out = call()
        if quiet:
            return out, values, -1
        self._next += 1
        self._records[self._next] = records
        self.last_token = self._next
        return out, values, self._next

    def keep_last(self) -> None:
        """The last recorded step was captured: keep its records for every replay."""
        self._kept.add(self.last_token)
        for rec in self._records.get(self.last_token, ()):
            if not rec.tensor and rec.name not in self._frozen_warned:
                self._frozen_warned.add(rec.name)
                warnings.warn(
                    f"self.log('{rec.name}', ...) logged a Python value inside the captured step; replays re-emit the "
                    "value seen at capture. Log a tensor to see per-step values.",
                    stacklevel=3,
                )

    def emit(self, token: int, values: list[Tensor]) -> None:
        """Make the real ``self.log`` calls of step ``token`` with this step's ``values``."""
        records = self._records.get(token)
        if token not in self._kept:
            self._records.pop(token, None)
        if not records:
            return
        pl_module = self.pl_module
        trainer = pl_module.trainer
        prev = _compat.current_fx(pl_module)
        slow = False  # only LightningModule.log needs the hook name set (and put back)
        it = iter(values)
        try:
            for rec in records:
                if rec.tensor:
                    value = next(it)
                    # A metric this step already registered is updated directly (same arguments as the
                    # first, fully checked call); anything else goes through LightningModule.log.
                    if not rec.args and _compat.fast_log(trainer, rec.fx, rec.key, value, rec.batch_size):
                        continue
                    slow = True
                    _compat.set_current_fx(pl_module, rec.fx)
                    pl_module.log(rec.name, value, *rec.args, **rec.kwargs)
                else:
                    slow = True
                    _compat.set_current_fx(pl_module, rec.fx)
                    pl_module.log(rec.name, *rec.args, **rec.kwargs)
        finally:
            if slow:
                _compat.set_current_fx(pl_module, prev)
