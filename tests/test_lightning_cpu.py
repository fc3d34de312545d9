"""CPU tests of the Lightning adapter: eager fallback with a real Trainer, option plumbing, refusals,
log re-emission and progress bookkeeping (the parts of a replay that are Python)."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from torch.utils.data import DataLoader

from nemo_cudagraph_plugin import CaptureConfig, CaptureStats, CudaGraphCallback, CudaGraphStrategy
from nemo_cudagraph_plugin.lightning import _compat
from nemo_cudagraph_plugin.lightning.runner import LightningStepRunner
from recipes.gpt import GPTLightningModule, TokenDataset, get_config


def _module(seed=0, **kw):
    pl.seed_everything(seed, verbose=False)
    return GPTLightningModule(get_config("tiny", n_layer=1, n_embd=64, n_head=2, seq_len=32), **kw)


def _loader(n=12):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TokenDataset(torch.randint(0, 256, (2000,), generator=g), 32, num_samples=n * 2), batch_size=2)


class Rec(pl.Callback):
    def __init__(self):
        self.losses, self.logged, self.steps = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.logged.append(float(trainer.callback_metrics["train_loss"]))
        self.steps.append(trainer.global_step)


def _fit(module, callbacks=(), strategy="auto", steps=12, **kw):
    rec = Rec()
    t = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, callbacks=[*callbacks, rec],
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)
    t.fit(module, train_dataloaders=_loader(steps * kw.get("accumulate_grad_batches", 1)))
    return t, rec


def test_callback_without_cuda_warns_once_and_trains_identically():
    _, plain = _fit(_module())
    cb = CudaGraphCallback()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _, rec = _fit(_module(), [cb])
    ours = [str(x.message) for x in w if "nemo_cudagraph_plugin" in str(x.message)]
    assert len(ours) == 1 and "no CUDA device" in ours[0] or "not on a CUDA device" in ours[0]
    assert rec.losses == plain.losses and rec.steps == plain.steps
    assert cb.stats.replays == 0 and cb.eager_reason


def test_strategy_without_cuda_trains_identically():
    _, plain = _fit(_module())
    s = CudaGraphStrategy(SingleDeviceStrategy(device="cpu"))
    with pytest.warns(UserWarning, match="training eagerly"):
        _, rec = _fit(_module(), strategy=s)
    assert rec.losses == plain.losses and s.stats.replays == 0


def test_callback_and_strategy_together_is_one_clear_error():
    with pytest.raises(ValueError, match="Both CudaGraphCallback and CudaGraphStrategy"):
        _fit(_module(), [CudaGraphCallback()], strategy=CudaGraphStrategy(SingleDeviceStrategy(device="cpu")))


def test_options_reach_the_engine_config():
    cb = CudaGraphCallback(warmup_steps=5, max_graphs=3, on_capture_error="eager", nan_guard="loss", verify_steps=2)
    assert (cb.config.warmup_steps, cb.config.max_graphs, cb.config.on_capture_error, cb.config.nan_mode, cb.config.verify_steps) == (
        5, 3, "eager", "loss", 2)
    s = CudaGraphStrategy(warmup_steps=4, nan_action="skip")
    assert s.capture_config.warmup_steps == 4 and s.capture_config.nan_action == "skip"
    with pytest.raises(ValueError, match="warmup_steps"):
        CudaGraphCallback(warmup_steps=0)


def test_strategy_wraps_ddp_and_refuses_what_it_cannot_capture():
    d = CudaGraphStrategy("ddp")
    assert isinstance(d, DDPStrategy) and isinstance(d, CudaGraphStrategy)
    assert d.capture_config.warmup_steps >= 11  # PyTorch's DDP + graphs guidance
    custom = CudaGraphStrategy(DDPStrategy(static_graph=True))
    assert custom._ddp_kwargs["static_graph"] is True
    with pytest.raises(ValueError, match="find_unused_parameters=True"):
        CudaGraphStrategy(DDPStrategy(find_unused_parameters=True))
    with pytest.raises(ValueError, match="FSDP"):
        CudaGraphStrategy(FSDPStrategy())
    with pytest.raises(ValueError, match="unknown strategy name"):
        CudaGraphStrategy("deepspeed")
    with pytest.raises(ValueError, match="wrap a plain strategy once"):
        CudaGraphStrategy(CudaGraphStrategy())


def _trainer_for_refusal(**kw):
    m = _module()
    t = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False, **kw)
    t.strategy.connect(m)
    m.trainer = t
    t.strategy._lightning_optimizers = []
    t.strategy.optimizers = [torch.optim.AdamW(m.parameters())]
    return t, m


@pytest.mark.parametrize(
    "kw,attr,match",
    [
        ({}, "fp16", "GradScaler"),
        ({}, "manual", "manual optimization"),
    ],
)
def test_refusal_reasons_name_the_fix(kw, attr, match):
    t, m = _trainer_for_refusal(**kw)
    if attr == "fp16":  # Lightning turns 16-mixed into bf16 on CPU; set what a GPU trainer would report
        t.strategy.precision_plugin.precision = "16-mixed"
    if attr == "manual":
        m.automatic_optimization = False
    r = LightningStepRunner(CaptureConfig(), CaptureStats())
    why = r.refusal(t, m, require_cuda=False)
    assert why is not None and match in why


class _EagerEngine:
    """Stands in for the CUDA engine on CPU: every step eager (the Python bookkeeping is what's tested)."""

    def __init__(self):
        self.calls = 0

    def step(self, batch, phase, fn, quiet_fn=None):
        self.calls += 1
        return fn(batch)


class _BindEager(pl.Callback):
    def __init__(self):
        self.runner = LightningStepRunner(CaptureConfig(nan_guard=False), CaptureStats())
        self.deltas = []

    def on_train_start(self, trainer, pl_module):
        r = self.runner
        r.trainer, r.pl_module = trainer, pl_module
        r._loop = _compat.automatic_loop(trainer)
        r.engine = _EagerEngine()
        r._orig_run = r._loop.run
        r._loop.run = self._run

    def _run(self, optimizer, batch_idx, kwargs: OrderedDict):
        out = self.runner.run(optimizer, batch_idx, kwargs)
        self.deltas.append(self.runner._last_delta.incs)
        return out


def test_recorded_logs_are_re_emitted_with_the_same_values_and_counters_advance():
    _, plain = _fit(_module(), accumulate_grad_batches=2)
    b = _BindEager()
    _, rec = _fit(_module(), [b], accumulate_grad_batches=2)
    assert b.runner.engine.calls == 24
    assert rec.losses == plain.losses
    assert rec.logged == plain.logged, "self.log values must be re-emitted per step"
    assert rec.steps == plain.steps


def test_progress_delta_matches_what_lightning_increments_per_phase():
    b = _BindEager()
    _fit(_module(), [b], steps=6, accumulate_grad_batches=2)
    acc, step = b.deltas[0], b.deltas[1]
    names = lambda d: sorted({(type(o).__name__, n) for o, n, _ in d})  # noqa: E731
    assert acc != step
    assert all(inc == 1 for _, _, inc in acc + step)
    # batch 0 zeroes gradients (zero_grad counters), batch 1 steps the optimizer (step counters)
    assert {type(o).__name__ for o, _, _ in acc} == {"_StartedTracker"}
    assert {type(o).__name__ for o, _, _ in step} == {"_ReadyCompletedTracker"}
    assert names(b.deltas[2]) == names(acc) and names(b.deltas[3]) == names(step)


def test_phase_matches_lightning_decision():
    seen = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(_compat.step_phase(trainer, _compat.automatic_loop(trainer), batch_idx))

    _fit(_module(), [Spy()], steps=4, accumulate_grad_batches=3)
    assert seen[:6] == [(True, False), (False, False), (False, True)] * 2
