"""The Lightning adapter on CPU with a real ``Trainer``: the real callback, runner and capture engine, with
``tests/_tape.py``'s stand-in for CUDA graphs (a tape of aten ops replayed on the memory it recorded).

Each graphed run is compared with plain eager Lightning on the same seed and data, bit for bit: per-step
losses, the logged ``train_loss``, ``global_step``, final parameters and Lightning's progress counters.
Learning rates are powers of two, so the engine's float32 learning-rate tensor holds exactly the float
eager Lightning uses. The module's AdamW is ``fused=True``: torch's CPU AdamW accepts the
``capturable=True`` the engine sets only on its fused kernel.

Also here: the refusals and option plumbing that need no graph, and the hazards of stale graphs (values baked
into a graph, re-allocated state, ``verify_steps``, the NaN guard inside the sync-checked warm-up).
"""

from __future__ import annotations

import inspect
import math
import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
from _tape import TapeBackend
from lightning.pytorch.callbacks import BaseFinetuning, GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

from nemo_cudagraph_plugin import (
    CaptureConfig,
    CaptureError,
    CudaGraphCallback,
    CudaGraphStrategy,
    NonFiniteError,
)
from nemo_cudagraph_plugin.core import ParityError, StepAdapter
from nemo_cudagraph_plugin.lightning import _compat, checks
from recipes.gpt import GPTLightningModule, get_config

# The nemo CI stage runs these again on Lightning 2.4.0 (NeMo 2.7.3's pin), the oldest the adapter supports.
pytestmark = pytest.mark.lightning_adapter

CFG = get_config("tiny", n_layer=1, n_embd=64, n_head=2, seq_len=32)
LR = 2.0**-10  # exact in float32 (see the module docstring)


class TinyGPT(GPTLightningModule):
    """recipes.gpt's module with a fused AdamW, an optional step-interval LR scheduler and hazards to switch on."""

    def __init__(self, sched=None, late_param=False, extra_for_long=0, poison_param=None, python_logs=False,
                 baked_counter=False, lr_in_optimizer_step=False, dropout=0.0, trainable_only=False, poison_inf=False,
                 compile_kw=None, foreach_adam=False, sgd=False):
        super().__init__(CFG.replace(dropout=dropout), lr=LR)
        self.sched = sched
        # a parameter that first gets a gradient at batch 2 (the last warm-up step), and one that never gets one:
        # the set of gradients is then new, and not all of them, at that step
        self.late = nn.Parameter(torch.zeros(())) if late_param else None
        self.never = nn.Parameter(torch.zeros(())) if late_param else None
        # a block used only for sequences longer than this: its first gradient comes with the first long batch
        self.extra = nn.Linear(CFG.n_embd, CFG.vocab_size) if extra_for_long else None
        self.extra_for_long = extra_for_long
        self.poison_param = poison_param
        self.poison_inf = poison_inf  # the poisoned batch makes that gradient +Inf instead of NaN
        self.python_logs = python_logs
        self.baked_counter = baked_counter
        self.lr_in_optimizer_step = lr_in_optimizer_step
        self.trainable_only = trainable_only  # the optimizer gets the parameters that require a gradient only
        self.calls = 0
        self.compile_kw = compile_kw  # torch.compile's keywords for the GPT body, applied in configure_model
        self.foreach_adam = foreach_adam  # torch's multi-tensor capturable AdamW instead of the fused one
        self.sgd = sgd  # SGD with momentum instead of AdamW

    def configure_model(self):
        if self.compile_kw is not None and not hasattr(self.model, "_orig_mod"):
            self.model = torch.compile(self.model, **self.compile_kw)

    def on_fit_start(self):
        if self.poison_param is not None:
            # the gradient of this parameter times the batch's `poison` (1.0, or NaN in one batch): the loss
            # of that step stays finite, only the gradient check can see it
            dict(self.named_parameters())[self.poison_param].register_hook(lambda g: g * self._poison)

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        if self.extra is not None and ids.shape[1] > self.extra_for_long:
            h = self.model.ln_f(self.model.blocks[0](self.model.emb(ids)))
            logits = self.model.head(h) + self.extra(h)
        else:
            logits = self(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        if self.late is not None and batch_idx >= 2:
            loss = loss * (1 + self.late)
        if self.poison_param is not None:
            self._poison = batch["poison"].prod()
            if self.poison_inf:
                self._poison = torch.where(self._poison.isnan(), math.inf, 1.0)
        if self.baked_counter:
            self.calls += 1
            loss = loss + self.calls  # a Python value inside the step: the loss differs, the gradients do not
        self.log("train_loss", loss)
        self.log("loss_epoch_mean", loss, on_step=False, on_epoch=True)
        if self.python_logs:
            self.log("const", 1.5)
            self.log("batch_idx_py", float(batch_idx))
        return loss

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if self.lr_in_optimizer_step:
            step = self.trainer.global_step
            # True: a warm-up to LR over 4 steps; "cycle": a new value every step (1x, 2x, 3x LR)
            scale = 1 + step % 3 if self.lr_in_optimizer_step == "cycle" else min(1.0, (step + 1) / 4)
            for pg in optimizer.param_groups:
                pg["lr"] = LR * scale  # LR-IN-STEP
        optimizer.step(closure=optimizer_closure)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad or not self.trainable_only]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        kernel = {"foreach": True, "capturable": True} if self.foreach_adam else {"fused": True}
        make = (lambda groups, **kw: torch.optim.SGD(groups, lr=LR, momentum=0.9)) if self.sgd else torch.optim.AdamW
        opt = make([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=LR, betas=(0.9, 0.95), **kernel)
        if self.sched is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.sched(opt), "interval": "step"}}


class Windows(Dataset):
    """Token windows; ``lengths`` cycles per batch of 2; ``poison_at``: the batch whose `poison` is NaN."""

    def __init__(self, n_batches, lengths=(32,), poison_at=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(2 * n_batches):
            t = lengths[(i // 2) % len(lengths)]
            x = torch.randint(0, CFG.vocab_size, (t + 1,), generator=g)
            item = {"input_ids": x[:-1], "labels": x[1:]}
            if poison_at is not None:
                item["poison"] = torch.tensor(float("nan") if i // 2 == poison_at else 1.0)
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Rec(pl.Callback):
    """Per step: the loss, the kept loss tensor, the logged train_loss (value and object), global_step, the lr."""

    def __init__(self):
        self.losses, self.kept, self.logged, self.logged_t, self.steps, self.lrs, self.val = [], [], [], [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.kept.append(outputs["loss"])
        self.losses.append(float(outputs["loss"]))
        m = trainer.callback_metrics["train_loss"]
        self.logged_t.append(m)
        self.logged.append(float(m))
        self.steps.append(trainer.global_step)

    def on_validation_end(self, trainer, pl_module):
        if "val_loss" in trainer.callback_metrics:
            self.val.append(float(trainer.callback_metrics["val_loss"]))


class Run:
    def __init__(self, trainer, rec, cb, module):
        self.trainer, self.rec, self.cb, self.module = trainer, rec, cb, module
        self.params = [p.detach().clone() for p in module.parameters()]
        loop = trainer.fit_loop.epoch_loop
        self.progress = (loop.automatic_optimization.optim_progress.state_dict(), loop.batch_progress.state_dict())
        self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}

    @property
    def stats(self):
        return self.cb.stats


def fit(graphed=True, module_kw=None, cb_kw=None, callbacks=(), steps=12, n_batches=None, lengths=(32,),
        poison_at=None, val_batches=0, tape_kw=None, **trainer_kw):
    pl.seed_everything(0, verbose=False)
    module = TinyGPT(**(module_kw or {}))
    cbs = list(callbacks)
    cb = None
    if graphed:
        cb = CudaGraphCallback(**(cb_kw or {}))
        cb.step_runner.backend = TapeBackend(**(tape_kw or {}))
        cbs.insert(0, cb)
    rec = Rec()
    # max_epochs: the data is one epoch of `steps`; a break that stops global_step must end the fit, not hang it
    trainer_kw.setdefault("max_epochs", 2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[*cbs, rec], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, **trainer_kw)
    acc = trainer_kw.get("accumulate_grad_batches", 1)
    train = DataLoader(Windows(n_batches or steps * acc, lengths, poison_at), batch_size=2)
    val = DataLoader(Windows(val_batches, seed=1), batch_size=2) if val_batches else None
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    return Run(trainer, rec, cb, module)


def _frozen(v):
    if isinstance(v, dict):
        return tuple(sorted((k, _frozen(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    return v


_EAGER: dict = {}


def eager(**kw):
    """Plain Lightning with the same module, data, callbacks and trainer settings (cached per settings)."""
    key = _frozen(kw)
    if key not in _EAGER:
        _EAGER[key] = fit(graphed=False, **kw)
    return _EAGER[key]


def assert_same(g, e, params=True):
    assert g.rec.losses == e.rec.losses, "per-step losses differ"
    assert g.rec.logged == e.rec.logged, "logged train_loss differs"
    assert g.rec.steps == e.rec.steps, "global_step per step differs"
    if params:
        bad = [i for i, (a, b) in enumerate(zip(g.params, e.params)) if not torch.equal(a, b)]
        assert not bad, f"parameters {bad} differ from eager"


def graphed_and_eager(cb_kw=None, **kw):
    """The graphed fit and the eager one (``callbacks`` go to both)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fit(cb_kw=cb_kw, **kw), eager(**kw)


# ----------------------------------------------------------------------------------------------------------
# graphed == eager
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("acc,steps", [(1, 12), (2, 8), (3, 6)])
def test_graphed_fit_equals_eager_lightning_bitwise(acc, steps):
    g, e = graphed_and_eager(steps=steps, accumulate_grad_batches=acc)
    phases = 1 if acc == 1 else 3 if acc >= 3 else 2
    assert g.stats.captures == phases and g.stats.replays >= steps * acc - 3 - 2 * phases, g.stats.summary()
    assert_same(g, e)
    assert g.progress == e.progress, "Lightning's progress counters differ"
    assert g.metrics["loss_epoch_mean"] == e.metrics["loss_epoch_mean"], "on_epoch reduction saw other values"
    # a loss (and a logged value) kept by the user is this step's, not overwritten by later replays
    assert [float(t) for t in g.rec.kept] == g.rec.losses
    assert [float(t) for t in g.rec.logged_t] == g.rec.logged


@pytest.mark.parametrize("compile_kw", [{"mode": "reduce-overhead"}, {"mode": "max-autotune"},
                                        {"options": {"triton.cudagraphs": True}}])
def test_torch_compile_with_its_own_cuda_graphs_is_refused_before_the_first_step(compile_kw):
    with pytest.raises(CaptureError, match=r"TinyGPT\.model is compiled with torch\.compile's own CUDA graphs .*"
                                           r"mode='max-autotune-no-cudagraphs'"):
        fit(module_kw={"compile_kw": compile_kw}, steps=4)
    if "mode" not in compile_kw or compile_kw["mode"] != "reduce-overhead":
        return  # the eager fallback compiles with inductor (a C++ build on CPU): once is enough
    # on_capture_error='eager': trained eagerly, with torch.compile's graphs, from the first step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = fit(module_kw={"compile_kw": compile_kw}, cb_kw={"on_capture_error": "eager"}, steps=4)
    assert run.stats.replays == 0 and run.stats.eager_reasons == {"torch.compile with CUDA graphs": 4}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compiled_submodule_is_graphed_and_equals_eager(backend):
    """``self.model = torch.compile(self.model)`` in ``configure_model``: the compiled body runs inside the
    captured step (its ``OptimizedModule`` wrapper has no plain value of its own to watch) and trains as eager."""
    g, e = graphed_and_eager(module_kw={"compile_kw": {"backend": backend}}, steps=8)
    assert g.stats.replays == 4  # 3 warm-up steps, the capture, 4 replays
    assert_same(g, e)



# the module's fused AdamW: its own update with its float lr set in the graph ("eager"), or the lr as a device tensor
@pytest.mark.parametrize("math_", ["eager", "capturable"])
def test_lr_scheduler_changes_the_lr_every_replayed_step_reads(math_):
    kw = dict(module_kw={"sched": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)})
    g, e = graphed_and_eager(steps=12, cb_kw={"optimizer_math": math_}, **kw)
    assert g.stats.replays == 8
    assert len(set(g.rec.lrs[4:])) >= 4, f"the learning rate did not change during replays: {g.rec.lrs}"
    assert g.rec.lrs == e.rec.lrs
    assert_same(g, e)


@pytest.mark.parametrize("algo,val", [("norm", 0.05), ("value", 0.002)])
def test_gradient_clipping(algo, val):
    g, e = graphed_and_eager(steps=10, gradient_clip_val=val, gradient_clip_algorithm=algo)
    assert g.stats.replays == 6
    assert_same(g, e)
    unclipped = eager(steps=10)
    assert unclipped.rec.losses != e.rec.losses, "the clip value does not clip: this test would prove nothing"


@pytest.mark.parametrize("policy", ["evict", "eager"])
def test_variable_shapes_and_graph_cache_limit(policy):
    lengths = (32, 32, 24, 24, 16, 16)  # three signatures, two graphs: every signature change evicts (LRU)
    g, e = graphed_and_eager(cb_kw={"max_graphs": 2, "on_cache_full": policy}, steps=18, lengths=lengths)
    s = g.stats
    assert s.graphs == 2 and s.replays > 0
    if policy == "evict":
        assert s.captures > 3 and "graph cache full" not in s.eager_reasons
    else:
        assert s.captures == 2 and s.eager_reasons.get("graph cache full", 0) >= 3
    assert_same(g, e)


@pytest.mark.parametrize("acc", [1, 2])
def test_validation_in_between_keeps_graphs_and_results(acc):
    # Lightning sets every .grad to None around validation; graphs that accumulate into the gradients get them
    # back (no re-capture), graphs that own them do not need them.
    g, e = graphed_and_eager(steps=8, val_batches=2, val_check_interval=4 * acc, accumulate_grad_batches=acc)
    assert g.stats.captures == acc and g.stats.recaptures == 0 and g.stats.replays >= 4, g.stats.summary()
    assert len(g.rec.val) == 2 and g.rec.val == e.rec.val
    assert_same(g, e)


def test_dropout_masks_differ_per_replay_and_equal_eager():
    kw = dict(module_kw={"dropout": 0.1}, steps=10)
    g, e = graphed_and_eager(**kw)
    v, _ = graphed_and_eager(cb_kw={"verify_steps": 2}, **kw)
    assert g.stats.replays == 6 and v.stats.verified_steps == 2
    assert_same(g, e)  # each replay draws the masks the eager step draws
    assert_same(v, e)  # verification puts the generator back before the graph's step
    nodrop = eager(steps=10)
    assert all(a != b for a, b in zip(g.rec.losses[4:], nodrop.rec.losses[4:])), "dropout had no effect"


def test_verify_steps_pass_and_leave_training_as_eager():
    g, e = graphed_and_eager(cb_kw={"verify_steps": 3}, steps=12)
    assert g.stats.verified_steps == 3 and g.stats.replays == 8
    assert_same(g, e)
    assert g.progress == e.progress


def test_epoch_means_of_replayed_logs_equal_eager_in_every_epoch():
    """``self.log(..., on_epoch=True)`` re-emitted after replays: each epoch's mean is eager's, so the metric is reset
    at every epoch start as Lightning's own ``self.log`` resets it (the fast path must not carry a sum over)."""
    means = {}

    class EpochMeans(pl.Callback):
        def __init__(self):
            self.seen = []

        def on_train_epoch_end(self, trainer, pl_module):
            self.seen.append(float(trainer.callback_metrics["loss_epoch_mean"]))

    runs = {}
    for graphed in (True, False):
        em = EpochMeans()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs[graphed] = fit(graphed=graphed, steps=-1, n_batches=6, max_epochs=3, callbacks=[em])
        means[graphed] = em.seen
    g, e = runs[True], runs[False]
    assert g.stats.replays >= 12 and len(means[True]) == 3
    assert means[True] == means[False]
    assert_same(g, e)


def test_gradient_clip_value_changed_after_capture_is_used_by_the_next_steps():
    """The clipping value is baked into a graph: a change mid-fit selects (captures) a graph with the new value."""

    class Tighten(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 6:
                trainer.gradient_clip_val = 1e-3  # from here on every step is clipped hard

    g, e = graphed_and_eager(steps=12, gradient_clip_val=10.0, callbacks=[Tighten()])
    assert g.stats.captures == 2
    assert_same(g, e)


def test_python_values_logged_in_the_step_are_re_emitted_as_captured():
    kw = dict(module_kw={"python_logs": True})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        g = fit(steps=8, **kw)
    said = [str(x.message) for x in w if "logged a Python value" in str(x.message)]
    assert len(said) == 2 and any("batch_idx_py" in s for s in said)
    e = eager(steps=8, **kw)
    assert_same(g, e)
    assert g.metrics["const"] == e.metrics["const"] == 1.5
    # a replay runs no Python: the capture's batch_idx (3) is what every replay logs, as the warning said
    assert g.metrics["batch_idx_py"] == 3.0 and e.metrics["batch_idx_py"] == 7.0


def test_log_records_of_eager_steps_are_dropped_once_emitted():
    """Records of an eager step (warm-ups, a new signature) are used once; only a captured step's are kept (its
    replays re-emit them): a long run with many re-captures does not pile them up."""
    g = fit(steps=12, lengths=(32, 16))  # two signatures: warm-ups and a new-signature eager step each
    logs = g.cb.step_runner.adapter.logs
    assert g.cb.stats.captures == 2 and g.cb.stats.eager_steps + g.cb.stats.warmup_steps >= 3
    assert set(logs._records) == logs._kept, (sorted(logs._records), sorted(logs._kept))


@pytest.mark.parametrize("on_step,on_epoch,dtype,shape", [
    (True, False, torch.float32, ()),  # a loss logged in training_step (Lightning's default there)
    (True, False, torch.bfloat16, ()),  # a bf16-true module's loss: converted to the default dtype
    (False, True, torch.float32, (1,)),  # accumulated for the epoch mean; a 1-element tensor is squeezed
    (True, True, torch.float64, ()),
])
def test_fast_log_leaves_the_metric_as_lightnings_update(on_step, on_epoch, dtype, shape):
    """The re-emission of a replayed step's self.log (``_compat.fast_log``) leaves Lightning's metric exactly as
    Lightning's own update does (this is the check that the private fields it writes still mean the same)."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    def collection():
        r = _ResultCollection(training=True)
        # the first call, as LightningModule.log makes it (a 1-element value squeezed)
        r.log("training_step", "loss", torch.tensor(2.0, dtype=dtype), on_step=on_step,
              on_epoch=on_epoch, batch_size=3)
        return r

    lightning_, ours = collection(), collection()
    connector = SimpleNamespace(should_reset_tensors=lambda fx: False, _current_fx=None)
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(_results=ours), _logger_connector=connector)
    for v in (0.5, 0.25):
        value = torch.tensor(v, dtype=dtype).reshape(shape)
        lightning_.update_metrics("training_step.loss", value.clone().squeeze(), 3)
        # the runner hands over each replay's own copy of the graph's output: kept without another copy
        assert _compat.fast_log(trainer, "training_step", "training_step.loss", value, 3)
        for r in (lightning_, ours):
            r.metrics(on_step=False)  # computes (and caches) an epoch value: the next update must drop it
    assert connector._current_fx == "training_step"
    a, b = lightning_["training_step.loss"], ours["training_step.loss"]
    state = {k for k, v in vars(a).items() if v is None or isinstance(v, (torch.Tensor, int, float, bool))}
    assert {"value", "_forward_cache", "_update_count", "_computed", "has_reset"} <= state
    for k in sorted(state):
        x, y = getattr(a, k), getattr(b, k)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), k
        else:
            assert x == y, k
    assert lightning_.metrics(on_step=on_step) == ours.metrics(on_step=on_step)


def test_logged_tensors_become_step_outputs_in_the_dtype_lightning_keeps():
    """A tensor given to self.log inside the step becomes an output of the step: a copy (a later in-place change of
    the source in the step cannot alter it), made in the dtype Lightning's metric keeps, so a replay hands it over
    without a conversion. bf16/fp16 -> the default dtype (exact), float32/float64 and integers as they are."""
    from nemo_cudagraph_plugin.lightning.logs import StepLogs

    module = pl.LightningModule()
    module._current_fx_name = "training_step"
    src = {"bf16": torch.tensor(1.1, dtype=torch.bfloat16), "fp16": torch.tensor(0.3, dtype=torch.float16),
           "fp32": torch.tensor(0.7), "fp64": torch.tensor(0.9, dtype=torch.float64), "int": torch.tensor(3)}
    at_log = {k: v.clone() for k, v in src.items()}

    def step():
        for name, value in src.items():
            module.log(name, value)
            value.add_(1)  # in place, after logging

    _, values, token = StepLogs(module).run(step, quiet=False)
    assert token > 0 and len(values) == len(src)
    want = {"bf16": torch.float32, "fp16": torch.float32, "fp32": torch.float32, "fp64": torch.float64,
            "int": torch.int64}
    for (name, value), got in zip(src.items(), values):
        assert got.dtype == want[name], (name, got.dtype)
        assert torch.equal(got, at_log[name].to(got.dtype)), name  # the value at the log call, exactly
        assert got.untyped_storage().data_ptr() != value.untyped_storage().data_ptr(), name


def test_progress_delta_is_measured_per_phase_graph():
    seen = {}

    class Deltas(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            for entry in cb.step_runner.engine.cache._entries.values():
                seen[(entry.key[1].zero_grad, entry.key[1].optimizer_step)] = entry.meta["progress"].incs

    cb = None

    class Grab(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            nonlocal cb
            cb = next(c for c in trainer.callbacks if isinstance(c, CudaGraphCallback))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(steps=6, accumulate_grad_batches=2, callbacks=[Grab(), Deltas()])
    acc, step = seen[(True, False)], seen[(False, True)]
    assert all(inc == 1 for _, _, inc in acc + step)
    # batch 0 of a window zeroes gradients (zero_grad counters), the last one steps the optimizer
    assert {type(o).__name__ for o, _, _ in acc} == {"_StartedTracker"}
    assert {type(o).__name__ for o, _, _ in step} == {"_ReadyCompletedTracker"}


# ----------------------------------------------------------------------------------------------------------
# nothing baked into a graph may go stale
# ----------------------------------------------------------------------------------------------------------
def test_gradient_accumulation_scheduler_changes_k_between_graphs():
    kw = dict(steps=-1, n_batches=8, max_epochs=4)
    g, e = graphed_and_eager(callbacks=[GradientAccumulationScheduler({0: 2, 2: 4})], **kw)
    assert g.rec.steps[-1] == 12 and g.stats.replays > 10, g.stats.summary()
    assert_same(g, e)


def test_graphs_that_own_gradients_and_graphs_that_accumulate_replay_in_turn():
    """k = 2, then 1 (graphs that own the gradients, captured with them set to None), then 2 again: the first
    epoch's accumulating graphs recorded gradient addresses that the owning capture replaced, so they are captured
    again, not replayed into gradients nothing reads."""
    kw = dict(steps=-1, n_batches=8, max_epochs=3)
    g, e = graphed_and_eager(callbacks=[GradientAccumulationScheduler({0: 2, 1: 1, 2: 2})], **kw)
    assert g.stats.replays > 10 and g.stats.recaptures >= 1, g.stats.summary()
    assert_same(g, e)


class _LossIdentity(pl.Callback):
    """Per step Python runs (warm-up, capture): is the loss backward gets the tensor training_step returned?"""

    def __init__(self):
        self.same, self.returned = [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = pl_module.training_step

        def recording(*a, **kw):
            self.returned = out = step(*a, **kw)
            return out

        pl_module.training_step = recording  # this instance, this step only
        self._undo = lambda: pl_module.__dict__.pop("training_step", None)

    def on_before_backward(self, trainer, pl_module, loss):
        self.same.append(loss is self.returned)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._undo()


@pytest.mark.parametrize("acc", [1, 2])
def test_the_loss_is_not_divided_by_one_inside_the_step_and_training_equals_eager(acc):
    """Lightning divides the training_step loss by accumulate_grad_batches, also by 1: a division kernel in the
    forward and one in the backward of every captured step, which change no bit (x / 1 == x; grad / 1 == grad).
    At k == 1 the runner's closure hands backward the returned loss itself; at k > 1 it divides as Lightning does.
    Training stays bitwise eager's."""
    kw = dict(steps=6 if acc == 1 else 4, accumulate_grad_batches=acc)
    ident, plain = _LossIdentity(), _LossIdentity()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g, e = fit(callbacks=[ident], **kw), fit(graphed=False, callbacks=[plain], **kw)
    assert_same(g, e)
    assert ident.same and plain.same and not any(plain.same), "plain Lightning hands backward the loss divided"
    assert len(ident.same) < len(plain.same), "every step ran Python: nothing was replayed"
    assert all(ident.same) if acc == 1 else not any(ident.same), ident.same
    loop = g.trainer.fit_loop.epoch_loop.automatic_optimization
    assert "output_result_cls" not in loop.__dict__, "the loop instance keeps the runner's ClosureResult after fit"


class _AnnealDropout(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 6:
            for m in pl_module.modules():
                if isinstance(m, nn.Dropout):
                    m.p = 0.5  # a dropout schedule: a Python float the captured kernels baked in


class _FreezeBlock(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 6:
            pl_module.model.blocks[0].eval()  # a submodule put in eval mode: its dropout is off from here on


class _FreezeBlock0Params(pl.Callback):
    """Freezes a block's parameters at global step 6: at the first batch of an accumulation window, or at its second
    (eager training then still applies the window's gradients of those parameters, and drops them after)."""

    def __init__(self, mid_window=False):
        self.mid_window = mid_window

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        k = trainer.accumulate_grad_batches
        if trainer.global_step == 6 and batch_idx % k == (1 if self.mid_window else 0):
            for p in pl_module.model.blocks[0].parameters():
                p.requires_grad_(False)


class _Unfreeze(BaseFinetuning):
    """Lightning's fine-tuning callback: block 0 frozen before training, unfrozen with a new param group at epoch 1."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.model.blocks[0])

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.blocks[0], optimizer, lr=LR, initial_denom_lr=1.0)


@pytest.mark.parametrize("change,acc", [
    (_AnnealDropout, 1), (_FreezeBlock, 1), (_FreezeBlock0Params, 1), (_FreezeBlock0Params, 2),
    (lambda: _FreezeBlock0Params(mid_window=True), 3)],
    ids=["dropout-p", "submodule-eval", "requires-grad-off", "requires-grad-off-k2", "requires-grad-off-k3-mid-window"])
def test_module_state_changed_after_capture_is_followed_like_eager(change, acc):
    """A value the captured forward read as a Python constant, changed between steps by a callback: the graphs
    are captured again (one warning naming it) and training stays eager training."""
    with pytest.warns(UserWarning, match=r"re-captured: model\.[\w.]*\.(p|training|requires_grad) changed from .* after the graph"):
        g = fit(steps=12, module_kw={"dropout": 0.1}, callbacks=[change()], accumulate_grad_batches=acc)
    e = eager(steps=12, module_kw={"dropout": 0.1}, callbacks=[change()], accumulate_grad_batches=acc)
    assert g.stats.recaptures >= 1 and g.stats.replays >= 4, g.stats.summary()
    assert_same(g, e)


def test_layers_unfrozen_with_a_new_param_group_are_trained_and_checked_like_eager():
    """BaseFinetuning unfreezes block 0 at epoch 1 and adds its param group: the new group's learning rate becomes a
    device tensor (a new value set at batch 5 of epoch 1 needs no re-capture) and the NaN guard checks the new
    gradients."""
    kw = dict(steps=-1, n_batches=8, max_epochs=2, module_kw={"trainable_only": True},
              callbacks=[_Unfreeze(), SetLR({5: LR / 2})])
    g, e = graphed_and_eager(**kw)
    assert g.stats.recaptures == 1 and g.stats.replays >= 8, g.stats.summary()
    assert_same(g, e)
    runner = g.cb.step_runner
    assert "model.blocks.0.attn.qkv.weight" in runner.adapter.guard.names
    assert len(g.trainer.optimizers[0].param_groups) == 3
    assert isinstance(g.trainer.optimizers[0].param_groups[-1]["lr"], float)  # given back as the user built it


class _AnnealEveryStep(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        for m in pl_module.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.01 * (1 + trainer.global_step)


def test_module_state_changed_every_step_is_refused_naming_it():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CaptureError, match=r"module state keeps changing \(model\..*\.p changed"):
            fit(steps=12, module_kw={"dropout": 0.1}, callbacks=[_AnnealEveryStep()])
    g, e = graphed_and_eager(cb_kw={"on_capture_error": "eager"}, steps=12, module_kw={"dropout": 0.1},
                             callbacks=[_AnnealEveryStep()])
    assert g.cb.eager_reason is not None and "keeps changing" in g.cb.eager_reason
    assert_same(g, e)


def test_module_attribute_set_inside_the_step_does_not_recapture():
    """Python inside the step that sets a module attribute runs at capture only (documented); it is not a change
    between steps, so it costs no re-capture."""
    g = fit(steps=12, module_kw={"baked_counter": True})
    assert g.stats.recaptures == 0 and g.stats.replays == 8, g.stats.summary()


@pytest.mark.parametrize("math_", ["eager", "capturable"])
def test_optimizer_is_given_back_as_the_user_built_it_after_fit(math_):
    """After fit: float learning rates, the user's capturable flag, the optimizer's own step (the user's update was
    captured) and its own zero_grad (with its set_to_none default, which the runner's wrapper overrides while steps
    accumulate)."""
    g = fit(steps=8, accumulate_grad_batches=2, cb_kw={"optimizer_math": math_})
    assert g.stats.replays > 0
    opt = g.trainer.optimizers[0]
    assert all(isinstance(pg["lr"], float) and pg["lr"] == LR and pg["capturable"] is False for pg in opt.param_groups)
    assert "zero_grad" not in opt.__dict__ and "step" not in opt.__dict__
    opt.zero_grad()
    assert all(p.grad is None for p in g.module.parameters())


def _changed_by_bind(trainer, module) -> dict:
    """What the runner's bind changes on Lightning's and torch's objects, as seen on them."""
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    opt = trainer.optimizers[0]
    return {"loop": sorted(k for k in ("run", "output_result_cls") if k in loop.__dict__),
            "zero_grad": "zero_grad" in opt.__dict__,
            "optimizer hooks": len(opt._optimizer_load_state_dict_post_hooks),
            "module hooks": len(module._load_state_dict_post_hooks),
            "clip": "clip_grad_by_norm" in trainer.strategy.precision_plugin.__dict__,
            "strategy": sorted(k for k in ("backward", "optimizer_step") if k in trainer.strategy.__dict__),
            "lr": sorted({"Tensor" if isinstance(pg["lr"], torch.Tensor) else type(pg["lr"]).__name__
                           for pg in opt.param_groups})}


class _SeeBound(pl.Callback):
    def setup(self, trainer, pl_module, stage):
        self.trainer, self.module = trainer, pl_module

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.during = _changed_by_bind(trainer, pl_module)


def test_everything_bind_changed_is_given_back_after_fit_and_after_a_refusal_raised_halfway():
    """unbind undoes, latest first, every change of bind (one ExitStack): the loop's run and result class, the
    optimizer's zero_grad, the load-state-dict hooks, the clipping wrapper, the optimizer's flags. Also when bind
    raises halfway (fp8_refresh=True on a model without FP8 parameters, after the optimizer was prepared), and twice."""
    seen = _SeeBound()
    capturable = {"optimizer_math": "capturable"}  # the preparation that changes the optimizer's lr and flags
    g = fit(steps=6, callbacks=[seen], gradient_clip_val=1.0, cb_kw=capturable)
    assert g.stats.replays > 0
    assert seen.during == {"loop": ["output_result_cls", "run"], "zero_grad": True, "optimizer hooks": 1,
                           "module hooks": 1, "clip": True, "strategy": ["backward", "optimizer_step"],
                           "lr": ["Tensor"]}, seen.during
    after = _changed_by_bind(g.trainer, g.module)
    assert after == {"loop": [], "zero_grad": False, "optimizer hooks": 0, "module hooks": 0, "clip": False,
                     "strategy": [], "lr": ["float"]}, after
    adapter = g.cb.step_runner.adapter
    assert isinstance(adapter, StepAdapter) and g.cb.step_runner.engine.adapter is adapter
    g.cb.step_runner.unbind()  # again: nothing left to undo
    assert _changed_by_bind(g.trainer, g.module) == after
    halfway = _SeeBound()
    with pytest.raises(CaptureError, match=r"fp8_refresh=True\): no TransformerEngine Float8Tensor"):
        fit(steps=2, cb_kw={"fp8_refresh": True, **capturable}, callbacks=[halfway], gradient_clip_val=1.0)
    assert not hasattr(halfway, "during"), "bind raised before the first step"
    assert _changed_by_bind(halfway.trainer, halfway.module) == after


class _WeightDecaySchedule(pl.Callback):
    """Changes a hyperparameter the graph bakes in as a constant (weight decay) before every step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        trainer.optimizers[0].param_groups[0]["weight_decay"] = 0.1 + 0.01 * trainer.global_step


def test_a_baked_hyperparameter_scheduled_every_step_is_refused_after_two_recaptures():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CaptureError, match="keeps changing .*weight_decay"):
            fit(steps=12, callbacks=[_WeightDecaySchedule()])
    # on_capture_error="eager": graphs off with one warning, and training is eager training
    g, e = graphed_and_eager(cb_kw={"on_capture_error": "eager"}, steps=12, callbacks=[_WeightDecaySchedule()])
    assert g.cb.eager_reason is not None and "keeps changing" in g.cb.eager_reason
    assert_same(g, e)


def test_lr_assigned_inside_optimizer_step_is_refused_at_capture_naming_the_line():
    line = next(i for i, s in enumerate(inspect.getsourcelines(TinyGPT)[0]) if "# LR-IN-STEP" in s)
    line += inspect.getsourcelines(TinyGPT)[1]
    with pytest.raises(CaptureError) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit(steps=8, module_kw={"lr_in_optimizer_step": True}, cb_kw={"scope": "step"})
    msg = str(info.value)
    assert info.value.rule == "hyperparameter-in-step"
    assert f"{__file__}:{line}" in msg and "`optimizer_step`" in msg and "param_groups[0]['lr']" in msg
    assert "LambdaLR" in msg


@pytest.mark.parametrize("math_", ["eager", "capturable"])
def test_lr_assigned_inside_optimizer_step_trains_as_eager_when_the_refusal_falls_back_to_eager(math_):
    """on_capture_error="eager": the steps before the refused capture and every step after it use the lr that
    `optimizer_step` assigned just before the update, as eager training does (not the one of the step before)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        g = fit(steps=10, module_kw={"lr_in_optimizer_step": "cycle"},
                cb_kw={"on_capture_error": "eager", "optimizer_math": math_, "scope": "step"})
    e = eager(steps=10, module_kw={"lr_in_optimizer_step": "cycle"})
    assert g.stats.captures == 0 and g.stats.eager_reasons.get("capture error") == 1, g.stats.summary()
    assert sum("assigns optimizer.param_groups" in str(w.message) for w in seen) == 1  # one warning, the reason
    assert_same(g, e)


class SetLR(pl.Callback):
    """Assign float learning rates at some batches (user code between steps, as a scheduler replacing the value)."""

    def __init__(self, at):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx in self.at:
            for pg in trainer.optimizers[0].param_groups:
                pg["lr"] = self.at[batch_idx]


@pytest.mark.parametrize("math_", ["eager", "capturable"])
def test_float_lr_assigned_around_the_capture_step_is_used_by_the_graph(math_):
    # batch 2: the last warm-up step, 3: the capture step, 6: a replay
    at = {2: LR * 2, 3: LR * 4, 6: LR / 2}
    g = fit(steps=10, callbacks=[SetLR(at)], cb_kw={"optimizer_math": math_})
    e = fit(graphed=False, steps=10, callbacks=[SetLR(at)])
    assert g.stats.captures == 1 and g.stats.replays == 6, g.stats.summary()
    assert g.rec.lrs == e.rec.lrs and len(set(g.rec.lrs)) == 4
    assert_same(g, e)


class Realloc(pl.Callback):
    """Re-allocate every parameter at batch 6 (three replays after the capture) in one of the ways users do."""

    def __init__(self, how):
        self.how, self.saved = how, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx != 6:
            return
        if self.how == "data":
            for p in pl_module.parameters():
                p.data = p.data.clone()
        elif self.how == "module_to":
            pl_module.to(torch.float64).to(torch.float32)  # exact round trip, new memory
        elif self.how == "swap_tensors":
            for p in pl_module.parameters():
                torch.utils.swap_tensors(p, nn.Parameter(p.detach().clone()))
        elif self.how == "ema_swap":
            # EMA-style weight swap: the step trains copies that are swapped back into the originals after it
            self.saved = [p.data for p in pl_module.parameters()]
            for p in pl_module.parameters():
                p.data = p.data.clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.how == "ema_swap" and batch_idx == 6:
            for p, s in zip(pl_module.parameters(), self.saved):
                s.copy_(p.data)
                p.data = s


@pytest.mark.parametrize("how", ["data", "module_to", "swap_tensors", "ema_swap"])
def test_parameters_reallocated_after_capture_are_detected(how):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        g = fit(steps=12, callbacks=[Realloc(how)])
    e = eager(steps=12)
    assert any("re-captured" in str(x.message) for x in w), g.stats.summary()
    assert g.stats.recaptures >= 1 and g.stats.captures >= 2 and g.stats.replays >= 5, g.stats.summary()
    assert_same(g, e)


def test_gradient_first_created_by_a_longer_sequence_recaptures_the_earlier_graph():
    lengths = (16,) * 7 + (32,) * 3 + (16,) * 6
    kw = dict(module_kw={"extra_for_long": 16}, steps=16, lengths=lengths)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        g = fit(**kw)
    e = eager(**kw)
    assert g.stats.captures >= 3 and g.stats.replays >= 6, g.stats.summary()
    assert any("re-captured" in str(x.message) for x in w)
    assert_same(g, e)


def test_parity_error_fires_when_the_graph_differs_from_eager_on_purpose():
    with pytest.raises(ParityError, match="loss: graph"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit(steps=8, module_kw={"baked_counter": True}, cb_kw={"verify_steps": 2})


class BNRegressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.net(x) - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, fused=True)


def _bn_fit(verify):
    pl.seed_everything(0, verbose=False)
    m = BNRegressor()
    cb = CudaGraphCallback(verify_steps=verify)
    cb.step_runner.backend = TapeBackend()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, generator=g), torch.randn(1, generator=g)) for _ in range(40)]
    t = pl.Trainer(accelerator="cpu", max_steps=10, max_epochs=2, callbacks=[cb], logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(m, DataLoader(data, batch_size=4))
    return m, cb


def test_verify_steps_leave_batchnorm_statistics_as_an_unverified_run():
    plain, _ = _bn_fit(0)
    checked, cb = _bn_fit(3)
    assert cb.stats.verified_steps == 3
    for (n, a), b in zip(plain.state_dict().items(), checked.state_dict().values()):
        assert torch.equal(a, b), f"{n} differs after verify_steps"


def test_callback_with_ddp_strategy_is_refused_naming_the_strategy_to_use():
    t = pl.Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(), logger=False, max_steps=1)
    m = TinyGPT()
    why = checks.setup_refusal(CaptureConfig(), t, m, "CudaGraphCallback")
    assert why is not None and why.label == "callback with DDP" and "CudaGraphStrategy('ddp')" in why.message
    cb = CudaGraphCallback()
    with pytest.raises(CaptureError, match=r"CudaGraphStrategy\('ddp'\)"):
        cb.setup(t, m, "fit")
    # the strategy itself takes DDP
    assert checks.setup_refusal(CaptureConfig(), t, m, "CudaGraphStrategy") is None
    # partial graphs are not proven under DDP: refused with the option as the user wrote it; "auto" keeps whole steps
    why = checks.setup_refusal(CaptureConfig(scope="modules"), t, m, "CudaGraphStrategy")
    assert why is not None and why.label == "partial graphs with DDP" and "CudaGraphStrategy(scope='modules')" in why.message
    assert checks.setup_refusal(CaptureConfig(scope="auto"), t, m, "CudaGraphStrategy") is None


@pytest.mark.parametrize("read", ["watched", "gradient-read"])
def test_nan_guard_set_up_when_first_gradients_appear_on_the_sync_checked_warmup_step(read):
    # TinyGPT.late first gets a gradient at batch 2, the last (sync-checked) warm-up step. Where the guard reads the
    # gradients (here: clipping by value), it builds its check for the new set of gradients there (an index plan: the
    # slots of a subset), which must not be a host sync. Where it watches the loss, nothing is built there.
    kw = {"gradient_clip_val": 10.0, "gradient_clip_algorithm": "value"} if read == "gradient-read" else {}
    g, e = graphed_and_eager(module_kw={"late_param": True}, steps=10, **kw)
    assert bool(g.cb.step_runner.adapter.guard._checks) == (read == "gradient-read")
    assert g.stats.captures == 1 and g.stats.replays == 6, g.stats.summary()
    assert_same(g, e)


def test_nan_guard_names_the_parameter_whose_gradient_went_bad_in_a_replay():
    name = "model.blocks.0.mlp.fc.weight"
    with pytest.raises(NonFiniteError) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit(steps=12, poison_at=7, module_kw={"poison_param": name}, cb_kw={"nan_check_every": 4})
    assert info.value.parameter == name, str(info.value)
    assert "global step 4 up to 8" in str(info.value)


@pytest.mark.parametrize("clip", [None, "norm", "default"])
def test_nan_guard_names_the_parameter_when_its_read_comes_long_after_the_bad_step(clip):
    """One read at fit end, 8 steps after the poisoned one; the read names the one bad parameter, not the first of
    every parameter spoiled after it, and the guard reads no gradient of its own (no per-step check built).
    No clipping: the next forward after a bad gradient gives a NaN loss and then NaN gradients everywhere; the guard
    watches the loss and reads the parameters at the first NaN loss. Clipping by norm (given, or Lightning's
    default): the bad step's NaN clip factor spoils every parameter, so every later step's norms are non-finite; the
    clipping norms mark only the first step of a read window with a bad norm."""
    name = "model.blocks.0.mlp.fc.weight"
    kw = {} if clip is None else {"gradient_clip_val": 0.5, "gradient_clip_algorithm": {"default": None}.get(clip, clip)}
    cb = CudaGraphCallback(nan_check_every=50)
    cb.step_runner.backend = TapeBackend()
    with pytest.raises(NonFiniteError) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit(graphed=False, steps=12, poison_at=3, module_kw={"poison_param": name}, callbacks=[cb], **kw)
    assert info.value.parameter == name and " more)" not in str(info.value), str(info.value)
    if clip is None:
        assert "non-finite loss and non-finite gradient or update of parameter" in str(info.value), str(info.value)
    assert cb.stats.replays >= 8 and not cb.step_runner.adapter.guard._checks, cb.stats.summary()


class _ClipsByValueItself(pl.Callback):
    """Makes the module clip by value in its own configure_gradient_clipping (Lightning's clipping by norm is then
    not what runs, so the NaN guard must read the gradients before it: a value clip turns an Inf into a number)."""

    def setup(self, trainer, pl_module, stage):
        def configure_gradient_clipping(optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            torch.nn.utils.clip_grad_value_(pl_module.parameters(), 1e-3)

        pl_module.configure_gradient_clipping = configure_gradient_clipping


class _LightningSkipsItsClipping(pl.Callback):
    """Lightning's clip_gradients of this trainer does nothing (as a Lightning version that clipped elsewhere would):
    the check the guard deferred to the clipping norms must still run."""

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.precision_plugin.clip_gradients = lambda *a, **k: None


@pytest.mark.parametrize("clip", ["norm", "default", "value", "norm-overridden", "norm-not-run"])
def test_nan_guard_names_the_parameter_when_gradients_are_clipped(clip):
    """Clipping by norm: the guard reads the per-parameter norms clipping computes (no read of its own) and still
    names the one bad parameter (not every parameter the NaN clip factor spoils). Clipping by value, or by a module's
    own configure_gradient_clipping: the gradients are read before the clip."""
    name = "model.blocks.0.mlp.fc.weight"
    algo = {"value": "value", "default": None}.get(clip, "norm")  # Lightning clips by norm when it is not given
    cbs = {"norm-overridden": [_ClipsByValueItself()], "norm-not-run": [_LightningSkipsItsClipping()]}.get(clip, [])
    cb = CudaGraphCallback(nan_check_every=4)
    cb.step_runner.backend = TapeBackend()
    with pytest.raises(NonFiniteError) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # an Inf, which a value clip would turn into a number: the read must come before such a clip
            fit(graphed=False, steps=12, poison_at=7,
                module_kw={"poison_param": name, "poison_inf": clip not in ("norm", "default")},
                callbacks=[cb, *cbs],
                gradient_clip_val=0.5, gradient_clip_algorithm=algo)
    assert info.value.parameter == name and " more)" not in str(info.value), str(info.value)
    assert "global step 4 up to 8" in str(info.value)
    assert cb.stats.replays >= 4, cb.stats.summary()
    # the guard's own gradient read is built only where the clipping norms cannot be used
    assert bool(cb.step_runner.adapter.guard._checks) == (clip not in ("norm", "default")), clip


@pytest.mark.parametrize("clip", [None, "norm", "value"])
def test_the_strategy_reaches_the_nan_guard_at_the_same_points_as_the_callback(clip):
    """The NaN guard acts where bind routes it into this trainer's step (backward, the closure the optimizer runs,
    Lightning's clipping by norm), for CudaGraphStrategy as for CudaGraphCallback: the loss watched without clipping,
    the clipping norms read when clipping by norm, the gradients read before a value clip; the parameter named."""
    name = "model.blocks.0.mlp.fc.weight"
    kw = {} if clip is None else {"gradient_clip_val": 0.5, "gradient_clip_algorithm": clip}
    s = CudaGraphStrategy(SingleDeviceStrategy(device="cpu"), nan_check_every=4)
    s.step_runner.backend = TapeBackend()
    with pytest.raises(NonFiniteError) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit(graphed=False, steps=12, poison_at=7, module_kw={"poison_param": name, "poison_inf": clip == "value"},
                strategy=s, **kw)
    assert info.value.parameter == name and " more)" not in str(info.value), str(info.value)
    assert "global step 4 up to 8" in str(info.value)
    assert s.stats.replays >= 4, s.stats.summary()
    assert bool(s.step_runner.adapter.guard._checks) == (clip == "value"), clip


def test_clipping_norms_cover_a_step_where_some_parameters_have_no_gradient():
    """TinyGPT.never gets no gradient (and .late only from batch 2): the clipping norms then cover fewer slots than
    the guard has; the missing ones get a zero norm, so the guard still needs no read of its own, and training is
    eager training."""
    g, e = graphed_and_eager(module_kw={"late_param": True}, steps=10, gradient_clip_val=0.5)
    assert g.stats.replays == 6, g.stats.summary()
    assert not g.cb.step_runner.adapter.guard._checks
    assert_same(g, e)


def test_nan_action_skip_drops_the_poisoned_update_inside_a_replay():
    """``nan_action="skip"``: the replayed step whose gradient went non-finite leaves the parameters and the optimizer
    state as they were (the fused optimizer reads the guard's flag on the device), and training goes on finite."""
    name = "model.blocks.0.mlp.fc.weight"
    seen = []

    class Skipped(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(next(c for c in trainer.callbacks if isinstance(c, CudaGraphCallback)).stats.skipped_steps)

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        g = fit(steps=12, poison_at=7, module_kw={"poison_param": name}, cb_kw={"nan_action": "skip", "nan_check_every": 4},
                callbacks=[Skipped()])
    assert g.stats.replays >= 8 and g.stats.skipped_steps == 1
    assert g.stats.optimizer_math == ""  # the user's own fused update, its kernel given the flag
    # counted by the read queued at the poisoned step (the 8th: nan_check_every=4), not only by the one at fit end
    assert seen[:7] == [0] * 7 and seen[7:11] == [1] * 4
    assert any("skipped" in str(x.message) for x in w)
    assert all(torch.isfinite(p).all() for p in g.params)
    assert all(math.isfinite(x) for x in g.rec.losses)


def test_nan_guard_read_is_reported_by_the_first_step_after_the_gpu_wrote_it(monkeypatch):
    """The guard's read every N steps is queued (no host sync); the runner reports it at the first later step
    whose event query says the copy is written, naming the window of the snapshot, not of that step."""
    import nemo_cudagraph_plugin.core.nan_guard as ng

    class WrittenAtSecondQuery:
        def __init__(self):
            self.queries = 0

        def query(self):
            self.queries += 1
            return self.queries >= 2

        def synchronize(self):
            raise AssertionError("the runner waited for a snapshot instead of polling it")

    monkeypatch.setattr(ng, "_copied", lambda device: WrittenAtSecondQuery())
    name = "model.blocks.0.mlp.fc.weight"
    rec = Rec()
    with pytest.raises(NonFiniteError) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit(steps=12, poison_at=7, module_kw={"poison_param": name}, cb_kw={"nan_check_every": 4}, callbacks=[rec])
    assert info.value.parameter == name and "global step 4 up to 8" in str(info.value), str(info.value)
    # steps 1-8 ended (the snapshot at the end of step 8 was not written yet); the 9th step's end read it
    assert rec.steps == [1, 2, 3, 4, 5, 6, 7, 8], rec.steps


# ----------------------------------------------------------------------------------------------------------
# refusals and options (no graph needed)
# ----------------------------------------------------------------------------------------------------------
def test_callback_without_cuda_warns_once_and_trains_identically():
    cb = CudaGraphCallback()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pl.seed_everything(0, verbose=False)
        m = TinyGPT()
        rec = Rec()
        t = pl.Trainer(accelerator="cpu", max_steps=6, callbacks=[cb, rec], logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False)
        t.fit(m, DataLoader(Windows(6), batch_size=2))
    ours = [str(x.message) for x in w if "nemo_cudagraph_plugin" in str(x.message)]
    assert len(ours) == 1 and ("no CUDA device" in ours[0] or "not on a CUDA device" in ours[0])
    plain = eager(steps=6)
    assert rec.losses == plain.rec.losses and rec.steps == plain.rec.steps
    assert cb.stats.replays == 0 and cb.eager_reason and cb.stats.eager_reasons


def test_strategy_without_cuda_trains_identically():
    s = CudaGraphStrategy(SingleDeviceStrategy(device="cpu"))
    with pytest.warns(UserWarning, match="training eagerly"):
        pl.seed_everything(0, verbose=False)
        m = TinyGPT()
        rec = Rec()
        t = pl.Trainer(accelerator="cpu", strategy=s, max_steps=6, callbacks=[rec], logger=False,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        t.fit(m, DataLoader(Windows(6), batch_size=2))
    assert rec.losses == eager(steps=6).rec.losses and s.stats.replays == 0


def test_callback_and_strategy_together_is_one_clear_error():
    with pytest.raises(ValueError, match="Both CudaGraphCallback and CudaGraphStrategy"):
        t = pl.Trainer(accelerator="cpu", strategy=CudaGraphStrategy(SingleDeviceStrategy(device="cpu")),
                       callbacks=[CudaGraphCallback()], max_steps=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False)
        t.fit(TinyGPT(), DataLoader(Windows(1), batch_size=2))


def test_options_reach_the_engine_config():
    cb = CudaGraphCallback(warmup_steps=5, max_graphs=3, on_capture_error="eager", nan_guard="loss", verify_steps=2)
    assert (cb.config.warmup_steps, cb.config.max_graphs, cb.config.on_capture_error, cb.config.nan_mode,
            cb.config.verify_steps) == (5, 3, "eager", "loss", 2)
    s = CudaGraphStrategy(warmup_steps=4, nan_action="skip")
    assert s.capture_config.warmup_steps == 4 and s.capture_config.nan_action == "skip"
    with pytest.raises(ValueError, match=r"CudaGraphCallback\(warmup_steps=0\)"):
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


@pytest.mark.parametrize("before", [None, "1"])
def test_strategy_creates_the_process_group_with_nccl_async_error_handling_off_then_restores_it(monkeypatch, before):
    """PyTorch's watchdog may query work created during a capture while NCCL async error handling is on: the DDP
    strategy turns it off for this process while the process group is created, and puts back what was there."""
    env = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    seen = []
    monkeypatch.setattr(DDPStrategy, "setup_distributed", lambda self: seen.append(os.environ.get(env)))
    if before is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, before)
    CudaGraphStrategy("ddp").setup_distributed()
    assert seen == ["0"]
    assert os.environ.get(env) == before


@pytest.mark.parametrize("what,label,match", [("fp16", "fp16 precision", "GradScaler"),
                                              ("manual", "manual optimization", "manual optimization")])
def test_refusal_reasons_name_the_fix(what, label, match):
    t = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    m = TinyGPT()
    if what == "fp16":  # Lightning turns 16-mixed into bf16 on CPU; set what a GPU trainer would report
        t.strategy.precision_plugin.precision = "16-mixed"
    else:
        m.automatic_optimization = False
    why = checks.setup_refusal(CaptureConfig(), t, m, "CudaGraphCallback")
    assert why is not None and why.label == label and match in why.message and not why.soft


def test_step_key_matches_lightnings_own_decision():
    seen = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            k = _compat.step_key(trainer, _compat.automatic_loop(trainer), batch_idx)
            seen.append((k.zero_grad, k.optimizer_step, k.accumulate_grad_batches))

    fit(graphed=False, steps=2, accumulate_grad_batches=3, callbacks=[Spy()])
    assert seen == [(True, False, 3), (False, False, 3), (False, True, 3)] * 2


def test_undivided_closure_result_is_lightnings_own_except_the_division_by_one():
    """On the installed Lightning (2.6.6 here, 2.4.0 in the nemo stage): _compat's ClosureResult gives Lightning's
    result for every training_step output (equal values, same extras, same errors), with the loss itself at k == 1
    (no division) and Lightning's division at k > 1 or for a non-floating loss."""
    from lightning.pytorch.loops.optimization.automatic import ClosureResult
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    loss = torch.tensor(1.75, dtype=torch.bfloat16, requires_grad=True) * 1
    outputs = [loss, {"loss": loss, "acc": 3, "t": torch.ones(2)}, None, torch.tensor(3)]
    for out in outputs:
        for k in (1, 2, 4):
            mine = _compat._UndividedClosureResult.from_training_step_output(out, k)
            theirs = ClosureResult.from_training_step_output(out, k)
            assert isinstance(mine, ClosureResult) and mine.extra.keys() == theirs.extra.keys()
            if theirs.closure_loss is None:
                assert mine.closure_loss is None and mine.loss is None
                continue
            assert mine.closure_loss.dtype == theirs.closure_loss.dtype
            assert torch.equal(mine.closure_loss, theirs.closure_loss) and torch.equal(mine.loss, theirs.loss)
            src = out["loss"] if isinstance(out, dict) else out
            undivided = k == 1 and src.is_floating_point()
            assert (mine.closure_loss is src) == undivided, (out, k)
    for bad in ({"acc": 1}, "a string"):
        with pytest.raises(MisconfigurationException) as theirs:
            ClosureResult.from_training_step_output(bad, 1)
        with pytest.raises(MisconfigurationException, match=str(theirs.value)[:40]):
            _compat._UndividedClosureResult.from_training_step_output(bad, 1)
    # where the loop builds a result class of its own, nothing is changed
    class Custom(ClosureResult):
        pass

    loop = type("Loop", (), {"output_result_cls": Custom})()
    assert _compat.undivided_loss(loop) is None and loop.output_result_cls is Custom


@pytest.fixture
def capturable_on_cpu(monkeypatch):
    """torch's multi-tensor capturable Adam refuses CPU parameters (a device check only): lift it for these tests."""
    import importlib

    monkeypatch.setattr(importlib.import_module("torch.optim.adam"), "_get_capturable_supported_devices",
                        lambda supports_xla=True: ["cuda", "cpu"])


@pytest.mark.parametrize("late", [False, True], ids=["same-counters", "late-parameter"])
def test_fast_adam_captures_the_group_scalar_update_and_trains_as_eager_bit_for_bit(capturable_on_cpu, late):
    kw = {"foreach_adam": True, "late_param": late}
    eager = fit(graphed=False, module_kw=kw)
    # torch's capturable step adds a host-made 1.0 to CPU step counters (on CUDA they are device tensors): neither
    # the sync-checked warm-up nor a strict tape would take that on CPU
    # verify_steps: the first graphed steps are also run eagerly (torch's own step) and compared bit for bit
    graphed = fit(module_kw=kw, cb_kw={"fast_adam": True, "sync_check": False, "verify_steps": 2},
                  tape_kw={"sync_in_capture": "bake"})
    assert graphed.stats.replays > 0 and graphed.stats.fast_adam_unused == "" and graphed.stats.verified_steps == 2
    fast = graphed.cb.step_runner.adapter.fast_adam
    if late:
        # the late parameter's counter is one behind its group's from the capture on: that group stays torch's
        assert fast.torch_groups >= 1 and fast.counted_groups >= 1
    else:
        assert fast.torch_groups == 0 and fast.counted_groups == 2 * graphed.stats.captures
    assert graphed.rec.losses == eager.rec.losses
    for a, b in zip(eager.params, graphed.params):
        assert torch.equal(a, b)
    assert "step" not in graphed.trainer.optimizers[0].__dict__


def test_fast_adam_with_an_lr_scheduler_trains_as_eager_and_gives_the_scheduler_its_step_wrapper_back(
        capturable_on_cpu):
    kw = {"foreach_adam": True, "sched": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** min(s, 5))}
    eager = fit(graphed=False, module_kw=kw)
    graphed = fit(module_kw=kw, cb_kw={"fast_adam": True, "sync_check": False}, tape_kw={"sync_in_capture": "bake"})
    assert graphed.cb.step_runner.adapter.fast_adam.counted_groups > 0
    assert graphed.rec.losses == eager.rec.losses and graphed.rec.lrs == eager.rec.lrs
    # the scheduler tracks optimizer.step() calls through a wrapper on the instance: still there after the captures
    assert hasattr(graphed.trainer.optimizers[0].__dict__.get("step"), "_wrapped_by_lr_sched")


def test_fast_adam_is_on_by_default(capturable_on_cpu):
    run = fit(module_kw={"foreach_adam": True}, cb_kw={"sync_check": False}, tape_kw={"sync_in_capture": "bake"})
    assert run.stats.replays > 0 and run.stats.fast_adam_unused == ""
    assert run.cb.step_runner.adapter.fast_adam.counted_groups == 2 * run.stats.captures


def test_fast_adam_says_nothing_about_an_optimizer_that_is_not_adam(caplog):
    # the capturable preparation: with the user's own SGD math fast_adam is out of the question anyway
    with caplog.at_level("INFO"):
        run = fit(module_kw={"sgd": True}, cb_kw={"optimizer_math": "capturable"})
    assert run.stats.replays > 0 and run.cb.step_runner.adapter.fast_adam is None
    assert run.stats.fast_adam_unused == "" and "fast_adam" not in run.stats.summary() + caplog.text


def test_fast_adam_on_a_fused_adamw_says_why_it_keeps_the_optimizers_step(caplog):
    with caplog.at_level("INFO"):
        run = fit(cb_kw={"fast_adam": True, "optimizer_math": "capturable"})  # the user's own fused step otherwise
    assert run.stats.replays > 0 and run.cb.step_runner.adapter.fast_adam.counted_groups == 0
    assert "param group 0 is not capturable multi-tensor Adam (fused)" in run.stats.fast_adam_unused
    assert "fast_adam unused: param group 0" in run.stats.summary()
