"""Every use of Lightning internals lives here, behind a version check.

The captured region is exactly Lightning's ``_AutomaticOptimization.run`` for one batch: closure
(training_step, zero_grad, backward), clipping and ``optimizer.step``. Lightning has no public
hook spanning that region, so the adapter wraps ``run`` on *this trainer's loop instance* (not the
class), and mirrors the progress counters a replay skips. Checked against Lightning 2.4 - 2.6.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from packaging.version import Version

__all__ = [
    "LIGHTNING_VERSION",
    "check_lightning_version",
    "automatic_loop",
    "step_phase",
    "ProgressDelta",
    "progress_snapshot",
]

LIGHTNING_VERSION = Version(pl.__version__.split("+")[0])
_MIN = Version("2.4.0")
_MAX_TESTED = Version("2.7.0")


def check_lightning_version() -> None:
    if LIGHTNING_VERSION < _MIN:
        raise RuntimeError(
            f"nemo_cudagraph_plugin needs lightning >= {_MIN}, found {LIGHTNING_VERSION}. pip install -U lightning"
        )


def automatic_loop(trainer: pl.Trainer) -> Any:
    """The trainer's ``_AutomaticOptimization`` loop instance (its ``run`` is the captured region)."""
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    for attr in ("run", "optim_progress", "_skip_backward"):
        if not hasattr(loop, attr):
            raise RuntimeError(
                f"lightning {LIGHTNING_VERSION}: _AutomaticOptimization has no '{attr}'; this version is not supported "
                f"by nemo_cudagraph_plugin (tested {_MIN} - {_MAX_TESTED})."
            )
    return loop


def step_phase(trainer: pl.Trainer, loop: Any, batch_idx: int) -> tuple[bool, bool]:
    """``(zero_grad, optimizer_step)`` for this batch, decided exactly as ``run`` decides it."""
    zero = (not loop._skip_backward) and batch_idx % trainer.accumulate_grad_batches == 0
    step = trainer.strategy.handles_gradient_accumulation or not trainer.fit_loop._should_accumulate()
    return zero, step


def _int_fields(obj: Any, out: list[tuple[Any, str]]) -> None:
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            _int_fields(v, out)
        elif isinstance(v, int) and not isinstance(v, bool):
            out.append((obj, f.name))


def progress_snapshot(loop: Any) -> list[tuple[Any, str, int]]:
    """Every integer counter of the loop's optimization progress, with its current value."""
    fields: list[tuple[Any, str]] = []
    _int_fields(loop.optim_progress, fields)
    return [(o, n, getattr(o, n)) for o, n in fields]


class ProgressDelta:
    """The counter increments one run of a step made; re-applied after each replay of its graph.

    A replay runs no Python, so Lightning's ``optim_progress`` (which drives ``global_step``)
    would stand still. Computed once per graph at capture; applying it is a few ``setattr``.
    """

    def __init__(self, before: list[tuple[Any, str, int]], after: list[tuple[Any, str, int]]) -> None:
        self.incs = [(o, n, a - b) for (o, n, b), (_, _, a) in zip(before, after) if a != b]

    def apply(self) -> None:
        for o, n, d in self.incs:
            setattr(o, n, getattr(o, n) + d)


def restorer(loop: Any, pl_module: pl.LightningModule) -> Callable[[], None]:
    """Snapshot host-side counters; the returned function puts them back."""
    snap = progress_snapshot(loop)
    fx = pl_module._current_fx_name

    def restore() -> None:
        for o, n, v in snap:
            setattr(o, n, v)
        pl_module._current_fx_name = fx

    return restore


def current_fx(pl_module: pl.LightningModule) -> Any:
    return pl_module._current_fx_name


def set_current_fx(pl_module: pl.LightningModule, name: Any) -> None:
    pl_module._current_fx_name = name
