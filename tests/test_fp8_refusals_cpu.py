"""FP8 weights a fit cannot train right are refused before the first step, on a machine without a GPU, naming the
parameter, the format, the GPU and the fix: a quantized format the GPU does not run (the parameters' TE classes, and
the recipe of Lightning's TransformerEnginePrecision), an optimizer that updates FP8 weights without FP32 master
weights, TE's FusedAdam holding FP8 weights. TE is not needed: its classes are stood in for by name and module
(``fp8_doubles``), the GPU by a monkeypatched ``gpu_of``."""

from __future__ import annotations

import types

import lightning.pytorch as pl
import pytest
import torch
from fp8_doubles import TEFusedAdam, make_fp8_param, run_closure, te_named_param, te_recipe

from nemo_cudagraph_plugin import CaptureError, CudaGraphCallback, CudaGraphStrategy
from nemo_cudagraph_plugin.core.optim import OptimizerPrep, check_optimizer_supported
from nemo_cudagraph_plugin.fp8 import _te_compat as te
from nemo_cudagraph_plugin.fp8 import formats
from nemo_cudagraph_plugin.lightning.checks import fp8_refusal

H100 = formats.Gpu("NVIDIA H100 80GB HBM3", (9, 0), (12, 8))
H100_CU129 = formats.Gpu("NVIDIA H100 80GB HBM3", (9, 0), (12, 9))
B200 = formats.Gpu("NVIDIA B200", (10, 0), (12, 9))
RTX5090 = formats.Gpu("NVIDIA GeForce RTX 5090", (12, 0), (12, 9))
A100 = formats.Gpu("NVIDIA A100-SXM4-80GB", (8, 0), (12, 8))


@pytest.fixture
def on_gpu(monkeypatch):
    """``on_gpu(gpu)``: every device the checks ask about is ``gpu`` (the fit itself stays on the CPU)."""
    def use(gpu):
        monkeypatch.setattr(formats, "gpu_of", lambda device: gpu)
    return use


class _Lit(pl.LightningModule):
    """One TE-quantized weight (``kind``; ``None``: a plain one) and a plain head, trained by ``make_opt``."""

    def __init__(self, kind="Float8Tensor", make_opt=None):
        super().__init__()
        self.fc1_weight = te_named_param(kind, (8, 8)) if kind else torch.nn.Parameter(torch.randn(8, 8) * 0.1)
        self.head = torch.nn.Linear(8, 1)
        self.make_opt = make_opt or (lambda params: torch.optim.AdamW(params, lr=1e-3))

    def training_step(self, batch, batch_idx):
        return self.head(batch @ self.fc1_weight.t()).pow(2).mean()

    def configure_optimizers(self):
        return self.make_opt(list(self.parameters()))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=2)


def _fit(module, plugin=None, steps=3, **trainer_kw):
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[plugin] if isinstance(plugin, CudaGraphCallback) else [],
                         **({"strategy": plugin} if isinstance(plugin, CudaGraphStrategy) else {}), **trainer_kw)
    trainer.fit(module)
    return trainer


class _OwnMasterAdam(torch.optim.Optimizer):
    """A user's own optimizer (its ``step`` is not torch's), so the checks take it as one that keeps FP32 masters; it
    trains the weights as plain ones (the checks never look at the update). The product's MasterWeightAdamW, which
    writes per-tensor FP8 only, is tested in test_fp8_master_cpu."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3, "capturable": True})

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-1e-3)
        return loss


# -- 1. a quantized format the GPU does not run -----------------------------------------------------------------
@pytest.mark.parametrize("kind,gpu,rule", [
    ("MXFP8Tensor", H100, "MXFP8 on compute capability 10.0 or higher"),
    ("NVFP4Tensor", H100, "NVFP4 on compute capability 10.0 or higher"),
    ("MXFP8Tensor", RTX5090, "does not run MXFP8 on compute capability 12.0 or higher"),
    ("Float8BlockwiseQTensor", H100, "CUDA 12.9 or newer"),
], ids=["mxfp8-hopper", "nvfp4-hopper", "mxfp8-sm120", "block-scaling-cuda12.8"])
def test_a_format_the_gpu_does_not_run_is_refused_before_the_first_step(on_gpu, kind, gpu, rule):
    on_gpu(gpu)
    module = _Lit(kind, _OwnMasterAdam)
    with pytest.raises(CaptureError) as ei:
        _fit(module, CudaGraphCallback())
    msg = str(ei.value)
    assert f"parameter 'fc1_weight' is a TransformerEngine {kind}" in msg, msg
    assert f"{gpu.name} (compute capability {gpu.capability[0]}.{gpu.capability[1]}) cannot run" in msg, msg
    assert rule in msg, msg
    assert "Build the model under te.quantized_model_init with a recipe this GPU runs" in msg, msg
    assert module.global_step == 0, "refused before the first step"


def test_on_hopper_the_fix_names_the_recipes_hopper_runs(on_gpu):
    on_gpu(H100_CU129)
    with pytest.raises(CaptureError) as ei:
        _fit(_Lit("MXFP8Tensor", _OwnMasterAdam), CudaGraphCallback())
    assert "DelayedScaling(), Float8CurrentScaling() or Float8BlockScaling()" in str(ei.value)
    assert "MXFP8BlockScaling()" in str(ei.value)  # what the weights were built with
    on_gpu(H100)  # CUDA 12.8: no block scaling
    with pytest.raises(CaptureError, match=r"to te.autocast: DelayedScaling\(\) or Float8CurrentScaling\(\)\. "):
        _fit(_Lit("NVFP4Tensor", _OwnMasterAdam), CudaGraphCallback())


def test_a_gpu_without_fp8_says_to_train_without_it(on_gpu):
    on_gpu(A100)
    with pytest.raises(CaptureError) as ei:
        _fit(_Lit("Float8Tensor", _OwnMasterAdam), CudaGraphCallback())
    msg = str(ei.value)
    assert "A100-SXM4-80GB (compute capability 8.0) cannot run: TransformerEngine runs FP8 on compute capability 8.9" in msg
    assert "runs no FP8 format of TransformerEngine: train without FP8" in msg, msg


def test_the_refusal_holds_with_on_capture_error_eager_and_under_the_strategy(on_gpu):
    on_gpu(H100)
    with pytest.raises(CaptureError, match="on_capture_error='eager' would not help"):
        _fit(_Lit("NVFP4Tensor", _OwnMasterAdam), CudaGraphCallback(on_capture_error="eager"))
    with pytest.raises(CaptureError, match=r"CudaGraphStrategy: .*'fc1_weight' is a TransformerEngine NVFP4Tensor"):
        _fit(_Lit("NVFP4Tensor", _OwnMasterAdam), CudaGraphStrategy())


@pytest.mark.parametrize("kind,gpu", [("Float8Tensor", H100), ("Float8BlockwiseQTensor", H100_CU129),
                                      ("MXFP8Tensor", B200), ("NVFP4Tensor", RTX5090)],
                         ids=["fp8-hopper", "block-scaling-hopper", "mxfp8-b200", "nvfp4-sm120"])
def test_a_format_the_gpu_runs_passes(on_gpu, kind, gpu):
    on_gpu(gpu)
    cb = CudaGraphCallback()
    with pytest.warns(UserWarning, match="no CUDA device"):  # past the FP8 checks: the CPU machine's soft refusal
        _fit(_Lit(kind, _OwnMasterAdam), cb, steps=3)
    assert cb.stats.eager_reasons == {"no CUDA device": 3}


def test_parameters_off_the_gpu_are_not_judged():
    assert formats.gpu_of(torch.device("cpu")) is None
    assert formats.unsupported_params([("w", te_named_param("NVFP4Tensor"))]) is None


def test_tes_rules_follow_its_version():
    # TE 2.3-2.8: block scaling on Hopper only; from TE 2.9 on 9.0 or higher
    assert te.format_unsupported("fp8_block", (10, 0), (12, 9), (2, 8, 0)) is not None
    assert te.format_unsupported("fp8_block", (10, 0), (12, 9), (2, 9, 0)) is None
    # TE 2.6 stopped running MXFP8 on 12.0+
    assert te.format_unsupported("mxfp8", (12, 0), (12, 9), (2, 5, 0)) is None
    assert te.format_unsupported("mxfp8", (12, 0), (12, 9), (2, 6, 0)) is not None
    # Ada runs per-tensor FP8 from CUDA 12.1
    assert te.format_unsupported("fp8", (8, 9), (12, 1)) is None
    assert te.format_unsupported("fp8", (8, 9), (12, 0)) is not None
    assert te.recipe_formats((10, 0), (12, 9)) == ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
                                                   "MXFP8BlockScaling", "NVFP4BlockScaling"]


# -- 1b. the recipe of Lightning's TransformerEnginePrecision --------------------------------------------------------
def _te_precision(recipe):
    """Lightning's TransformerEnginePrecision as it is after its __init__ (which imports TE), holding ``recipe``."""
    from lightning.pytorch.plugins import TransformerEnginePrecision

    plugin = TransformerEnginePrecision.__new__(TransformerEnginePrecision)
    plugin.weights_dtype, plugin.recipe, plugin.replace_layers = torch.float32, recipe, False
    plugin.fallback_compute_dtype = torch.float32
    return plugin


def test_a_precision_plugin_recipe_the_gpu_does_not_run_is_refused_before_the_first_step(on_gpu):
    on_gpu(H100_CU129)
    module = _Lit(None)
    with pytest.raises(CaptureError) as ei:
        _fit(module, CudaGraphCallback(), plugins=[_te_precision(te_recipe("MXFP8BlockScaling"))])
    msg = str(ei.value)
    assert "Trainer(plugins=TransformerEnginePrecision(recipe=MXFP8BlockScaling())) asks for MXFP8" in msg, msg
    assert "H100 80GB HBM3 (compute capability 9.0) cannot run" in msg, msg
    assert ("Pass TransformerEnginePrecision(recipe=...) a recipe this GPU runs: DelayedScaling(), "
            "Float8CurrentScaling() or Float8BlockScaling()") in msg, msg
    assert module.global_step == 0


def test_a_precision_plugin_recipe_the_gpu_runs_passes(on_gpu):
    on_gpu(H100)
    trainer = types.SimpleNamespace(optimizers=[], precision_plugin=_te_precision(te_recipe("DelayedScaling")))
    assert fp8_refusal(trainer, _Lit(None)) is None
    trainer.precision_plugin = _te_precision(te_recipe("NVFP4BlockScaling"))
    assert "asks for NVFP4" in fp8_refusal(trainer, _Lit(None)).message
    trainer.precision_plugin = _te_precision(te_recipe("CustomRecipe"))  # the user's own quantizers: not judged
    assert fp8_refusal(trainer, _Lit(None)) is None


# -- 2. FP8 primary weights with an optimizer that keeps no FP32 masters ------------------------------------------------
@pytest.mark.parametrize("make_opt,name", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "AdamW"),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, capturable=False), "Adam"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "SGD"),
], ids=["AdamW", "Adam", "SGD"])
def test_a_torch_optimizer_on_fp8_weights_is_refused_on_any_machine(make_opt, name):
    module = _Lit("Float8Tensor", make_opt)
    with pytest.raises(CaptureError) as ei:
        _fit(module, CudaGraphCallback())
    msg = str(ei.value)
    assert f"configure_optimizers returns {name}, and parameter 'fc1_weight' is a TransformerEngine Float8Tensor" in msg
    assert f"torch's {name} updates each parameter in place with no FP32 master copy" in msg, msg
    assert "loses each update smaller than its spacing" in msg, msg
    assert "FusedAdam(master_weights=True)" in msg and "te.autocast quantize them" in msg, msg
    assert "nemo_cudagraph_plugin.fp8.MasterWeightAdamW (per-tensor FP8 weights" in msg, msg
    assert module.global_step == 0


def test_the_masterless_refusal_holds_with_on_capture_error_eager():
    with pytest.raises(CaptureError, match="with or without CUDA graphs"):
        _fit(_Lit("MXFP8Tensor"), CudaGraphCallback(on_capture_error="eager"))


def test_the_masterless_check_sees_duck_typed_float8_tensors_and_counts_the_others():
    m = torch.nn.Module()
    m.a, m.b = make_fp8_param("te2", fp8_name="a"), make_fp8_param("te1.8", fp8_name="b")
    found = formats.masterless_params(torch.optim.SGD(m.parameters(), lr=0.1), {id(m.a): "a", id(m.b): "b"})
    assert found is not None and found.params == [("a", "Float8Tensor"), ("b", "Float8Tensor")]


def test_frozen_fp8_weights_and_masters_only_optimizers_pass():
    frozen = te_named_param("Float8Tensor", requires_grad=False)  # never updated: a frozen FP8 base
    assert formats.masterless_params(torch.optim.AdamW([frozen, torch.nn.Parameter(torch.ones(2))])) is None
    master = torch.nn.Parameter(torch.ones(8, 4))  # the optimizer holds FP32 masters, not the FP8 weights
    assert formats.masterless_params(torch.optim.AdamW([master])) is None


def test_a_master_weight_optimizer_over_the_fp8_weights_passes():
    module = _Lit("Float8Tensor", _OwnMasterAdam)
    cb = CudaGraphCallback()
    with pytest.warns(UserWarning, match="no CUDA device"):
        trainer = _fit(module, cb, steps=3)
    assert trainer.global_step == 3 and cb.stats.eager_reasons == {"no CUDA device": 3}


# -- 3. TransformerEngine's FusedAdam ---------------------------------------------------------------------------------
def test_te_fused_adam_built_capturable_is_supported_as_it_is():
    ps = [torch.nn.Parameter(torch.ones(3))]
    opt = TEFusedAdam(ps, lr=1e-3, capturable=True)
    check_optimizer_supported(opt)
    lr = opt.param_groups[0]["lr"]
    prep = OptimizerPrep(opt, torch.device("cpu"), math="eager")  # optimizer_math's default
    prep.apply()
    assert opt.param_groups[0]["lr"] is lr and "capturable" not in opt.param_groups[0], "left as it is"
    assert prep.math_differs == "", "its own update is captured"
    prep.restore()
    assert opt.param_groups[0]["lr"] is lr


def test_te_fused_adam_built_without_capturable_is_refused_naming_the_argument():
    with pytest.raises(TypeError, match=r"FusedAdam was built with capturable=False.*FusedAdam\(\.\.\., capturable=True\)"):
        check_optimizer_supported(TEFusedAdam([torch.nn.Parameter(torch.ones(3))]))


def test_te_fused_adam_on_plain_weights_trains_past_the_refusals():
    cb = CudaGraphCallback()
    with pytest.warns(UserWarning, match="no CUDA device"):
        _fit(_Lit(None, lambda ps: TEFusedAdam(ps, capturable=True)), cb, steps=2)
    assert cb.stats.eager_reasons == {"no CUDA device": 2}
    with pytest.raises(CaptureError, match="FusedAdam was built with capturable=False"):
        _fit(_Lit(None, lambda ps: TEFusedAdam(ps)), CudaGraphCallback())


@pytest.mark.parametrize("capturable", [True, False])
def test_te_fused_adam_with_fp8_weights_is_refused_with_what_works(capturable):
    module = _Lit("Float8Tensor", lambda ps: TEFusedAdam(ps, capturable=capturable, master_weights=True))
    with pytest.raises(CaptureError) as ei:
        _fit(module, CudaGraphCallback())
    msg = str(ei.value)
    assert f"TransformerEngine's FusedAdam (capturable={capturable}), and parameter 'fc1_weight' is a Float8Tensor" in msg
    assert "FusedAdam does not support FP8 model weights with capturable=True" in msg, msg
    assert "Train this model without CUDA graphs" in msg and "on_capture_error='eager' to train" in msg, msg
    # eager training with FusedAdam(master_weights=True) is right: the eager fallback is allowed
    cb = CudaGraphCallback(on_capture_error="eager")
    with pytest.warns(UserWarning, match="training eagerly: configure_optimizers returns TransformerEngine's FusedAdam"):
        _fit(_Lit("Float8Tensor", lambda ps: TEFusedAdam(ps, capturable=capturable, master_weights=True)), cb, steps=2)
    assert cb.stats.eager_reasons == {"TE FusedAdam with FP8 weights": 2}


def test_te_fused_adam_without_master_weights_on_fp8_weights_is_refused_as_masterless():
    with pytest.raises(CaptureError) as ei:
        _fit(_Lit("MXFP8Tensor", lambda ps: TEFusedAdam(ps, capturable=True)), CudaGraphCallback(on_capture_error="eager"))
    assert "TransformerEngine's FusedAdam(master_weights=False) keeps no FP32 master copy" in str(ei.value)
