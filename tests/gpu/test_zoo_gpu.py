"""Model zoo on the GPU: Hugging Face models as users train them, graphed by ``CudaGraphCallback``.

Each case trains ``STEPS`` steps and is either bitwise equal to its eager reference with the same optimizer
preparation (``CapturableEager``: capturable AdamW, the learning rate a device tensor), or refused with a
``CaptureError`` / ``ValueError`` that names the cause and the fix — never an internal error, never a silent
difference. Next to each case the module records max |Δloss| against that reference and against the user's
unmodified optimizer, eager and graphed ms/step, and peak memory both ways; the table is printed at the end and
written to ``$NCG_ZOO_REPORT`` (markdown) when set.

Models are built from configs (``tests/hf_models.py``; nothing is downloaded): Llama (GQA, RoPE, SwiGLU), Qwen2
(tied embeddings, q/k/v bias), GPT-2 (dropout on), and on transformers 5 the mixture-of-experts models Mixtral,
Qwen3-MoE, Qwen2-MoE (shared expert) and DeepSeek-V3 (latent attention, group-limited routing), each with the router's
auxiliary loss in the step. A mixture-of-experts reference runs the experts the graphed run switches to
(``graph_safe_experts``); the difference from the user's own experts is the ``dloss_plain`` column. On transformers 4.x
Mixtral is refused, naming the version that graphs it.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _lightning_utils import CapturableEager
from hf_models import (
    HFCausalLM,
    TokenBatches,
    deepseek_v3,
    gpt2,
    llama,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen3_moe,
    transformers,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from nemo_cudagraph_plugin import CaptureError, CudaGraphCallback, CudaGraphStrategy
from nemo_cudagraph_plugin.hf import graph_safe_attention, graph_safe_experts

pytestmark = pytest.mark.gpu

STEPS = 48
TIMED = (24, 48)  # steps whose boundaries are timed (a sync at each of the two, outside the step)
SIZE = {"hidden": 256, "layers": 4, "heads": 8}
BATCH, SEQ = 4, 256


@dataclass
class Case:
    config: Callable[[], Any]
    module_kw: dict = field(default_factory=dict)
    trainer_kw: dict = field(default_factory=dict)
    pad: bool = False
    strategy: Optional[Callable[[], Any]] = None  # graphed run's strategy (instead of the callback)
    # torch.use_deterministic_algorithms for every run: inductor then falls back to deterministic kernels for its
    # atomic scatter-adds (the embedding's backward), without which two compiled eager runs already differ
    deterministic: bool = False
    # every other batch draws from 4 token ids (the router sends it to few experts) between uniform ones
    skew: bool = False
    cb_kw: dict = field(default_factory=dict)  # the graphed run's CudaGraphCallback options


def _ckpt(model: Any) -> None:
    model.gradient_checkpointing_enable()


CASES: dict[str, Case] = {
    "llama": Case(lambda: llama(kv_heads=4, **_size())),
    "qwen2": Case(lambda: qwen2(kv_heads=4, **_size())),
    "gpt2": Case(lambda: gpt2(**_size())),
    "llama-padded": Case(lambda: llama(kv_heads=4, **_size()), {"padded": True}, pad=True),
    "llama-grad-ckpt": Case(lambda: llama(kv_heads=4, **_size()), {"prepare": _ckpt}),
    "llama-bf16-true": Case(lambda: llama(kv_heads=4, **_size()), trainer_kw={"precision": "bf16-true"}),
    "llama-32-true": Case(lambda: llama(kv_heads=4, **_size()), trainer_kw={"precision": "32-true"}),
    "llama-compile": Case(lambda: llama(kv_heads=4, **_size()), {"compile_kw": {}}, deterministic=True),
    # autotuning every GEMM and fused kernel takes minutes at the common size: a smaller model, the same code paths
    "llama-compile-max-autotune-no-cudagraphs": Case(
        lambda: llama(hidden=128, layers=2, heads=4, kv_heads=2), {"compile_kw": {"mode": "max-autotune-no-cudagraphs"}},
        deterministic=True),
    "llama-schedule-clip": Case(lambda: llama(kv_heads=4, **_size()), {"schedule": True, "max_steps": STEPS,
                                                                       "fused": False},
                                trainer_kw={"gradient_clip_val": 1.0}),
    "llama-ddp-1-rank": Case(lambda: llama(kv_heads=4, **_size()), strategy=lambda: CudaGraphStrategy("ddp")),
}
TF5 = int(transformers.__version__.split(".")[0]) >= 5
MOE_SIZE = {"hidden": 256, "layers": 4, "heads": 8, "experts": 8, "output_router_logits": True}
if TF5:
    CASES.update({
        "mixtral": Case(lambda: mixtral(kv_heads=4, **MOE_SIZE), skew=True),
        "mixtral-bf16-true": Case(lambda: mixtral(kv_heads=4, **MOE_SIZE), trainer_kw={"precision": "bf16-true"}),
        "mixtral-32-true": Case(lambda: mixtral(kv_heads=4, **MOE_SIZE), trainer_kw={"precision": "32-true"}),
        "mixtral-compile": Case(lambda: mixtral(kv_heads=4, **MOE_SIZE), {"compile_kw": {}}, deterministic=True),
        "qwen3-moe": Case(lambda: qwen3_moe(kv_heads=4, **MOE_SIZE), skew=True),
        "qwen3-moe-compile": Case(lambda: qwen3_moe(kv_heads=4, **MOE_SIZE), {"compile_kw": {}}, deterministic=True),
        "qwen2-moe": Case(lambda: qwen2_moe(kv_heads=4, **MOE_SIZE)),
        "deepseek-v3": Case(lambda: deepseek_v3(**MOE_SIZE), skew=True),
        "deepseek-v3-compile": Case(lambda: deepseek_v3(**MOE_SIZE), {"compile_kw": {}}, deterministic=True),
    })
REFUSED: dict[str, tuple[Case, str]] = {} if TF5 else {
    "mixtral": (Case(lambda: mixtral(kv_heads=4, **_size()), cb_kw={"scope": "step"}),
                r"hf_models\.py:\d+: .*depends on the data.*\n  Inside: .*modeling_mixtral\.py:\d+.*\n  Fix: .*transformers 5"),
}
REFUSED.update({
    "llama-compile-reduce-overhead": (Case(lambda: llama(kv_heads=4, **_size()), {"compile_kw": {"mode": "reduce-overhead"}}),
                                      r"HFCausalLM\.model is compiled with torch\.compile's own CUDA graphs"),
    "fsdp-with-callback": (Case(lambda: llama(kv_heads=4, **_size()), trainer_kw={"strategy": "fsdp"}),
                           r"FSDP.*CudaGraphStrategy|CudaGraphStrategy.*FSDP|FSDP"),
})


def _size() -> dict:
    return {"hidden": SIZE["hidden"], "layers": SIZE["layers"], "heads": SIZE["heads"]}


ROWS: list[dict] = []


class _Timer(pl.Callback):
    """Losses of every step; wall time between the ends of steps ``TIMED[0]`` and ``TIMED[1]``."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.steps: list[int] = []
        self.t: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().float().clone())
        self.steps.append(trainer.global_step)
        if trainer.global_step in TIMED and trainer.global_step not in self.t:
            torch.cuda.synchronize()
            self.t[trainer.global_step] = time.perf_counter()

    def ms_per_step(self) -> float:
        a, b = TIMED
        return (self.t[b] - self.t[a]) * 1e3 / (b - a) if a in self.t and b in self.t else float("nan")


@dataclass
class Run:
    losses: torch.Tensor
    ms: float
    peak_gib: float
    stats: Any = None
    steps: list = field(default_factory=list)  # global_step after each loss


def _fit(case: Case, how: str, steps: int = STEPS, callbacks: tuple = (), ckpt_path: Optional[str] = None,
         batches: int = STEPS, **extra_trainer_kw: Any) -> Run:
    """``how``: ``graphed`` (the callback, or ``case.strategy``), ``reference`` (eager, optimizer prepared as under
    graphs) or ``plain`` (the user's unmodified eager run)."""
    # Each run compiles afresh: dynamo's caches are per code object across model instances, and a run past its
    # recompile limit executes some frames uncompiled, so two runs of one case would compare different kernels.
    torch.compiler.reset()
    pl.seed_everything(0, verbose=False)
    module_kw = dict(case.module_kw)
    if how == "reference":  # the attention and experts the graphed run switches to (no-ops where there are none)
        module_kw["prepare"] = _then(module_kw.get("prepare"), _graph_safe)
    module = HFCausalLM(case.config(), **module_kw)
    timer = _Timer()
    cbs: list = [*callbacks, timer]
    trainer_kw = {**case.trainer_kw, **extra_trainer_kw}
    graph_cb = None
    if how == "graphed":
        if case.strategy is not None:
            trainer_kw["strategy"] = case.strategy()
        else:
            graph_cb = CudaGraphCallback(**case.cb_kw)
            cbs.insert(0, graph_cb)
    else:
        if how == "reference":
            cbs.insert(0, CapturableEager())
        if case.strategy is not None:  # the same strategy, eager
            from lightning.pytorch.strategies import DDPStrategy

            trainer_kw["strategy"] = DDPStrategy()
    trainer_kw.setdefault("precision", "bf16-mixed")
    trainer_kw.setdefault("enable_checkpointing", False)
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=steps, callbacks=cbs, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **trainer_kw)
    data = DataLoader(TokenBatches(batches, batch=BATCH, seq=SEQ, pad=case.pad, skew=case.skew), batch_size=None)
    val = DataLoader(TokenBatches(2, batch=BATCH, seq=SEQ, seed=1), batch_size=None) if "val_check_interval" in trainer_kw else None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.use_deterministic_algorithms(case.deterministic, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, train_dataloaders=data, val_dataloaders=val, ckpt_path=ckpt_path)
    finally:
        torch.use_deterministic_algorithms(False)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    stats = graph_cb.stats if graph_cb is not None else getattr(trainer.strategy, "stats", None)
    return Run(torch.stack(timer.losses).cpu(), timer.ms_per_step(), torch.cuda.max_memory_allocated() / 2**30, stats,
               timer.steps)


def _graph_safe(model: Any) -> None:
    graph_safe_attention(model)
    graph_safe_experts(model)


def _then(first: Optional[Callable[[Any], Any]], second: Callable[[Any], Any]) -> Callable[[Any], None]:
    def both(model: Any) -> None:
        if first is not None:
            first(model)
        second(model)

    return both


def _row(name: str, g: Optional[Run], ref: Optional[Run], plain: Optional[Run], outcome: str) -> None:
    def d(a: Optional[Run], b: Optional[Run]) -> str:
        return f"{float((a.losses - b.losses).abs().max()):.2e}" if a is not None and b is not None else "-"

    ROWS.append({
        "case": name, "outcome": outcome, "dloss_ref": d(g, ref), "dloss_plain": d(g, plain),
        "eager_ms": f"{plain.ms:.2f}" if plain else "-", "graphed_ms": f"{g.ms:.2f}" if g else "-",
        "eager_peak_gib": f"{plain.peak_gib:.3f}" if plain else "-", "graphed_peak_gib": f"{g.peak_gib:.3f}" if g else "-",
        "stats_peak_over_eager": (f"{g.stats.peak_over_eager:.3f}" if g and g.stats and g.stats.peak_over_eager else "-"),
    })


@pytest.mark.parametrize("name", list(CASES))
def test_zoo_case_trains_bitwise_as_its_eager_reference(name):
    case = CASES[name]
    ref = _fit(case, "reference")
    plain = _fit(case, "plain")
    g = _fit(case, "graphed")
    want = ref
    same = torch.equal(g.losses, want.losses)
    _row(name, g, ref, plain, "bitwise" if same else "DIFFERS")
    # every step after the eager warm-up (3; 12 under DDP) and the capture is a replay
    assert g.stats.replays == STEPS - g.stats.warmup_steps - g.stats.captures and not g.stats.eager_steps, \
        g.stats.summary()
    assert same, f"max |dloss| {float((g.losses - want.losses).abs().max()):.3e}"


@pytest.mark.parametrize("name", list(REFUSED))
def test_zoo_case_is_refused_naming_the_cause_and_the_fix(name):
    case, pattern = REFUSED[name]
    with pytest.raises((CaptureError, ValueError)) as err:
        _fit(case, "graphed")
    _row(name, None, None, None, f"refused: {str(err.value).splitlines()[0][:90]}")
    assert isinstance(err.value, (CaptureError, ValueError)) and not isinstance(err.value, (KeyError, TypeError))
    import re

    assert re.search(pattern, str(err.value)), str(err.value)


def test_zoo_validation_checkpoints_and_resume_from_a_mid_run_checkpoint(tmp_path):
    """Epochs of 16 steps, validation every 8 steps, a checkpoint at the end of every epoch (every 16 steps); a run
    resumed from the step-16 checkpoint trains steps 17-48 as the uninterrupted graphed run did, and that run trains
    as its eager reference."""
    case = CASES["llama"]
    kw = {"val_check_interval": 8, "enable_checkpointing": True, "max_epochs": 3, "batches": 16}

    def ckpt(d: str) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=str(tmp_path / d), every_n_epochs=1, save_on_train_epoch_end=True,
                               save_top_k=-1, filename="{step}")

    ref = _fit(case, "reference", callbacks=(ckpt("ref"),), **kw)
    g = _fit(case, "graphed", callbacks=(ckpt("g"),), **kw)
    mid = tmp_path / "g" / "step=16.ckpt"
    assert mid.exists(), sorted(p.name for p in (tmp_path / "g").iterdir())
    resumed = _fit(case, "graphed", callbacks=(ckpt("r"),), ckpt_path=str(mid), **kw)
    # the uninterrupted run's loss at each global step the resumed run trained
    at = dict(zip(g.steps, g.losses.tolist()))
    uninterrupted = torch.tensor([at[s] for s in resumed.steps])
    same = torch.equal(g.losses, ref.losses) and torch.equal(resumed.losses, uninterrupted)
    _row("llama-val-ckpt-resume", g, ref, None, "bitwise (resumed too)" if same else "DIFFERS")
    assert resumed.steps[0] == 17 and len(resumed.steps) >= 16 and resumed.stats.replays >= 12, \
        (resumed.steps, resumed.stats.summary())
    assert torch.equal(g.losses, ref.losses), float((g.losses - ref.losses).abs().max())
    assert torch.equal(resumed.losses, uninterrupted), float((resumed.losses - uninterrupted).abs().max())


class _SlicedOnDevice(HFCausalLM):
    """Its batches reach the step as views: a token block moved to the GPU and sliced there (``block[:, :-1]``)."""

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        block = batch["input_ids"].to(device)
        return {"input_ids": block[:, :-1], "labels": block[:, :-1]}


def test_a_compiled_model_fed_views_of_two_lengths_captures_each_outside_dynamo():
    """Views of two lengths: dynamo compiles the second with dynamic shapes and guards the views' bases; each capture
    reads its own buffers, which are no views. The eager step before each capture reads the batch in the buffers'
    layout, so no capture compiles (it would fail, and the step train eagerly): two graphs, bitwise as eager."""
    def run(graphed: bool) -> tuple[torch.Tensor, Any]:
        torch.compiler.reset()
        pl.seed_everything(0, verbose=False)
        module = _SlicedOnDevice(llama(kv_heads=4, **_size()), compile_kw={},
                                 prepare=None if graphed else graph_safe_attention)
        timer, cbs = _Timer(), []
        if graphed:
            cbs.append(CudaGraphCallback(on_capture_error="raise"))
        else:
            cbs.append(CapturableEager())
        data = [TokenBatches(1, batch=BATCH, seq=(SEQ if i < 12 else SEQ // 2) + 1, seed=i)[0] for i in range(24)]
        trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=24, callbacks=[*cbs, timer], logger=False,
                             precision="bf16-mixed", enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(data, batch_size=None))
        return torch.stack(timer.losses).cpu(), (cbs[0].stats if graphed else None)

    ref, _ = run(False)
    losses, stats = run(True)
    torch.compiler.reset()
    print(stats.summary(), float((losses - ref).abs().max()))
    assert stats.captures == 2 and stats.replays >= 16, stats.summary()
    assert torch.equal(losses, ref), float((losses - ref).abs().max())


def teardown_module(module: Any) -> None:
    if not ROWS:
        return
    head = list(ROWS[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[k]) for k in head) + " |" for r in ROWS]
    table = "\n".join(lines)
    print("\n" + table)
    out = os.environ.get("NCG_ZOO_REPORT")
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")
