"""Hugging Face models in the captured step, on CPU with ``tests/_tape.py``'s stand-in for CUDA graphs.

HF's SDPA mask builder reads a 2-D ``attention_mask`` on the host; the callback switches such models to the same
SDPA attention with a mask builder that does not (``hf_attention="graph_safe"``), so right-padded batches are graphed
and train bit for bit as the user's unmodified eager model does. With ``hf_attention="as_is"`` the capture is
refused at HF's line, saying what to change.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from _tape import TapeBackend
from hf_models import HFCausalLM, TokenBatches, llama, mixtral
from torch.utils.data import DataLoader

from nemo_cudagraph_plugin import CaptureError, CudaGraphCallback
from nemo_cudagraph_plugin.hf import SDPA_GRAPH_SAFE, graph_safe_attention

STEPS = 10


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def fit(config, graphed: bool, cb_kw=None, callbacks=(), **module_kw):
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
        trainer.fit(module, DataLoader(TokenBatches(STEPS, pad=module_kw.get("padded", False)), batch_size=None))
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
        fit(llama(), graphed=True, cb_kw={"hf_attention": "as_is"}, padded=True)
    msg = str(err.value)
    assert "Inside: " in msg and "transformers/masking_utils.py:" in msg.replace("\\", "/")
    assert "pads anything" in msg and "hf_attention='graph_safe'" in msg
    assert err.value.location.endswith("hf_models.py:" + str(_line_of("loss = self.model(input_ids=")))


def _line_of(text: str) -> int:
    import hf_models

    with open(hf_models.__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def test_moe_routing_is_refused_before_the_first_graphed_step_naming_the_line_and_the_fix():
    with pytest.raises(CaptureError) as err:
        fit(mixtral(), graphed=True)
    msg = str(err.value)
    assert "Inside: " in msg and "modeling_mixtral.py:" in msg.replace("\\", "/")
    assert "depends on the data" in msg and "on_capture_error='eager'" in msg


def test_graph_safe_attention_switches_sdpa_models_once_and_leaves_others():
    module = HFCausalLM(llama())
    other = HFCausalLM(llama())
    other.model.set_attn_implementation("eager")
    assert graph_safe_attention(module) == ["model"]
    assert graph_safe_attention(module) == []
    assert module.model.model.config._attn_implementation == SDPA_GRAPH_SAFE
    assert graph_safe_attention(other) == []
    assert graph_safe_attention(torch.nn.Linear(2, 2)) == []
