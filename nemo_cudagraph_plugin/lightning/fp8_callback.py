"""Lightning callback: refresh FP8 weight transposes after every optimizer step.

Example::

    from nemo_cudagraph_plugin.lightning.fp8_callback import Fp8TransposeRefresh

    trainer = L.Trainer(callbacks=[Fp8TransposeRefresh()], ...)

Useful without CUDA graphs too (an optimizer that writes FP8 bytes without ``_reset_caches()``
leaves eager TE reading stale transposes as well). ``CudaGraphCallback(fp8_refresh="auto")``
installs the same refresh itself; using both only refreshes twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Union

import lightning.pytorch as pl

from ..fp8 import (
    Fp8RefreshHandle,
    fp8_refresh_wanted,
    install_fp8_refresh,
    iter_fp8_params,
    verify_fp8_transposes,
)
from ..fp8.verify import StaleTransposeError

__all__ = ["Fp8TransposeRefresh"]


class Fp8TransposeRefresh(pl.Callback):
    """Refresh every FP8 parameter's transpose right after each ``optimizer.step()``.

    How: at fit start a torch ``optimizer.register_step_post_hook`` is installed on each of the
    trainer's optimizers (public torch API, instance level); at fit end (or on an exception) it
    is removed. When the step is captured into a CUDA graph the refresh kernels are captured with
    it and every replay refreshes with no Python work; otherwise the refresh runs eagerly.
    An optimizer that owns FP8 parameters refreshes those; one that holds only FP32 masters
    refreshes all FP8 parameters of the LightningModule.

    Args:
        mode: ``"auto"`` does nothing when the model has no FP8 parameter; ``True`` requires them.
        refresh_at_fit_start: refresh once eagerly at fit start (after a checkpoint was loaded
            into the existing tensors), so caches start consistent.
        verify_every_n_steps: every N optimizer steps (0: never) compare each transpose with its
            data on the host (one sync) and raise :class:`StaleTransposeError` on a mismatch.

    Attributes:
        handles: the installed :class:`Fp8RefreshHandle` objects (empty outside fit).
        verified: how many verifications passed.
    """

    def __init__(
        self,
        mode: Union[bool, Literal["auto"]] = "auto",
        *,
        refresh_at_fit_start: bool = True,
        verify_every_n_steps: int = 0,
    ) -> None:
        if mode not in (True, False, "auto"):
            raise ValueError(f"Fp8TransposeRefresh(mode={mode!r}) is invalid: use True, False or 'auto'.")
        if not isinstance(verify_every_n_steps, int) or verify_every_n_steps < 0:
            raise ValueError(f"verify_every_n_steps={verify_every_n_steps!r} is invalid: use an int >= 0.")
        self.mode = mode
        self.refresh_at_fit_start = refresh_at_fit_start
        self.verify_every_n_steps = verify_every_n_steps
        self.handles: list[Fp8RefreshHandle] = []
        self.verified = 0
        self._past_calls = 0
        self._last_verified_step = -1

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()
        if not fp8_refresh_wanted(self.mode, pl_module):
            return
        all_fp8 = list(iter_fp8_params(pl_module))
        for opt in trainer.optimizers:
            ids = {id(p) for group in opt.param_groups for p in group["params"]}
            owned = [p for p in all_fp8 if id(p) in ids]
            handle = install_fp8_refresh(opt, owned or all_fp8, owner=f"Fp8TransposeRefresh(mode={self.mode!r})")
            if handle is not None:
                self.handles.append(handle)
        if self.refresh_at_fit_start:
            # Once now (a checkpoint may have been loaded into the existing tensors), set up by the one installer
            # like every other refresh, then removed.
            with install_fp8_refresh(_no_event, all_fp8, owner=f"Fp8TransposeRefresh(mode={self.mode!r})",
                                     require_stable_address=None) as once:
                once.run()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = self.verify_every_n_steps
        step = trainer.global_step
        if not n or not self.handles or step == self._last_verified_step or step % n:
            return
        self._last_verified_step = step
        report = verify_fp8_transposes(pl_module)
        if not report.ok:
            raise StaleTransposeError(
                f"after optimizer step {step}: {report}\nThe optimizer wrote FP8 bytes after the refresh ran (put the "
                "FP8 write-back inside optimizer.step(), or call nemo_cudagraph_plugin.fp8.after_param_sync(model) "
                "after the parameter all-gather)."
            )
        self.verified += 1

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._remove()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove()

    def _remove(self) -> None:
        for h in self.handles:
            h.remove()
            self._past_calls += h.calls
        self.handles.clear()

    @property
    def refreshes(self) -> int:
        """Host-side refresh runs after optimizer steps (a graph replay refreshes without coming back here)."""
        return self._past_calls + sum(h.calls for h in self.handles)


def _no_event(refresh: Callable[[], int]) -> Callable[[], None]:
    """An ``attach`` for :func:`install_fp8_refresh` of an event that never fires: the caller runs the handle."""
    return _detached


def _detached() -> None:
    return None
