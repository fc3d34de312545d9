"""What a user learns on a machine without a GPU: refusals that need
no GPU are raised at setup/train start on any machine, eager batches are counted with their reason, and option
errors name the class and argument the user typed."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from nemo_cudagraph_plugin import CaptureConfig, CaptureError, CudaGraphCallback, CudaGraphStrategy
from recipes.gpt import GPTLightningModule, TokenDataset, get_config


def _module(**kw):
    pl.seed_everything(0, verbose=False)
    return GPTLightningModule(get_config("tiny", n_layer=1, n_embd=32, n_head=2, seq_len=16), **kw)


def _loader(n=6):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TokenDataset(torch.randint(0, 256, (2000,), generator=g), 16, num_samples=n * 2), batch_size=2)


def _trainer(callbacks=(), steps=4, **kw):
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=list(callbacks), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)


# -- eager steps are counted, with the reason ---------------------------------------------------------
def test_cpu_fit_counts_every_eager_step_with_its_reason():
    cb = CudaGraphCallback()
    with pytest.warns(UserWarning, match="no CUDA device"):
        _trainer([cb], steps=5).fit(_module(), _loader())
    assert cb.stats.replays == 0
    assert cb.stats.eager_steps == 5 and cb.stats.eager_reasons == {"no CUDA device": 5}, cb.stats
    assert "5 other eager steps (no CUDA device: 5)" in cb.stats.summary()


def test_disabled_fit_counts_its_steps_as_disabled():
    cb = CudaGraphCallback(enabled=False)
    with pytest.warns(UserWarning, match="enabled=False"):
        _trainer([cb], steps=3).fit(_module(), _loader())
    assert cb.stats.eager_reasons == {"disabled": 3}


# -- refusals that need no GPU are raised on any machine -------------------------------------------------
class _Manual(GPTLightningModule):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


class _Lbfgs(GPTLightningModule):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


@pytest.mark.parametrize(
    "make,kw,match",
    [
        (lambda: _Manual(get_config("tiny", n_layer=1, n_embd=32, n_head=2, seq_len=16)), {}, "manual optimization"),
        (lambda: _Lbfgs(get_config("tiny", n_layer=1, n_embd=32, n_head=2, seq_len=16)), {}, "LBFGS cannot run"),
    ],
)
def test_module_that_cannot_be_graphed_is_refused_on_a_cpu_machine(make, kw, match):
    with pytest.raises(CaptureError, match=match) as ei:
        _trainer([CudaGraphCallback()], **kw).fit(make(), _loader())
    assert "CudaGraphCallback" in str(ei.value) and "on_capture_error='eager'" in str(ei.value)


def test_refusal_on_cpu_with_eager_fallback_warns_and_counts():
    cb = CudaGraphCallback(on_capture_error="eager")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _trainer([cb], steps=3).fit(_Manual(get_config("tiny", n_layer=1, n_embd=32, n_head=2, seq_len=16)), _loader())
    ours = [str(x.message) for x in w if "nemo_cudagraph_plugin" in str(x.message)]
    assert len(ours) == 1 and "manual optimization" in ours[0], ours
    assert cb.stats.eager_reasons == {"manual optimization": 3}


def test_fp16_precision_is_refused_at_setup_before_any_optimizer_exists():
    from nemo_cudagraph_plugin.lightning.checks import setup_refusal

    t = _trainer()
    m = _module()
    t.strategy.connect(m)
    t.strategy.precision_plugin.precision = "16-mixed"  # what a GPU trainer reports; CPU turns it into bf16
    why = setup_refusal(CaptureConfig(), t, m, "CudaGraphCallback")
    assert why is not None and "GradScaler" in why.message and not why.soft


# -- errors in the user's words ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call,text",
    [
        (lambda: CudaGraphCallback(warmup_steps=0), r"CudaGraphCallback\(warmup_steps=0\) is invalid: use an int >= 1"),
        (lambda: CudaGraphStrategy(max_graphs=0), r"CudaGraphStrategy\(max_graphs=0\) is invalid"),
        (lambda: CudaGraphCallback(nan_guard="grad"), r"CudaGraphCallback\(nan_guard='grad'\) is invalid: use True, False, 'loss' or 'full'"),
        (lambda: CaptureConfig(verify_steps=-1), r"CaptureConfig\(verify_steps=-1\) is invalid"),
        (lambda: CudaGraphCallback(align_pp_transposes=True, fp8_refresh=False), r"CudaGraphCallback\(fp8_refresh=False\)"),
    ],
)
def test_option_errors_name_the_class_and_argument_typed(call, text):
    with pytest.raises(ValueError, match=text):
        call()


def test_unknown_option_lists_the_options():
    with pytest.raises(TypeError, match=r"CudaGraphCallback\(\) got an unexpected option 'warmup'.*warmup_steps"):
        CudaGraphCallback(warmup=3)


def test_options_have_one_definition_and_typed_signatures():
    import dataclasses
    import inspect

    names = [f.name for f in dataclasses.fields(CaptureConfig)]
    for cls in (CudaGraphCallback, CudaGraphStrategy):
        sig = inspect.signature(cls)
        opts = [p for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
        assert [p.name for p in opts] == names
        assert all(p.annotation is not inspect.Parameter.empty for p in opts)
        assert {p.name: p.default for p in opts} == {f.name: f.default for f in dataclasses.fields(CaptureConfig)}
    cfg = CaptureConfig(warmup_steps=7, nan_guard="loss")
    cb = CudaGraphCallback(cfg, max_graphs=2)
    assert (cb.config.warmup_steps, cb.config.nan_guard, cb.config.max_graphs) == (7, "loss", 2)
    assert cfg.max_graphs == 8, "the given config must not be changed"


# -- the callback refuses DDP -------------------------------------------------------------------------------
def test_callback_with_ddp_strategy_points_to_the_strategy():
    from nemo_cudagraph_plugin.lightning.checks import setup_refusal

    t = pl.Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(), logger=False, enable_progress_bar=False)
    m = _module()
    why = setup_refusal(CaptureConfig(), t, m, "CudaGraphCallback")
    assert why is not None and "CudaGraphStrategy('ddp')" in why.message and not why.soft
    assert setup_refusal(CaptureConfig(), t, m, "CudaGraphStrategy") is None


def test_callback_and_strategy_together_is_one_clear_error():
    s = CudaGraphStrategy("single_device")
    with pytest.raises(ValueError, match="Both CudaGraphCallback and CudaGraphStrategy"):
        _trainer([CudaGraphCallback()], strategy=s).fit(_module(), _loader())


def test_adapters_warn_once_above_the_newest_tested_version_and_refuse_below_the_minimum(monkeypatch):
    from packaging.version import Version

    import nemo_cudagraph_plugin.core._torch_compat as tc
    import nemo_cudagraph_plugin.core.warn as warn_mod
    from nemo_cudagraph_plugin.lightning import _compat

    monkeypatch.setattr(warn_mod, "_WARNED", set())
    monkeypatch.setattr(_compat, "LIGHTNING_VERSION", Version("9.0.0"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _compat.check_lightning_version()
        _compat.check_lightning_version()
    assert len(w) == 1 and "tested with lightning 2.4.0 - 2.6.6; found 9.0.0" in str(w[0].message)
    monkeypatch.setattr(_compat, "LIGHTNING_VERSION", Version("2.3.0"))
    with pytest.raises(RuntimeError, match="needs lightning >= 2.4.0"):
        _compat.check_lightning_version()
    monkeypatch.setattr(tc, "TORCH_VERSION", Version("9.0.0"))
    with pytest.warns(UserWarning, match="tested with torch"):
        tc.check_torch_version()
