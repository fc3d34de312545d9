"""On a real GPU: nothing baked into a graph may go stale.

Each test compares graphed training with eager Lightning (same seed, same data, the optimizer configured
as under graphs by ``CapturableEager``) and fails when a replay keeps a value or an address the user's
training has since changed. Each fails on an engine without the guard it tests (docs/results/capture.md).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from _lightning_utils import CapturableEager, fit, loader, make_module, max_rel
from torch.utils.data import DataLoader, Dataset

from nemo_cudagraph_plugin import CaptureError, CudaGraphCallback, ParityError
from recipes.gpt import get_config

Base = type(make_module())


def _params(trainer) -> list[torch.Tensor]:
    return [p.detach().float().cpu().clone() for p in trainer.lightning_module.parameters()]


def _max_param_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _assert_same_training(g, e, tg, te):
    gl, el = g.loss_tensor(), e.loss_tensor()
    assert gl.shape == el.shape
    assert torch.equal(gl, el), f"losses: max rel diff {max_rel(gl, el):.3e}"
    d = _max_param_diff(_params(tg), _params(te))
    assert d == 0.0, f"final parameters differ from eager by up to {d:.3e}"


# -- accumulate_grad_batches changes during training ----------------------------------------
def test_gradient_accumulation_scheduler_changes_k():
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    def run(cbs):
        return fit(make_module(), [GradientAccumulationScheduler({0: 2, 2: 4}), *cbs], -1, train_loader=loader(8),
                   max_epochs=4)

    cb = CudaGraphCallback()
    tg, g = run([cb])
    te, e = run([CapturableEager()])
    assert cb.stats.replays > 10, cb.stats.summary()
    print(f"\nCASE1 accumulation {{0: 2, 2: 4}}: {cb.stats.summary()}")
    _assert_same_training(g, e, tg, te)


# -- Python inside the step that assigns a hyperparameter; a float lr set around the capture -------
class _WarmupInOptimizerStep(Base):
    """The LR warm-up as Lightning's docs write it: inside an overridden optimizer_step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        for pg in optimizer.param_groups:
            pg["lr"] = min(1.0, (self.trainer.global_step + 1) / 50) * 1e-3  # LINE-LR
        optimizer.step(closure=optimizer_closure)


def _line_of(tag):
    src = open(__file__).read().splitlines()
    return next(i + 1 for i, line in enumerate(src) if line.rstrip().endswith("# " + tag))


def test_hyperparameter_assigned_inside_the_step_is_refused_at_its_line():
    pl.seed_everything(0, verbose=False)
    m = _WarmupInOptimizerStep(get_config("tiny", n_layer=2, seq_len=256))
    with pytest.raises(CaptureError) as ei:
        fit(m, [CudaGraphCallback(scope="step")], 20)
    err = ei.value
    print(f"\nCASE2a: {str(err)[:300]}")
    assert err.rule == "hyperparameter-in-step", str(err)
    assert err.location is not None and err.location.endswith(f"test_stale_gpu.py:{_line_of('LINE-LR')}"), str(err)
    assert "optimizer_step" in str(err) and "LambdaLR" in str(err)


def test_hyperparameter_assigned_inside_the_step_trains_eagerly_when_allowed():
    def run(cbs):
        pl.seed_everything(0, verbose=False)
        return fit(_WarmupInOptimizerStep(get_config("tiny", n_layer=2, seq_len=256)), cbs, 30)

    cb = CudaGraphCallback(on_capture_error="eager", scope="step")
    with pytest.warns(UserWarning, match="CUDA graphs disabled"):
        tg, g = run([cb])
    te, e = run([])  # the user's own eager run: each update uses the lr optimizer_step assigned just before it
    assert cb.stats.replays == 0 and cb.eager_reason
    _assert_same_training(g, e, tg, te)


class _SetFloatLR(pl.Callback):
    """User code assigning a float learning rate right before, at and after the capture step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx in (2, 3, 4, 10, 20):
            for pg in trainer.optimizers[0].param_groups:
                pg["lr"] = 1e-3 * (1 + batch_idx / 10)


def test_float_lr_set_around_the_capture_is_followed():
    cb = CudaGraphCallback()
    tg, g = fit(make_module(), [_SetFloatLR(), cb], 30)
    te, e = fit(make_module(), [_SetFloatLR(), CapturableEager()], 30)
    assert cb.stats.replays > 20 and cb.stats.recaptures == 0, cb.stats.summary()
    _assert_same_training(g, e, tg, te)


# -- parameters re-allocated without a hook -------------------------------------------------
class _Realloc(pl.Callback):
    def __init__(self, kind: str, at: int = 10) -> None:
        self.kind, self.at, self.shadow = kind, at, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        params = list(pl_module.parameters())
        if self.kind == "ema":
            # An EMA-style swap: the step trains the other weights' memory, swapped back at batch end.
            if self.shadow is None:
                self.shadow = [p.detach().clone() for p in params]
            if batch_idx >= self.at:
                for p, s in zip(params, self.shadow):
                    p.data, s.data = s.data, p.data
            return
        if batch_idx != self.at:
            return
        if self.kind == "data":
            for p in params:
                p.data = p.data.clone()
        elif self.kind == "to":
            pl_module.to(torch.float64)
            pl_module.to(torch.float32)
        elif self.kind == "swap":
            for p in params:
                q = torch.nn.Parameter(p.detach().clone())
                torch.utils.swap_tensors(p, q)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.kind == "ema" and batch_idx >= self.at:
            for p, s in zip(pl_module.parameters(), self.shadow):
                p.data, s.data = s.data, p.data


@pytest.mark.parametrize("kind", ["data", "to", "swap", "ema"])
def test_reallocated_parameters_are_detected_before_a_replay(kind):
    cb = CudaGraphCallback()
    with pytest.warns(UserWarning, match="re-captured"):
        tg, g = fit(make_module(), [_Realloc(kind), cb], 30)
    te, e = fit(make_module(), [_Realloc(kind), CapturableEager()], 30)
    print(f"\nCASE3 {kind}: {cb.stats.summary()}")
    assert cb.stats.recaptures >= 1 and cb.stats.replays > 10, cb.stats.summary()
    _assert_same_training(g, e, tg, te)


# -- state created by a later signature's warm-up ------------------------------------------
class _LongOnly(Base):
    """A parameter that only sequences longer than 128 use (it first gets a gradient late)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.long_only = torch.nn.Parameter(torch.ones(4))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch["input_ids"].shape[1] > 128:
            loss = loss + 1e-3 * (self.long_only * batch["input_ids"][:, :4].float().mean(0)).sum()
        return loss


class _Seq(Dataset):
    def __init__(self, lengths, batch_size=2, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for t in lengths:
            for _ in range(batch_size):
                x = torch.randint(0, 256, (t + 1,), generator=g)
                self.items.append({"input_ids": x[:-1], "labels": x[1:]})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_state_created_after_a_capture_makes_earlier_graphs_stale():
    # 24 short batches (graphs captured without the parameter), then short/long windows of 2 micro-batches.
    lengths = [64] * 24 + [64, 192] * 16

    def run(cbs):
        pl.seed_everything(0, verbose=False)
        m = _LongOnly(get_config("tiny", n_layer=2, seq_len=256))
        return fit(m, cbs, -1, train_loader=DataLoader(_Seq(lengths), batch_size=2, shuffle=False),
                   max_epochs=1, accumulate_grad_batches=2)

    cb = CudaGraphCallback()
    tg, g = run([cb])
    te, e = run([CapturableEager()])
    print(f"\nCASE4: {cb.stats.summary()}")
    assert cb.stats.replays > 20, cb.stats.summary()
    _assert_same_training(g, e, tg, te)


# -- verify_steps must not change training; ParityError must be able to fire -----------------
class _BNModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _bn_loader(n=40):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n * 8, 16, generator=g), torch.randn(n * 8, 1, generator=g)
    return DataLoader(list(zip(x, y)), batch_size=8, shuffle=False)


def test_verify_steps_leaves_batchnorm_statistics_as_an_unverified_run():
    def run(verify):
        pl.seed_everything(0, verbose=False)
        cb = CudaGraphCallback(verify_steps=verify, nan_guard=False)
        t, _ = fit(_BNModule(), [cb], 40, train_loader=_bn_loader())
        bn = t.lightning_module.net[1]
        return cb, bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked), _params(t)

    cb_v, mean_v, var_v, n_v, p_v = run(5)
    cb_0, mean_0, var_0, n_0, p_0 = run(0)
    assert cb_v.stats.verified_steps == 5
    print(f"\nCASE5 BN: batches tracked {n_v} vs {n_0}; mean diff {float((mean_v - mean_0).abs().max()):.3e}")
    assert n_v == n_0 == 40
    assert torch.equal(mean_v, mean_0) and torch.equal(var_v, var_0)
    assert _max_param_diff(p_v, p_0) == 0.0


class _BakedCounter(Base):
    """A Python counter in the loss: eager changes it every step, a replay keeps the capture-time value."""

    calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        return super().training_step(batch, batch_idx) * (1.0 + 0.01 * self.calls)


def test_parity_error_fires_when_the_graph_differs_from_eager():
    pl.seed_everything(0, verbose=False)
    with pytest.raises(ParityError, match="loss"):
        fit(_BakedCounter(get_config("tiny", n_layer=1, seq_len=256)), [CudaGraphCallback(verify_steps=3)], 20)


# -- NaN guard set-up inside the sync-checked warm-up ----------------------------------------
class _LateGrad(Base):
    """``never`` never gets a gradient; ``late`` first gets one on batch 2 (the sync-checked warm-up step)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.never = torch.nn.Parameter(torch.ones(3))
        self.late = torch.nn.Parameter(torch.ones(3))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx >= 2:
            loss = loss + 1e-3 * self.late.sum()
        return loss


def test_nan_guard_setup_in_the_sync_checked_warmup_is_not_a_false_host_sync():
    def run(cbs):
        pl.seed_everything(0, verbose=False)
        return fit(_LateGrad(get_config("tiny", n_layer=2, seq_len=256)), cbs, 20)

    cb = CudaGraphCallback(warmup_steps=3)
    tg, g = run([cb])
    te, e = run([CapturableEager()])
    assert cb.stats.replays > 10, cb.stats.summary()
    _assert_same_training(g, e, tg, te)


# -- located errors in library code ------------------------------------------------------------
def test_capture_error_in_library_code_names_its_line():
    """Lightning's demo LightningTransformer copies a CPU mask to the GPU in every forward."""
    from lightning.pytorch.demos import transformer as demo

    class Demo(demo.LightningTransformer):
        def prepare_data(self):  # the demo downloads WikiText-2 here; the test brings its own tokens
            pass

    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 100, (16,), generator=g), torch.randint(0, 100, (16,), generator=g)) for _ in range(40)]
    pl.seed_everything(0, verbose=False)
    with pytest.raises(CaptureError) as ei:
        fit(Demo(vocab_size=100), [CudaGraphCallback(scope="step")], 10, train_loader=DataLoader(data, batch_size=4))
    err = ei.value
    src = open(demo.__file__).read().splitlines()
    line = next(i + 1 for i, s in enumerate(src) if s.strip() == "mask = self.generate_square_subsequent_mask(t).to(inputs.device)")
    print(f"\nCASE9: {str(err).splitlines()[0][:250]}")
    assert err.location == f"{demo.__file__}:{line}", str(err)
    assert "library code" in str(err) and err.rule == "cpu-tensor", str(err)
