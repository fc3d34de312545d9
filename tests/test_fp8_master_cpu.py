"""MasterWeightAdamW: AdamW on FP32 masters that writes FP8 weights from them, eager and graphed (the tape backend),
with FP8 stand-ins whose bytes are real E4M3 values (``fp8_doubles.quantized_fp8_param``)."""

from __future__ import annotations

import importlib
import io
import warnings

import lightning.pytorch as pl
import pytest
import torch
from _tape import TapeBackend
from fp8_doubles import expected_transpose, make_fp8_param, quantized_fp8_param, te_named_param

from nemo_cudagraph_plugin import CudaGraphCallback
from nemo_cudagraph_plugin.fp8 import MasterWeightAdamW


def _quantized(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a per-tensor current-scaling write of ``master`` gives: E4M3 bytes and ``scale_inv``."""
    scale = 448.0 / master.abs().amax().clamp_min(1e-12)
    q = (master * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale.reciprocal().reshape(1)


def _params(seed=0, generation="te2"):
    g = torch.Generator().manual_seed(seed)
    w = quantized_fp8_param(torch.randn(8, 4, generator=g) * 0.1, generation=generation)
    b = torch.nn.Parameter((torch.randn(4, generator=g) * 0.1).bfloat16())
    h = torch.nn.Parameter(torch.randn(4, 2, generator=g) * 0.1)
    return w, b, h


HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


@pytest.mark.parametrize("generation", ["te1.6", "te1.8", "te2"])  # each Float8Tensor shape the package supports
def test_each_step_updates_fp32_masters_with_adamw_and_writes_every_weight_from_its_master(generation):
    w, b, h = _params(generation=generation)
    opt = MasterWeightAdamW([w, b, h], **HP)
    masters = [torch.nn.Parameter(w.dequantize().clone()), torch.nn.Parameter(b.detach().float()),
               torch.nn.Parameter(h.detach().clone())]
    ref = torch.optim.AdamW(masters, foreach=True, **HP)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(t.shape, generator=g) for t in (w, b, h)]
        w.grad, b.grad, h.grad = grads[0], grads[1].bfloat16(), grads[2]
        for m, gr in zip(masters, grads):
            m.grad = gr if m is not masters[1] else gr.bfloat16().float()
        w._transpose_invalid = False
        opt.step()
        ref.step()
        data, scale_inv = _quantized(masters[0].detach())
        assert torch.equal(w._data, data) and torch.equal(w._scale_inv, scale_inv), "FP8 weight not its master's"
        assert w._transpose_invalid, "the write did not mark the transpose stale (TE's _reset_caches)"
        assert torch.equal(b.detach(), masters[1].detach().bfloat16()), "BF16 weight not its master rounded"
        assert torch.equal(h.detach(), masters[2].detach()), "an FP32 weight is its own master, updated as AdamW"
    assert b.dtype == torch.bfloat16 and opt._inner.param_groups[0]["params"][1].dtype == torch.float32


def test_a_weight_without_a_gradient_is_neither_updated_nor_rewritten():
    w, b, h = _params()
    opt = MasterWeightAdamW([w, b, h], **HP)
    before = (w._data.clone(), w._scale_inv.clone(), b.detach().clone())
    h.grad = torch.ones_like(h)
    opt.step()
    assert torch.equal(w._data, before[0]) and torch.equal(w._scale_inv, before[1]) and not w._transpose_invalid
    assert torch.equal(b.detach(), before[2])
    assert not torch.equal(h.detach(), _params()[2].detach())


@pytest.mark.parametrize("kind", ["MXFP8Tensor", "Float8BlockwiseQTensor", "NVFP4Tensor"])
def test_a_format_it_does_not_write_is_refused_naming_the_parameter(kind):
    w, _, h = _params()
    with pytest.raises(ValueError, match=rf"param group 1, #0 is a TransformerEngine {kind}; it writes per-tensor"):
        MasterWeightAdamW([{"params": [w, h]}, {"params": [te_named_param(kind)]}])
    col = make_fp8_param("te2", (8, 4), rowwise=False)
    with pytest.raises(ValueError, match=r"#0 is a Float8Tensor without row-wise E4M3/E5M2 data"):
        MasterWeightAdamW([col])


def _train(opt, params, steps, g):
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def test_a_resumed_run_equals_the_uninterrupted_one_with_fp32_masters_kept():
    whole = _params()
    opt = MasterWeightAdamW(list(whole), **HP)
    _train(opt, whole, 5, torch.Generator().manual_seed(2))

    first = _params()
    opt1 = MasterWeightAdamW(list(first), **HP)
    g = torch.Generator().manual_seed(2)
    _train(opt1, first, 3, g)
    buf = io.BytesIO()
    torch.save(opt1.state_dict(), buf)
    buf.seek(0)
    resumed = _params(seed=9)  # other values: the weights come from the checkpoint's model state
    for p, q in zip(resumed, first):
        with torch.no_grad():
            p.copy_(q)
        if hasattr(q, "_data"):
            p._data.copy_(q._data)
            p._scale_inv.copy_(q._scale_inv)
    opt2 = MasterWeightAdamW(list(resumed), **HP)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    _train(opt2, resumed, 2, g)
    assert torch.equal(resumed[0]._data, whole[0]._data) and torch.equal(resumed[0]._scale_inv, whole[0]._scale_inv)
    assert torch.equal(resumed[1].detach(), whole[1].detach()) and torch.equal(resumed[2].detach(), whole[2].detach())
    assert opt2.state_dict()["state"][1]["master"].dtype == torch.float32


# -- graphed: the tape backend in a Lightning fit -------------------------------------------------------------------
class _Fp8Linear(torch.autograd.Function):
    """A GEMM as TE runs it on Hopper with an FP8 weight: the forward reads the row-wise bytes, the backward's input
    gradient the cached transpose (eager TE rebuilds it first when it is marked stale; a graph reads it as is)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        ctx.w = w
        return x @ w.dequantize().t()

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        w = ctx.w
        w.update_usage(columnwise_usage=True)
        wt = w._transpose.view(torch.float8_e4m3fn).float() * w._scale_inv  # [in, out]
        return dy @ wt.t(), dy.t() @ x


class _Lit(pl.LightningModule):
    def __init__(self, capturable):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = quantized_fp8_param(torch.randn(8, 8, generator=g) * 0.3, fp8_name="w")
        self.norm = torch.nn.Parameter(torch.ones(8).bfloat16())
        self.head = torch.nn.Linear(8, 1)
        self.capturable = capturable
        self.lrs = []

    def training_step(self, batch, batch_idx):
        x = _Fp8Linear.apply(batch, self.w) * self.norm.float()
        return self.head(torch.tanh(x)).pow(2).mean()

    def configure_optimizers(self):
        opt = MasterWeightAdamW(self.parameters(), lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1,
                                capturable=self.capturable)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 7:  # a float assigned between steps, over the device tensor a graph reads
            self.optimizers().optimizer.param_groups[0]["lr"] = 5e-3

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        return torch.utils.data.DataLoader(torch.randn(24, 8, generator=g), batch_size=2)


def _fit(graphed, capturable, steps=12, **cb_kw):
    pl.seed_everything(0, verbose=False)
    module = _Lit(capturable)
    cbs = []
    cb = None
    if graphed:
        cb = CudaGraphCallback(sync_check=False, **cb_kw)
        cb.step_runner.backend = TapeBackend(sync_in_capture="bake")
        cbs.append(cb)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=cbs,
                         gradient_clip_val=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return module, cb


@pytest.fixture
def capturable_on_cpu(monkeypatch):
    """torch's capturable AdamW refuses CPU parameters (a device check only): lifted, as on a GPU."""
    monkeypatch.setattr(importlib.import_module("torch.optim.adam"), "_get_capturable_supported_devices",
                        lambda supports_xla=True: ["cuda", "cpu"])


@pytest.mark.parametrize("verify", [0, 2])
def test_a_graphed_fit_trains_the_fp8_weights_as_the_eager_fit_with_schedule_clipping_and_a_float_lr(
        capturable_on_cpu, verify):
    eager, _ = _fit(False, True)
    graphed, cb = _fit(True, True, verify_steps=verify)
    assert cb.stats.replays >= 6 and not cb.stats.eager_reasons, cb.stats.summary()
    assert cb.stats.verified_steps == verify
    assert torch.equal(graphed.w._data, eager.w._data) and torch.equal(graphed.w._scale_inv, eager.w._scale_inv)
    assert torch.equal(graphed.norm, eager.norm) and torch.equal(graphed.head.weight, eager.head.weight)
    # the graph's FP8 refresh kept the transpose the backward reads current
    assert torch.equal(graphed.w._transpose, expected_transpose(graphed.w))
    lr = graphed.trainer.optimizers[0].param_groups[0]["lr"]
    assert float(lr) == float(eager.trainer.optimizers[0].param_groups[0]["lr"])


def test_its_own_update_is_graphed_without_a_math_warning(capturable_on_cpu):
    _, cb = _fit(True, True, steps=6)
    assert cb.step_runner.adapter.prep.math_differs == ""


def test_masters_start_from_tes_kept_high_precision_values_which_are_then_freed():
    w, _, _ = _params()
    exact = torch.randn(8, 4) * 0.1
    kept = {"v": exact.clone()}
    w.get_high_precision_init_val = lambda: kept["v"]
    w.clear_high_precision_init_val = lambda: kept.update(v=None)
    opt = MasterWeightAdamW([w])
    assert torch.equal(opt._inner.param_groups[0]["params"][0], exact) and kept["v"] is None
    assert not torch.equal(w.dequantize(), exact)  # the FP8 value alone would have started elsewhere


def test_the_fp8_format_is_read_from_tes_dtype_enum_as_each_te_version_shapes_it():
    # TE up to 2.16: ``_fp8_dtype`` a pybind11 enum member (prints ``DType.kFloat8E4M3``); TE 2.17 on: a Python
    # ``IntEnum`` member (``transformer_engine/pytorch/constants.py``), which prints as its number on Python >= 3.11
    from fp8_doubles import TeDType as DType
    from fp8_doubles import _DType

    from nemo_cudagraph_plugin.fp8 import _te_compat as te

    class T:
        def __init__(self, dt):
            self._fp8_dtype = dt

    for e4m3, e5m2, other in ((_DType("kFloat8E4M3"), _DType("kFloat8E5M2"), _DType("kBFloat16")),
                              (DType.kFloat8E4M3, DType.kFloat8E5M2, DType.kBFloat16)):
        assert te.fp8_element_format(T(e4m3)) == (torch.float8_e4m3fn, 448.0), e4m3
        assert te.fp8_element_format(T(e5m2)) == (torch.float8_e5m2, 57344.0), e5m2
        assert te.fp8_element_format(T(other)) is None
