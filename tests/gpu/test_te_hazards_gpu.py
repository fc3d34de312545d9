"""With real TransformerEngine: TE's graph hazards are checked for every TE model, not only
for models with FP8 primary weights (a bf16-weight TE model under FP8 autocast needs them too).

Skipped without CUDA, without ``transformer_engine.pytorch`` or without FP8 support on the GPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch", reason="TransformerEngine is not installed")

import lightning.pytorch as pl  # noqa: E402
from _lightning_utils import fit  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from nemo_cudagraph_plugin import CaptureError, CudaGraphCallback  # noqa: E402
from recipes.gpt import _default_fp8_recipe, _fp8_available, _te_autocast  # noqa: E402

_ok, _why = _fp8_available(te)
if not _ok:
    pytest.skip(f"FP8 is not available: {_why}", allow_module_level=True)


class _TEMlp(pl.LightningModule):
    """bf16-weight TE layers (no FP8 primary weights) run under FP8 autocast."""

    def __init__(self, first_microbatch=None):
        super().__init__()
        self.first_microbatch = first_microbatch
        self.l1 = te.Linear(256, 256, params_dtype=torch.float32)
        self.l2 = te.Linear(256, 256, params_dtype=torch.float32)
        self.recipe = _default_fp8_recipe(te)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        with _te_autocast(te, self.recipe):
            h = self.l1(x, is_first_microbatch=self.first_microbatch)
            y = self.l2(torch.relu(h), is_first_microbatch=self.first_microbatch)
        return y.float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _data(n=30):
    g = torch.Generator().manual_seed(0)
    return DataLoader([(torch.randn(256, generator=g),) for _ in range(n * 32)], batch_size=32)


def test_frozen_is_first_microbatch_false_is_refused_for_bf16_weight_te_models():
    pl.seed_everything(0, verbose=False)
    with pytest.raises(CaptureError) as ei:
        fit(_TEMlp(first_microbatch=False), [CudaGraphCallback()], 10, train_loader=_data(10))
    print(f"\nTE HAZARD: {str(ei.value)[:200]}")
    assert ei.value.rule == "fp8-weight-cache", str(ei.value)


def test_bf16_weight_te_model_under_fp8_autocast_graphs_and_matches_eager():
    def run(cbs):
        pl.seed_everything(0, verbose=False)
        return fit(_TEMlp(first_microbatch=None), cbs, 30, train_loader=_data())

    cb = CudaGraphCallback()
    _, g = run([cb])
    from _lightning_utils import CapturableEager

    _, e = run([CapturableEager()])
    assert cb.stats.replays > 20, cb.stats.summary()
    gl, el = g.loss_tensor(), e.loss_tensor()
    rel = float(((gl - el).abs() / el.abs()).max())
    print(f"\nTE bf16 weights + FP8 autocast: graph vs eager max rel loss diff {rel:.3e}; {cb.stats.summary()}")
    assert torch.equal(gl, el), rel
