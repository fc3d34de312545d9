"""Hugging Face models in the captured step, on CPU with ``tests/_tape.py``'s stand-in for CUDA graphs.

HF's SDPA mask builder reads a 2-D ``attention_mask`` on the host, and transformers 5 also reads the position ids it
made itself when there is no mask; the callback switches such models to the same SDPA attention with a mask builder
that does not (``hf_attention="graph_safe"``), so right-padded and unpadded batches are graphed and train bit for bit
as the user's unmodified eager model does. With ``hf_attention="as_is"`` the capture is refused at HF's line, saying
what to change. Mixture-of-experts models (transformers 5) are switched to grouped-GEMM experts with their offsets on
the device (``hf_experts="graph_safe"``) for the fit and given back after it; on transformers 4.x they are refused,
naming the version that graphs them. Runs under both versions (CI's unit and legacy-transformers stages).
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from _tape import TapeBackend
from hf_models import (
    HFCausalLM,
    TokenBatches,
    deepseek_v3,
    gpt2,
    llama,
    mixtral,
    qwen2_moe,
    qwen3_moe,
    transformers,
)
from torch.utils.data import DataLoader

from nemo_cudagraph_plugin import CaptureError, CudaGraphCallback
from nemo_cudagraph_plugin.hf import (
    EXPERTS_GRAPH_SAFE,
    SDPA_GRAPH_SAFE,
    graph_safe_attention,
    graph_safe_experts,
    restore_experts,
)

STEPS = 10
TF5 = int(transformers.__version__.split(".")[0]) >= 5
tf5_only = pytest.mark.skipif(not TF5, reason="transformers 5's experts interface and mask code")
tf4_only = pytest.mark.skipif(TF5, reason="transformers 4.x has no experts interface")
MOE = {"mixtral": mixtral, "qwen3-moe": qwen3_moe, "qwen2-moe": qwen2_moe, "deepseek-v3": deepseek_v3}


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def fit(config, graphed: bool, cb_kw=None, callbacks=(), skew=False, **module_kw):
    pl.seed_everything(0, verbose=False)
    module = HFCausalLM(config, **module_kw)
    rec = Losses()
    cbs: list = [rec, *callbacks]
    cb = None
    if graphed:
        cb = CudaGraphCallback(**(cb_kw or {}))
        cb.step_runner.backend = TapeBackend()
        cbs.insert(0, cb)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=cbs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(TokenBatches(STEPS, pad=module_kw.get("padded", False), skew=skew),
                                       batch_size=None))
    return module, rec.losses, cb


def test_right_padded_batches_are_graphed_and_train_as_the_unmodified_eager_model():
    eager_module, eager, _ = fit(llama(), graphed=False, padded=True)
    switched = []

    class SeeAttention(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            switched.append(pl_module.model.config._attn_implementation)

    module, graphed, cb = fit(llama(), graphed=True, padded=True, callbacks=[SeeAttention()])
    assert cb.stats.replays == STEPS - 4  # 3 warm-up steps and the capture
    assert switched == [SDPA_GRAPH_SAFE] * STEPS
    assert module.model.config._attn_implementation == "sdpa"  # given back after fit
    assert eager_module.model.config._attn_implementation == "sdpa"
    assert graphed == eager
    for a, b in zip(module.parameters(), eager_module.parameters()):
        assert torch.equal(a, b)


def test_hf_attention_as_is_refuses_at_hfs_line_and_says_what_to_change():
    with pytest.raises(CaptureError) as err:
        fit(llama(), graphed=True, cb_kw={"hf_attention": "as_is", "scope": "step"}, padded=True)
    msg = str(err.value)
    assert "Inside: " in msg and "transformers/masking_utils.py:" in msg.replace("\\", "/")
    assert "pads anything" in msg and "hf_attention='graph_safe'" in msg
    assert err.value.location.endswith("hf_models.py:" + str(_line_of("loss = self.model(input_ids=")))


def _line_of(text: str) -> int:
    import hf_models

    with open(hf_models.__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def test_unpadded_batches_without_a_mask_are_graphed_and_train_as_the_unmodified_eager_model():
    """transformers 5 asks the host whether the position ids it made pack sequences; the graph-safe attention hands it
    a mask of ones instead, which its mask function reads as no mask (SDPA's is_causal, as the unmodified model)."""
    eager_module, eager, _ = fit(llama(), graphed=False)
    module, graphed, cb = fit(llama(), graphed=True)
    assert cb.stats.replays == STEPS - 4 and not cb.stats.eager_steps, cb.stats.summary()
    assert graphed == eager
    for a, b in zip(module.parameters(), eager_module.parameters()):
        assert torch.equal(a, b)
    assert not module.model.model._forward_pre_hooks  # the pre-hook is given back after fit


class _SdpaCalls(torch.overrides.TorchFunctionMode):
    """Records (attn_mask is None, is_causal) of every scaled_dot_product_attention call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append((mask is None, bool(kwargs.get("is_causal", False))))
        return func(*args, **kwargs)


@tf5_only
def test_a_call_without_a_mask_keeps_sdpas_is_causal_as_the_unmodified_model():
    ids = torch.randint(0, 512, (2, 16))
    seen = {}
    for switched in (False, True):
        module = HFCausalLM(llama())
        if switched:
            graph_safe_attention(module)
        with _SdpaCalls() as sdpa:
            module.model(input_ids=ids, use_cache=False)
        seen[switched] = sdpa.calls
    assert seen[False] == [(True, True)] * 2  # 2 layers, no mask, is_causal
    assert seen[True] == seen[False]


@tf5_only
def test_a_compiled_model_that_dynamo_runs_eagerly_never_asks_about_packing(monkeypatch):
    """Past dynamo's recompile limit the model's code runs eagerly, where HF's own mask code reads the host; the
    graph-safe attention hands it the mask of ones there too."""
    from transformers import masking_utils

    asked = []
    real = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda pos: asked.append(1) or real(pos))
    ids = torch.randint(0, 512, (2, 16))
    with torch._dynamo.config.patch(cache_size_limit=1):
        for seed in (0, 1):  # the second model's forward exceeds the limit: run eagerly
            module = HFCausalLM(llama(), seed=seed)
            graph_safe_attention(module)
            torch.compile(module.model)(input_ids=ids, labels=ids, use_cache=False)
    torch._dynamo.reset()
    assert asked == []


class _SlicedBatches(torch.utils.data.Dataset):
    """Batches whose tensors are views (``block[:, :-1]`` of a longer token block), of two sequence lengths."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = []
        for i in range(n):
            block = torch.randint(0, 512, (2, (32 if i < n // 2 else 48) + 1), generator=g)
            self.items.append({"input_ids": block[:, :-1], "labels": block[:, :-1]})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


@pytest.mark.parametrize("config", [llama, gpt2])
def test_a_compiled_model_fed_views_compiles_outside_its_captures(config):
    """Batches that are views and change length: dynamo compiles the second length with dynamic shapes, guarding the
    views' bases; the capture reads its own buffers (no views). The eager steps before each capture read the batch in
    the buffers' layout, so nothing compiles inside a capture (on CUDA, Inductor's first run of new kernels inside a
    capture fails it)."""
    from _tape import CompiledCalls

    def run(graphed: bool, backend: CompiledCalls) -> tuple[list[float], CudaGraphCallback]:
        torch._dynamo.reset()
        pl.seed_everything(0, verbose=False)
        module = HFCausalLM(config(), compile_kw={"backend": backend})
        rec, cbs = Losses(), []
        if graphed:
            cbs.append(CudaGraphCallback())
            cbs[0].step_runner.backend = TapeBackend()
        else:
            module.prepare = graph_safe_attention
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=16, callbacks=[*cbs, rec], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(_SlicedBatches(16), batch_size=None))
        return rec.losses, (cbs[0] if cbs else None)

    eager_backend, backend = CompiledCalls(), CompiledCalls()
    eager, _ = run(False, eager_backend)
    graphed, cb = run(True, backend)
    torch._dynamo.reset()
    assert cb.stats.captures == 2 and cb.stats.replays > 0, cb.stats.summary()
    assert backend.in_capture == 0
    assert graphed == eager


@tf5_only
def test_position_ids_without_a_mask_are_refused_naming_hfs_packing_question():
    class WithPositions(HFCausalLM):
        def training_step(self, batch, batch_idx):
            pos = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=pos,
                              use_cache=False).loss

    pl.seed_everything(0, verbose=False)
    cb = CudaGraphCallback(scope="step")
    cb.step_runner.backend = TapeBackend()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[cb], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(CaptureError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(WithPositions(llama()), DataLoader(TokenBatches(STEPS), batch_size=None))
    msg = str(err.value)
    assert "position_ids pack several sequences" in msg and "masking_utils.py:" in msg.replace("\\", "/")


@tf5_only
@pytest.mark.parametrize("name", list(MOE))
def test_moe_models_train_graphed_with_the_experts_switched_for_the_fit_and_given_back(name):
    """Every step after the warm-up is a replay (no host read in routing, experts or the router's auxiliary loss);
    the experts run the graph-safe implementation during the fit and their own after it; the losses follow the same
    model trained eagerly with the same experts (the tape replays CPU kernels, whose rounding may differ by an ulp)."""
    seen = []

    class SeeExperts(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(pl_module.model.config._experts_implementation)

    config = MOE[name](output_router_logits=True)
    _, eager, _ = fit(config, graphed=False, skew=True)
    module, graphed, cb = fit(config, graphed=True, callbacks=[SeeExperts()], skew=True)
    assert cb.stats.replays == STEPS - 4 and cb.stats.captures == 1 and not cb.stats.eager_steps, cb.stats.summary()
    assert seen == [EXPERTS_GRAPH_SAFE] * STEPS
    assert module.model.config._experts_implementation == "grouped_mm"  # given back after fit
    assert torch.allclose(torch.tensor(graphed), torch.tensor(eager), rtol=1e-5, atol=0), (graphed, eager)


@tf5_only
def test_batches_that_route_very_differently_replay_one_graph():
    """Batches of 4 token ids (few experts get every token) alternate with uniform ones: the offsets live on the
    device, so one graph serves both and no step re-captures."""
    _, eager, _ = fit(mixtral(), graphed=False, prepare=graph_safe_experts, skew=True)
    _, graphed, cb = fit(mixtral(), graphed=True, skew=True)
    assert cb.stats.captures == 1 and cb.stats.replays == STEPS - 4, cb.stats.summary()
    assert torch.allclose(torch.tensor(graphed), torch.tensor(eager), rtol=1e-5, atol=0), (graphed, eager)


@tf5_only
def test_hf_experts_as_is_refuses_the_eager_experts_at_hfs_line_and_says_what_to_change():
    with pytest.raises(CaptureError) as err:
        fit(mixtral(), graphed=True, cb_kw={"hf_experts": "as_is", "scope": "step"}, experts="eager")
    msg = str(err.value)
    assert "Inside: " in msg and "modeling_mixtral.py:" in msg.replace("\\", "/")
    assert "depends on the data" in msg and "hf_experts='graph_safe'" in msg and "on_capture_error='eager'" in msg


@tf5_only
def test_by_default_eager_experts_train_with_partial_graphs_around_the_routing_as_eager_does():
    """The default ``scope="auto"``: the whole step of a Mixtral whose experts read the host (``"eager"`` experts with
    ``hf_experts="as_is"``) is not one graph; the partial tier graphs the modules that capture, the experts are the
    islands, each with HF's line, and training equals the eager run to the last bits: the islands sit inside the
    decoder layers' residual stream, where the gradient of the hidden states is the same numbers summed in another
    order (the graphed modules around an island add their parts first), so no bit-for-bit claim."""
    _, eager, _ = fit(mixtral(), graphed=False, experts="eager")
    _, graphed, cb = fit(mixtral(), graphed=True, cb_kw={"hf_experts": "as_is"}, experts="eager")
    rep = cb.stats.partial
    assert rep is not None and rep.replays > 0 and cb.stats.replays == 0, cb.stats.summary()
    assert sorted(rep.islands) == ["model.model.layers.0.mlp.experts", "model.model.layers.1.mlp.experts"]
    assert all("modeling_mixtral.py:" in why.replace("\\", "/") for why in rep.islands.values()), rep.islands
    assert graphed == pytest.approx(eager, rel=1e-6)


@tf5_only
def test_graph_safe_experts_switches_every_hf_implementation_and_restore_gives_each_back():
    for impl in ("eager", "grouped_mm", "batched_mm"):
        module = HFCausalLM(mixtral(), experts=impl)
        switched = graph_safe_experts(module)
        assert switched == [("model", impl)]
        assert graph_safe_experts(module) == []  # once
        assert module.model.model.config._experts_implementation == EXPERTS_GRAPH_SAFE
        restore_experts(module, switched)
        assert module.model.config._experts_implementation == impl
    assert graph_safe_experts(HFCausalLM(llama())) == []  # dense: nothing to switch
    assert graph_safe_experts(torch.nn.Linear(2, 2)) == []


@tf5_only
def test_graph_safe_experts_run_their_gemms_in_the_autocast_dtype_and_train_fp32_weights():
    """Under autocast the experts' GEMMs see BF16 weights (as autocast runs nn.Linear) and the gradients reach the
    FP32 weights in FP32; without autocast they run in the weights' dtype."""
    from nemo_cudagraph_plugin.hf import _CastExperts, _compute_dtype

    module = HFCausalLM(mixtral())
    graph_safe_experts(module)
    experts = next(m for m in module.modules() if type(m).__name__ == "MixtralExperts")
    h = torch.randn(8, 64)
    assert _compute_dtype(experts, h) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _compute_dtype(experts, h) == torch.bfloat16
        loss = module.model(input_ids=torch.randint(0, 512, (2, 16)), labels=torch.randint(0, 512, (2, 16))).loss
    assert _CastExperts(experts, torch.bfloat16).gate_up_proj.dtype == torch.bfloat16
    assert _CastExperts(experts, torch.bfloat16).act_fn is experts.act_fn
    loss.backward()
    assert experts.gate_up_proj.grad.dtype == torch.float32 and experts.gate_up_proj.grad.abs().sum() > 0


@tf4_only
def test_moe_routing_on_transformers_4_is_refused_naming_the_line_and_the_version_that_graphs_it():
    with pytest.raises(CaptureError) as err:
        fit(mixtral(), graphed=True, cb_kw={"scope": "step"})
    msg = str(err.value)
    assert "Inside: " in msg and "modeling_mixtral.py:" in msg.replace("\\", "/")
    assert "depends on the data" in msg and "transformers 5" in msg and "on_capture_error='eager'" in msg


@tf4_only
def test_by_default_moe_routing_on_transformers_4_trains_with_partial_graphs_as_eager_does():
    """The default ``scope="auto"``: transformers 4's Mixtral gathers each expert's tokens on the host; the partial
    tier graphs the modules around the routing, whose sparse MoE blocks are the islands, at HF's line."""
    _, eager, _ = fit(mixtral(), graphed=False)
    _, graphed, cb = fit(mixtral(), graphed=True)
    rep = cb.stats.partial
    assert rep is not None and rep.replays > 0 and cb.stats.replays == 0, cb.stats.summary()
    assert rep.islands and all("modeling_mixtral.py:" in why.replace("\\", "/") for why in rep.islands.values())
    assert graphed == eager


def test_graph_safe_attention_switches_sdpa_models_once_and_leaves_others():
    module = HFCausalLM(llama())
    other = HFCausalLM(llama())
    other.model.set_attn_implementation("eager")
    assert graph_safe_attention(module) == ["model"]
    assert graph_safe_attention(module) == []
    assert module.model.model.config._attn_implementation == SDPA_GRAPH_SAFE
    assert graph_safe_attention(other) == []
    assert graph_safe_attention(torch.nn.Linear(2, 2)) == []
