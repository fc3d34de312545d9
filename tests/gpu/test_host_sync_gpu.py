"""No host sync in replayed steps: a window of replayed steps runs under ``torch.cuda.set_sync_debug_mode``.

``set_sync_debug_mode("error")`` makes every synchronizing CUDA call (``.item()``, ``float(t)``, ``.cpu()``,
blocking copies, ``torch.cuda.synchronize`` through a stream) raise ``RuntimeError: called a synchronizing CUDA
operation``. The window opens in ``on_train_batch_start`` of a step well after the capture and closes in
``on_train_batch_end`` of its last step, so it covers the replays, the plugin's host work between them (log
re-emission, counters, hyperparameter sync) and Lightning's loop. The NaN guard's read is moved out of the
window (``nan_check_every`` larger than the run) except in the test that shows its queued read does not sync.

Each armed window first proves the mode is live (one deliberate sync must raise / warn), and
``test_per_step_host_read_in_the_window_is_detected`` shows the same mechanism catches a per-step
``float(outputs["loss"])`` (what a progress bar costs): these tests can fail.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from _lightning_utils import loader

from nemo_cudagraph_plugin import CudaGraphCallback
from recipes.gpt import GPTLightningModule, get_config, gpt_loss

STEPS = 40
START, STOP = 10, 30  # batch indices [START, STOP): replays (3 eager warm-up steps, capture at step 3)
QUIET = 10_000  # nan_check_every beyond the run: no NaN-guard read inside the window


@pytest.fixture(autouse=True)
def _reset_sync_debug_mode():
    yield
    torch.cuda.set_sync_debug_mode(0)


class QuietModule(GPTLightningModule):
    """Logs ``train_loss`` without ``prog_bar``: Lightning turns progress-bar metrics into Python floats (a host
    sync per step) — a cost of that logging choice in eager training too, not of the plugin."""

    def __init__(self, cfg, *, fused: bool = False, **kw) -> None:
        super().__init__(cfg, **kw)
        self.fused = fused

    def training_step(self, batch, batch_idx):
        loss = gpt_loss(self(batch["input_ids"]), batch["labels"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True if self.fused else None)
        if self.max_steps is None:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


SETUPS = {
    # plain: fp32, torch's default AdamW, no scheduler
    "fp32": ({}, {}),
    # per-step host work of the plugin: an LR scheduler stepped every step, clipping, fused AdamW, bf16 weights
    # (bf16-true: Lightning refuses clipping with a fused optimizer under AMP precision)
    "bf16_fused_sched_clip": ({"fused": True, "warmup_steps": 5, "max_steps": STEPS},
                              {"precision": "bf16-true", "gradient_clip_val": 1.0}),
}


class SyncWindow(pl.Callback):
    """Arms ``set_sync_debug_mode(mode)`` from the start of step ``start`` to the end of step ``stop - 1``.

    Records, per window step, the mode seen at its end (proves nothing switched the check off) and, in
    ``"warn"`` mode, the syncs from its start to the next step's start (the last step: to its end).
    """

    def __init__(self, graph_cb: CudaGraphCallback, mode: str, start: int = START, stop: int = STOP) -> None:
        self.graph_cb, self.mode, self.start, self.stop = graph_cb, mode, start, stop
        self.modes: dict[int, int] = {}
        self.syncs: dict[int, int] = {}
        self.replays = None
        self.closed = False
        self._cm = None
        self._rec: list = []
        self._mark = 0
        self._open_step = None

    def _count(self) -> int:
        return sum("synchroniz" in str(w.message) for w in self._rec)

    def _close_step(self) -> None:
        if self.mode == "warn" and self._open_step is not None:
            n = self._count()
            self.syncs[self._open_step] = n - self._mark
            self._mark = n

    def _disarm(self) -> None:
        torch.cuda.set_sync_debug_mode(0)
        if self._cm is not None:
            self._cm.__exit__(None, None, None)
            self._cm = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.start:
            torch.cuda.synchronize()
            self._replays0 = self.graph_cb.stats.replays
            if self.mode == "warn":
                self._cm = warnings.catch_warnings(record=True)
                self._rec = self._cm.__enter__()
                warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(self.mode)
            probe = torch.ones((), device="cuda")
            if self.mode == "error":  # the check is live: a deliberate sync raises
                with pytest.raises(RuntimeError, match="synchroniz"):
                    float(probe)
            else:  # ... or is recorded
                float(probe)
                assert self._count() == 1, "set_sync_debug_mode('warn') recorded no warning for float(tensor)"
            self._mark = self._count() if self.mode == "warn" else 0
        if self.start < batch_idx < self.stop:
            self._close_step()
        if self.start <= batch_idx < self.stop:
            self._open_step = batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.start <= batch_idx < self.stop:
            self.modes[batch_idx] = torch.cuda.get_sync_debug_mode()
        if batch_idx == self.stop - 1:
            self._close_step()
            self._disarm()
            self.replays = self.graph_cb.stats.replays - self._replays0
            self.closed = True

    def on_exception(self, trainer, pl_module, exception):
        self._disarm()  # first: Lightning's teardown after an exception synchronizes


class PerStepRead(pl.Callback):
    """``float(outputs["loss"])`` at the end of every step (a progress bar's cost)."""

    def __init__(self) -> None:
        self.read_at: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.read_at.append(batch_idx)
        float(outputs["loss"])


def _fit(setup: str, graph_cb: CudaGraphCallback, extra: list) -> pl.Trainer:
    module_kw, trainer_kw = SETUPS[setup]
    pl.seed_everything(0, verbose=False)
    module = QuietModule(get_config("tiny", n_layer=2, seq_len=256), **module_kw)
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=STEPS, callbacks=[*extra, graph_cb], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, **trainer_kw)
    trainer.fit(module, train_dataloaders=loader(STEPS))
    return trainer


@pytest.mark.parametrize("setup", list(SETUPS))
def test_replayed_steps_do_not_sync(setup):
    cb = CudaGraphCallback(nan_check_every=QUIET)
    window = SyncWindow(cb, "error")
    _fit(setup, cb, [window])  # a sync in the window raises RuntimeError out of fit
    assert window.closed, "the window never reached its last step"
    assert window.modes == dict.fromkeys(range(START, STOP), 2), (
        f"set_sync_debug_mode was switched off inside the window: {window.modes}")
    assert window.replays == STOP - START, (
        f"{window.replays} of the {STOP - START} window steps were replays; {cb.stats.summary()}")
    assert cb.stats.captures == 1, cb.stats.summary()


def test_per_step_host_read_in_the_window_is_detected():
    """The mechanism of the test above catches a per-step sync: a loss read in on_train_batch_end."""
    cb = CudaGraphCallback(nan_check_every=QUIET)
    window = SyncWindow(cb, "error")
    reader = PerStepRead()
    with pytest.raises(RuntimeError, match="synchronizing CUDA operation"):
        _fit("fp32", cb, [window, reader])
    assert reader.read_at[-1] == START, f"the read raised at step {reader.read_at[-1]}, not at the window's first"
    assert torch.cuda.get_sync_debug_mode() == 0, "the window did not disarm after the exception"


def test_nan_checks_do_not_sync_either():
    """With the NaN guard read every N steps: its read is queued (pinned copy + event, polled later), so no
    replayed step syncs, the steps with a read included."""
    every = 5
    cb = CudaGraphCallback(nan_check_every=every)
    window = SyncWindow(cb, "warn")
    _fit("fp32", cb, [window])
    assert window.closed and window.replays == STOP - START, cb.stats.summary()
    syncing = {i: c for i, c in window.syncs.items() if c}
    print(f"\nSYNCS in replayed steps {START}-{STOP - 1} with nan_check_every={every}: {syncing or 'none'}")
    assert set(window.syncs) == set(range(START, STOP))
    assert not syncing, f"host syncs in replayed steps (NaN-guard reads every {every} steps): {syncing}"
