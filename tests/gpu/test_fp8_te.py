"""FP8 transpose refresh with real TransformerEngine (written against TE 2.20.2) on a Hopper GPU.

(1) stale-transpose reproduction in a graph, fixed by the refresh at the same address
    (``benchmarks/fp8_refresh.py``);
(2) 200-step recipe GPT of ``te.TransformerLayer`` with FP8 primary weights under the Lightning engine and an
    optimizer writing FP8 bytes in place: graphed + refresh matches eager TE within the stated tolerance,
    graphed without refresh visibly diverges (``benchmarks/fp8_lightning.py``, which also measures
    (3), the refresh's share of the graphed step time: a benchmark figure, not asserted here).

Skipped without CUDA (conftest), without an importable ``transformer_engine.pytorch``, or without FP8
support. Run with ``-s`` to see figures; set ``FP8_EVIDENCE_JSON=path`` to also write them as JSON::

    FP8_EVIDENCE_JSON=out/fp8_te.json python3 -m pytest tests/gpu/test_fp8_te.py -q -s -rs
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import torch  # noqa: E402

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # conftest marks these skipped; do not import TE on a CPU machine
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytest.importorskip(
    "transformer_engine.pytorch", reason="TransformerEngine is not installed (pip install '.[te]')"
)

from benchmarks import fp8_refresh as bench  # noqa: E402 - after the skip when TE is missing

_ok, _why = bench.fp8_available()
if not _ok:
    pytest.skip(f"FP8 not available: {_why}", allow_module_level=True)


_RESULTS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _evidence():
    """Collect the figures; with FP8_EVIDENCE_JSON=path also write them there (same format as the benchmark)."""
    yield
    if not _RESULTS:
        return
    out = {"env": bench.env_info(), **_RESULTS}
    print(bench._table(out))
    path = os.environ.get("FP8_EVIDENCE_JSON")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=1, default=str))
        print(f"\nwrote {path}")


def _show(title: str, payload: dict) -> None:
    print(f"\n{title}: {json.dumps(payload, default=str)}")


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_stale_transpose_in_graph_fixed_by_refresh(recipe):
    r = bench.stale_transpose_repro(recipe)
    _RESULTS.setdefault("repro", {})[recipe] = r
    _show(f"REPRO {recipe}", r)
    assert r["flag_clear_at_capture"], "precondition: the graph was captured with a valid transpose cache"
    assert r["stale_before_refresh"] == 1 and r["stale_after_refresh"] == 0 and r["refreshed"] == 1
    assert r["transpose_address_same"], "the refresh must write into the buffer the graph reads"
    assert r["rel_err_stale"] > bench.REPRO_STALE_MIN, "without the refresh the replay must be visibly wrong"
    assert r["rel_err_refreshed"] <= bench.REPRO_FRESH_MAX[recipe]
    # Sanity of the reference itself: eager TE matches a BF16 GEMM with the new weight to FP8 accuracy,
    # and the stale replay is what the *old* weight gives.
    assert r["rel_err_eager_vs_bf16_new_weight"] < 0.25  # FP8 (E5M2 grad x E4M3 weight) vs BF16
    if recipe == "current":
        # With delayed scaling the stale transpose was also quantized with the *old* scale while the graph
        # reads the new scale_inv, so it matches neither weight (measured on TE 2.20.2: 0.9998).
        assert r["rel_err_stale_vs_bf16_old_weight"] < 0.25


def test_lightning_training_refresh_matches_eager_and_no_refresh_diverges():
    """Result 2 through the product path (CudaGraphCallback / Fp8TransposeRefresh), 200 steps.

    The writer that matters is ``no-flags`` (bytes written without ``_reset_caches()``, as a distributed
    optimizer's parameter all-gather does): nothing tells TE the transposes are stale, so only the refresh
    keeps the backward correct, in graphs and out of them.
    """
    from benchmarks import fp8_lightning as lb
    out = lb.compare(steps=200)
    _RESULTS["compare"] = out
    print("\n" + lb.table({"compare": out}))
    arms = out["arms"]
    ref = arms["reference"]
    assert ref["finite"] and ref["loss_last"] < 0.7 * ref["loss_first"], "the task must be learnable (eager TE)"
    for name, arm in arms.items():
        if arm["graphed"]:
            assert arm["eager_reason"] is None, f"{name} trained eagerly: {arm['eager_reason']}"
            assert arm["replays"] >= 190, f"{name}: only {arm['replays']} replays"
    for name in ("graphed+refresh", "eager+refresh", "graphed+refresh/te-flags"):
        arm = arms[name]
        assert arm["loss_dev_max"] <= lb.PARITY_LOSS_DEV_MAX, (name, arm["loss_dev_max"])
        assert arm["param_dev"] <= lb.PARITY_PARAM_DEV_MAX, (name, arm["param_dev"])
        assert arm["stale_after"] == 0, (name, arm["stale_after"])
    bad = arms["graphed-no-refresh"]
    assert bad["stale_after"] == bad["fp8_params"], "without the refresh every FP8 transpose stays stale"
    if bad["finite"]:  # a NaN blow-up would be divergence too
        assert bad["param_dev"] >= lb.DIVERGED_PARAM_DEV_MIN, bad["param_dev"]
        assert bad["loss_dev_max"] > lb.PARITY_LOSS_DEV_MAX, bad["loss_dev_max"]


def test_one_launch_refresh_writes_the_bytes_te_writes():
    """The fused refresh (Triton, one launch) against TE's own _create_transpose(), on real Float8Tensors."""
    from nemo_cudagraph_plugin.fp8 import Fp8RefreshPlan, iter_fp8_params, verify_fp8_transposes
    from nemo_cudagraph_plugin.fp8._multi_transpose import triton_available

    if not triton_available():
        pytest.skip("Triton does not import here")
    te_mod, _, _ = bench.import_te()
    rec = bench.make_recipe("delayed")
    torch.manual_seed(11)
    with bench.quantized_init(rec):
        model = torch.nn.Sequential(
            te_mod.Linear(1024, 1024, bias=False, params_dtype=torch.bfloat16, device="cuda"),
            te_mod.Linear(96, 80, bias=False, params_dtype=torch.bfloat16, device="cuda"),
            te_mod.Linear(768, 3072, bias=False, params_dtype=torch.bfloat16, device="cuda"),
        )
    params = list(iter_fp8_params(model))
    assert len(params) == 3
    for p in params:  # new bytes, TE not told: every transpose stale
        bench.write_fp8_in_place(p, 0.05 * torch.randn(p.shape, device="cuda"), mark_stale=False)
    assert len(verify_fp8_transposes(model).stale) == 3
    ptrs = [p._transpose.data_ptr() for p in params]
    plan = Fp8RefreshPlan(model, fused=True)
    assert plan.refresh() == 3 and plan.last_fused == 3
    assert verify_fp8_transposes(model).ok
    fused = [p._transpose.clone() for p in params]
    for p in params:
        p._transpose.zero_()
    assert Fp8RefreshPlan(model, fused=False).refresh() == 3  # TE's _create_transpose() per tensor
    for p, f, ptr in zip(params, fused, ptrs):
        assert torch.equal(p._transpose.view(torch.uint8), f.view(torch.uint8))
        assert p._transpose.data_ptr() == ptr and not p._transpose_invalid


def test_te_fused_adam_writeback_is_fixed_by_refresh():
    r = bench.te_fused_adam_check()
    _RESULTS["te_fused_adam"] = r
    _show("TE FusedAdam(master_weights=True), delayed scaling", r)
    if "error" in r:
        pytest.skip(f"TE FusedAdam with FP8 parameters did not run here: {r['error']}")
    assert r["refreshed"] == 1 and r["stale_after_refresh"] == 0


def test_te_rng_tracker_registered_with_graph_advances_each_replay():
    import transformer_engine.pytorch as te

    from nemo_cudagraph_plugin.fp8 import register_rng_generators

    tracker = te.CudaRNGStatesTracker()
    tracker.add("fp8-test-rng", 1234)
    out = torch.empty(4096, device="cuda")
    with tracker.fork("fp8-test-rng"):  # warm-up outside the capture
        out.copy_(torch.rand(4096, device="cuda"))
    graph = torch.cuda.CUDAGraph()
    n = register_rng_generators(graph, tracker, include_te=False)
    assert n == 1
    with torch.cuda.graph(graph):
        with tracker.fork("fp8-test-rng"):
            out.copy_(torch.rand(4096, device="cuda"))
    graph.replay()
    first = out.clone()
    graph.replay()
    assert not torch.equal(first, out), "a registered tracker generator must advance on every replay"


def test_the_recipes_fp8_model_trains_graphed_with_master_weight_adamw_as_it_does_eagerly():
    """The recipe's ``--fp8`` path as a user runs it: FP8 primary weights, ``MasterWeightAdamW`` (decay groups, warm-up
    and cosine ``LambdaLR`` every step), graphed whole by ``CudaGraphCallback`` against the same fit without it."""
    import lightning.pytorch as pl

    from benchmarks import fp8_lightning as lb
    from nemo_cudagraph_plugin import CudaGraphCallback
    from nemo_cudagraph_plugin.fp8 import MasterWeightAdamW, verify_fp8_transposes
    from recipes.gpt import GPTDataModule, GPTLightningModule, get_config

    steps = 60

    class Losses(pl.Callback):
        def __init__(self):
            self.losses, self.lrs, self.stale, self.opt = [], [], -1, None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].detach().float())

        def on_train_end(self, trainer, pl_module):
            self.stale = len(verify_fp8_transposes(pl_module).stale)
            self.opt = trainer.optimizers[0]
            self.lrs = [float(g["lr"]) for g in self.opt.param_groups]

    def fit(graphed):
        pl.seed_everything(0, verbose=False)
        cfg = get_config("tiny")
        dm = GPTDataModule(seq_len=cfg.seq_len, batch_size=cfg.batch_size, train_samples=steps * cfg.batch_size,
                           seed=0)
        module = GPTLightningModule(cfg.replace(vocab_size=dm.vocab_size), fp8=True, fp8_recipe=lb.make_recipe(None),
                                    warmup_steps=10, max_steps=steps)
        rec = Losses()
        cbs = [CudaGraphCallback(), rec] if graphed else [rec]
        trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=steps, callbacks=cbs,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0)
        trainer.fit(module, datamodule=dm)
        return rec, (cbs[0].stats if graphed else None)

    eager, _ = fit(False)
    graphed, stats = fit(True)
    assert isinstance(graphed.opt, MasterWeightAdamW)
    assert not stats.eager_reasons and stats.replays >= steps - 10, stats.summary()
    e = torch.stack(eager.losses).cpu()
    g = torch.stack(graphed.losses).cpu()
    dev = float(((g - e).abs() / e.abs().clamp_min(lb.LOSS_FLOOR)).max())
    _RESULTS["recipe_master_weight_adamw"] = {"steps": steps, "replays": stats.replays, "loss_dev_max": dev,
                                              "loss_first": float(e[0]), "loss_last": float(e[-1]),
                                              "bitwise": bool(torch.equal(g, e))}
    assert torch.isfinite(e).all() and float(e[-1]) < float(e[0]), "the eager fit must train"
    assert dev <= lb.PARITY_LOSS_DEV_MAX, dev
    assert graphed.lrs == eager.lrs and graphed.stale == 0
