"""Partial graphs on CUDA: a step that cannot be one graph still trains with graphs of its submodules.

Two cases, each bitwise equal to its eager reference in one process, with the coverage in ``stats.partial``:

* an HF Llama whose decoder layer 1 is wrapped in a user's module that asks the host about the hidden states
  (``if x.abs().max() > 100``), ``scope="modules"``: the embedding, the other layers, the layer inside the check, the
  final norm, the rotary embedding and the head are graphs; the check is the island, at its line. Every parameter's
  gradient is added into ``.grad`` by its module's backward graph (no tied weight). The optimizer side (the user's
  own AdamW update) is one graph (the reference is the plain eager run with the graph-safe attention the callback
  switches to);
* the same model with a parameter of decoder layer 0 or 2 re-allocated mid-training (``w.data = w.data.clone()``):
  that layer is captured again, in a later step than the graphs around it, which replay between its forward and its
  backward and must not overwrite what it keeps; the optimizer side's graph must update the parameter where it now is;
* a loss function that calls ``.item()``, ``scope="auto"``: the whole step's sync check fails at that line, the partial
  tier takes over and graphs the whole model; the reference prepares the optimizer as the whole-step tier did;
* a learning rate the user's ``optimizer_step`` sets every step, ``scope="auto"``: the whole step is refused at that
  line (a replay would keep one value), the partial tier graphs the whole model and the update, which reads the value
  set just before it; the reference is the user's own eager run;
* a ``torch.compile``d model with the ``.item()`` loss, ``scope="auto"``: the compiled call is one graphed module
  (Inductor's kernels inside the graphs); the reference is the same compiled model trained eagerly;
* a ``torch.compile``d model with the host check inside: split open, its submodules compiled alone and graphed (the
  losses follow the user's compiled run to rounding); the check alone compiled by the user: split open, bitwise;
* transformers 4.57's Mixtral, ``scope="auto"``: its routing (a host read per expert) the islands, the rest graphs;
* two heads chosen on the host per batch (one, the other, or both): a head not called in a step gets no gradient
  and no update, as in the user's own eager run (``zero_grad(set_to_none=True)``), with the graphs replaying;
* a head applied once or, chosen on the host, twice in a step with the same input signature: the second call runs
  eagerly (a second replay would overwrite the activations the first call's backward reads).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _lightning_utils import CapturableEager
from hf_models import HFCausalLM, TokenBatches, llama
from torch import nn
from torch.utils.data import DataLoader

from nemo_cudagraph_plugin import CudaGraphCallback
from nemo_cudagraph_plugin.hf import graph_safe_attention

pytestmark = pytest.mark.gpu

STEPS = 12
SIZE = {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4}
BATCH, SEQ = 4, 128


class HostCheck(nn.Module):
    """A user's module around a decoder layer that asks the host about the hidden states."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, *args, **kwargs):
        if hidden_states.abs().max() > 100:  # HOST-READ
            hidden_states = hidden_states.clamp(-100, 100)
        return self.inner(hidden_states, *args, **kwargs)


def _guard_layer(model) -> None:
    model.model.layers[1] = HostCheck(model.model.layers[1])


def _guard_layer_graph_safe(model) -> None:  # the eager reference: the attention the callback switches to
    _guard_layer(model)
    graph_safe_attention(model)


SEEN: list[float] = []


def item_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
    SEEN.append(loss.item())  # LOSS-ITEM
    return loss


class ItemLossLM(HFCausalLM):
    def training_step(self, batch, batch_idx):
        loss = item_loss(self.model(input_ids=batch["input_ids"], use_cache=False).logits, batch["labels"])
        self.log("train_loss", loss)
        return loss


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().float().clone())


def _fit(module: pl.LightningModule, callbacks: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
    rec = _Losses()
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=STEPS, callbacks=[*callbacks, rec], logger=False,
                         precision="bf16-mixed", enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(TokenBatches(STEPS, batch=BATCH, seq=SEQ), batch_size=None))
    return torch.stack(rec.losses).cpu(), [p.detach().clone() for p in module.parameters()]


def _line(fn, text: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    return f"{inspect.getsourcefile(fn)}:{start + next(i for i, s in enumerate(lines) if text in s)}"


def test_llama_with_a_host_reading_module_trains_with_partial_graphs_bitwise():
    pl.seed_everything(0, verbose=False)
    eager_losses, eager_params = _fit(HFCausalLM(llama(**SIZE), prepare=_guard_layer_graph_safe), [])
    pl.seed_everything(0, verbose=False)
    cb = CudaGraphCallback(scope="modules")
    losses, params = _fit(HFCausalLM(llama(**SIZE), prepare=_guard_layer), [cb])
    rep = cb.stats.partial
    print(cb.stats.summary())
    assert rep.graphed == ["model.model.embed_tokens", "model.model.layers.0", "model.model.layers.1.inner",
                           "model.model.layers.2", "model.model.layers.3", "model.model.norm", "model.model.rotary_emb",
                           "model.lm_head"]
    assert list(rep.islands) == ["model.model.layers.1"]
    assert _line(HostCheck.forward, "HOST-READ") + ": a host synchronisation" in rep.islands["model.model.layers.1"]
    assert rep.replays >= (STEPS - 4) * len(rep.graphed) and rep.op_coverage is not None and rep.op_coverage > 0.5
    assert rep.optimizer.startswith("graphed") and rep.optimizer_replays >= STEPS - 5, rep.optimizer
    assert rep.grads_in_graphs == len(params) and not rep.grads_outside, rep.grads_outside
    assert torch.equal(losses, eager_losses), (losses - eager_losses).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


class _MoveWeight(pl.Callback):
    """Re-allocates a parameter of decoder layer ``layer`` before batch ``at`` (same values, new address): the tier
    drops that layer's graphs and captures it again, later than the graphs around it, which keep replaying."""

    def __init__(self, layer: int, at: int) -> None:
        self.layer, self.at = layer, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            layer = pl_module.model.model.layers[self.layer]
            w = getattr(layer, "inner", layer).mlp.down_proj.weight
            w.data = w.data.clone()


@pytest.mark.parametrize("layer", [0, 2])
def test_a_module_captured_again_later_than_its_neighbours_trains_bitwise(layer):
    # Graphs captured in different steps replay in another order than they were captured: memory an earlier graph
    # uses for its temporaries must not hold what a later capture keeps (the activations its backward reads).
    pl.seed_everything(0, verbose=False)
    eager_losses, eager_params = _fit(HFCausalLM(llama(**SIZE), prepare=_guard_layer_graph_safe),
                                      [_MoveWeight(layer, 6)])
    pl.seed_everything(0, verbose=False)
    cb = CudaGraphCallback(scope="modules")
    losses, params = _fit(HFCausalLM(llama(**SIZE), prepare=_guard_layer), [cb, _MoveWeight(layer, 6)])
    rep = cb.stats.partial
    print(cb.stats.summary())
    assert f"model.model.layers.{layer}" in rep.graphed and rep.replays > 0, rep
    assert torch.equal(losses, eager_losses), (losses - eager_losses).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


def test_loss_calling_item_scope_auto_graphs_the_whole_model_bitwise():
    SEEN.clear()
    pl.seed_everything(0, verbose=False)
    eager_losses, eager_params = _fit(ItemLossLM(llama(**SIZE), prepare=graph_safe_attention), [CapturableEager()])
    eager_seen = list(SEEN)
    SEEN.clear()
    pl.seed_everything(0, verbose=False)
    cb = CudaGraphCallback(scope="auto")
    losses, params = _fit(ItemLossLM(llama(**SIZE)), [cb])
    rep = cb.stats.partial
    print(cb.stats.summary())
    assert rep is not None and rep.graphed == ["model"] and rep.islands == {}
    assert cb.stats.eager_reasons.get("partial graphs", 0) > 0 and rep.replays >= STEPS - 5
    assert rep.modules_graphed == rep.modules_called
    assert SEEN == eager_seen  # the .item() outside the graphs runs every step
    assert torch.equal(losses, eager_losses), (losses - eager_losses).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


def test_verify_steps_compares_partial_steps_with_eager_steps_and_leaves_no_trace():
    # the tier's first graphed steps run once more eagerly, undone, then with the graphs, compared bitwise
    pl.seed_everything(0, verbose=False)
    eager_losses, eager_params = _fit(HFCausalLM(llama(**SIZE), prepare=_guard_layer_graph_safe), [])
    pl.seed_everything(0, verbose=False)
    cb = CudaGraphCallback(scope="modules", verify_steps=3)
    losses, params = _fit(HFCausalLM(llama(**SIZE), prepare=_guard_layer), [cb])
    assert cb.stats.verified_steps == 3 and cb.stats.partial.replays > 0, cb.stats.summary()
    assert torch.equal(losses, eager_losses), (losses - eager_losses).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


class LrInStepLM(HFCausalLM):
    """A schedule the user wrote into ``optimizer_step``: a new learning rate every step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        for g in optimizer.param_groups:
            g["lr"] = self.lr * (1 + self.trainer.global_step % 3)  # LR-IN-STEP
        optimizer.step(closure=optimizer_closure)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_an_lr_set_in_optimizer_step_scope_auto_trains_with_partial_graphs_bitwise(fused):
    pl.seed_everything(0, verbose=False)
    eager_losses, eager_params = _fit(LrInStepLM(llama(**SIZE), prepare=graph_safe_attention, fused=fused), [])
    pl.seed_everything(0, verbose=False)
    cb = CudaGraphCallback(scope="auto")
    losses, params = _fit(LrInStepLM(llama(**SIZE), fused=fused), [cb])
    rep = cb.stats.partial
    print(cb.stats.summary())
    assert cb.stats.eager_reasons.get("partial graphs", 0) > 0 and cb.stats.replays == 0, cb.stats.summary()
    assert rep is not None and rep.graphed == ["model"] and rep.islands == {}
    assert rep.optimizer.startswith("graphed") and rep.optimizer_replays >= STEPS - 8, rep.optimizer
    assert torch.equal(losses, eager_losses), (losses - eager_losses).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


def _compiled_graphs() -> int:
    """How many graphs dynamo compiled since the last call (its caches emptied: each fit compiles its own model)."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return graphs


def test_a_compiled_model_with_a_loss_calling_item_is_one_graphed_module_bitwise():
    SEEN.clear()
    _compiled_graphs()
    pl.seed_everything(0, verbose=False)
    eager_losses, eager_params = _fit(ItemLossLM(llama(**SIZE), prepare=graph_safe_attention, compile_kw={}),
                                      [CapturableEager()])
    eager_graphs = _compiled_graphs()
    SEEN.clear()
    pl.seed_everything(0, verbose=False)
    cb = CudaGraphCallback(scope="auto")
    module = ItemLossLM(llama(**SIZE), compile_kw={})
    losses, params = _fit(module, [cb])
    graphs = _compiled_graphs()
    rep = cb.stats.partial
    print(cb.stats.summary())
    assert rep is not None and rep.graphed == ["model"] and rep.islands == {}, rep
    assert rep.replays >= STEPS - 5 and rep.optimizer_replays >= STEPS - 5, rep
    assert "PartialGraphs" not in module.model.__dict__["forward"].__qualname__  # torch.compile's own, given back
    assert graphs == eager_graphs  # nothing compiled inside a capture, nothing run uncompiled
    assert torch.equal(losses, eager_losses), (losses - eager_losses).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


def test_a_compiled_model_reading_the_host_inside_is_split_open_and_its_submodules_graphed_compiled():
    """``torch.compile(model)`` with the host check inside: the compiled model is split open, then its decoder stack,
    then the check; every other submodule is compiled alone and graphed, the check's own code is the island. The
    warm-up steps ran the whole-model compile and the later ones the submodules' compiles: the losses follow the
    user's compiled run to rounding, not bit for bit (Inductor fuses across layers in one and not in the other)."""
    _compiled_graphs()
    pl.seed_everything(0, verbose=False)
    eager_losses, _ = _fit(HFCausalLM(llama(**SIZE), prepare=_guard_layer_graph_safe, compile_kw={}), [])
    _compiled_graphs()
    pl.seed_everything(0, verbose=False)
    cb = CudaGraphCallback(scope="modules")
    module = HFCausalLM(llama(**SIZE), prepare=_guard_layer, compile_kw={})
    losses, params = _fit(module, [cb])
    _compiled_graphs()
    rep = cb.stats.partial
    print(cb.stats.summary(), (losses - eager_losses).abs().max())
    # as without torch.compile (nothing compiled inside a capture: such a capture fails, and its module is no graph)
    assert rep.graphed == ["model.model.embed_tokens", "model.model.layers.0", "model.model.layers.1.inner",
                           "model.model.layers.2", "model.model.layers.3", "model.model.norm", "model.model.rotary_emb",
                           "model.lm_head"]
    assert list(rep.islands) == ["model.model.layers.1"]
    assert _line(HostCheck.forward, "HOST-READ") + ": a host synchronisation" in rep.islands["model.model.layers.1"]
    assert rep.compiled_apart == ["model", "model.model", "model.model.layers.1"]
    assert rep.replays > 0 and rep.optimizer_replays > 0, rep
    assert "PartialGraphs" not in module.model.__dict__["forward"].__qualname__  # torch.compile's own, given back
    assert not [n for n, m in module.model._orig_mod.named_modules() if "forward" in m.__dict__]
    assert (losses - eager_losses).abs().max() < 2e-2


def _compiled_check(model) -> None:
    """The user compiles the module that reads the host (the check around decoder layer 1), nothing else."""
    _guard_layer(model)
    model.model.layers[1] = torch.compile(model.model.layers[1])


def _compiled_check_graph_safe(model) -> None:
    _compiled_check(model)
    graph_safe_attention(model)


def test_a_compiled_module_reading_the_host_is_split_open_bitwise():
    """The user compiles the check around layer 1: dynamo compiles the layer inside it as the piece after the host
    read, and the tier, splitting the check open, compiles that layer alone: the same graph, so the same kernels.
    Trained bitwise as the user's compiled run, the layer inside the check graphed with Inductor's kernels."""
    _compiled_graphs()
    pl.seed_everything(0, verbose=False)
    eager_losses, eager_params = _fit(HFCausalLM(llama(**SIZE), prepare=_compiled_check_graph_safe), [])
    _compiled_graphs()
    pl.seed_everything(0, verbose=False)
    cb = CudaGraphCallback(scope="modules")
    losses, params = _fit(HFCausalLM(llama(**SIZE), prepare=_compiled_check), [cb])
    _compiled_graphs()
    rep = cb.stats.partial
    print(cb.stats.summary(), (losses - eager_losses).abs().max())
    assert "model.model.layers.1.inner" in rep.graphed and list(rep.islands) == ["model.model.layers.1"]
    assert rep.compiled_apart == ["model.model.layers.1"]
    assert torch.equal(losses, eager_losses), (losses - eager_losses).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


def test_mixtral_on_transformers_4_trains_with_partial_graphs_around_its_routing():
    """transformers 4.57's Mixtral routes tokens with a host read per expert (no experts interface to switch to a
    graph-safe one): the whole step is refused, ``scope="auto"`` trains it with partial graphs: each sparse-MoE block
    is an island at transformers' line, attention, norms, embedding, head and the update are graphs. The island sits
    inside the residual stream, so one gradient there is the same numbers summed in another order: losses follow the
    user's eager run to rounding, not bit for bit."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip("transformers 4.x's Mixtral (transformers 5 switches its experts to graph-safe ones)")
    from hf_models import mixtral

    size = {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "experts": 8}
    pl.seed_everything(0, verbose=False)
    eager_losses, eager_params = _fit(HFCausalLM(mixtral(**size), prepare=graph_safe_attention), [])
    pl.seed_everything(0, verbose=False)
    cb = CudaGraphCallback(scope="auto")
    module = HFCausalLM(mixtral(**size))
    losses, params = _fit(module, [cb])
    rep = cb.stats.partial
    print(cb.stats.summary(), (losses - eager_losses).abs().max())
    islands = [f"model.model.layers.{i}.block_sparse_moe" for i in range(4)]
    assert rep is not None and sorted(rep.islands) == islands, rep
    assert all("modeling_mixtral.py:" in rep.islands[k].replace("\\", "/") for k in islands)
    assert all(f"model.model.layers.{i}.self_attn" in rep.graphed for i in range(4)), rep.graphed
    assert rep.optimizer.startswith("graphed") and rep.replays > 0, rep
    assert (losses - eager_losses).abs().max() < 1e-3
    assert max((a.float() - b.float()).abs().max().item() for a, b in zip(params, eager_params)) < 1e-3


class TwoHeadsLM(HFCausalLM):
    """Two heads on the logits, chosen per batch on the host: one, the other, or both."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        v = self.model.config.vocab_size
        self.heads = nn.ModuleList([nn.Linear(v, v), nn.Linear(v, v)])

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        logits = self.model(input_ids=ids, use_cache=False).logits
        pick = int(ids[0, 0]) % 3  # HEADS-PICK
        for i, head in enumerate(self.heads):
            if pick in (i, 2):
                logits = logits + head(logits)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten())
        self.log("train_loss", loss)
        return loss


def _auto_against_the_users_run(cls: type) -> Any:
    """``cls`` trained by the user eagerly (with the attention the callback switches to) and with
    ``CudaGraphCallback(scope="auto")``: losses and every parameter bitwise equal; the partial tier's report."""
    pl.seed_everything(0, verbose=False)
    eager_losses, eager_params = _fit(cls(llama(**SIZE), prepare=graph_safe_attention), [])
    pl.seed_everything(0, verbose=False)
    cb = CudaGraphCallback(scope="auto")
    losses, params = _fit(cls(llama(**SIZE)), [cb])
    print(cb.stats.summary())
    assert torch.equal(losses, eager_losses), (losses - eager_losses).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))
    return cb.stats.partial


def test_a_head_not_called_in_a_step_gets_no_update_as_in_the_users_eager_run():
    rep = _auto_against_the_users_run(TwoHeadsLM)
    assert rep is not None and "model" in rep.graphed and rep.replays > 0, rep
    assert rep.optimizer_eager_untouched > 0 and rep.optimizer_recaptures == 0, rep


class ReusedHeadLM(HFCausalLM):
    """One head on the logits, applied a second time when the host says so (a layer reused a data-dependent number of
    times)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        v = self.model.config.vocab_size
        self.head = nn.Linear(v, v)

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        logits = self.head(self.model(input_ids=ids, use_cache=False).logits)
        if int(ids[0, 0]) % 2:  # HEAD-AGAIN
            logits = self.head(logits)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten())
        self.log("train_loss", loss)
        return loss


def test_a_module_called_twice_in_a_step_runs_its_second_call_eagerly_bitwise():
    rep = _auto_against_the_users_run(ReusedHeadLM)
    assert rep is not None and "head" in rep.graphed and rep.replays > 0, rep
    assert rep.eager_calls.get("called again in the step", 0) > 0, rep.eager_calls
