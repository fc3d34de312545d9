"""Graphed training bitwise equal to the user's own eager run with their unmodified torch Adam/AdamW (``optimizer_math=
"eager"``, ``core/user_adam.py``): loss and every parameter, in one process, on CUDA's kernels.

The recipe's GPT module configures ``torch.optim.AdamW(groups, lr, betas)`` (torch's default: the multi-tensor update
on CUDA) with a warm-up + cosine ``LambdaLR``; the forms below change only the optimizer's keywords. The lr is not a
float32 (3e-4): a float32 lr tensor alone would already change the bits.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from _lightning_utils import Recorder, loader, make_module
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from nemo_cudagraph_plugin import CudaGraphCallback

pytestmark = pytest.mark.gpu

LR = 3e-4
FORMS = {
    "adamw-foreach": (torch.optim.AdamW, {}),
    "adam-amsgrad-maximize": (torch.optim.Adam, {"amsgrad": True, "maximize": True, "weight_decay": 0.01}),
}
# graphed with the capturable math and reported (its CUDA division is not mirrored bit for bit)
OTHER_FORMS = {"adamw-for-loop": (torch.optim.AdamW, {"foreach": False})}


def module(form: str, precision: str):
    cls, kw = {**FORMS, **OTHER_FORMS}[form]
    m = make_module(lr=LR, warmup_steps=10, max_steps=200)
    groups_of = type(m).configure_optimizers

    def configure_optimizers(self=m):
        out = groups_of(self)
        opt = out["optimizer"]
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.param_groups]
        user = cls(groups, lr=LR, betas=(0.9, 0.95), **kw)  # the user's optimizer, as they write it
        out["optimizer"] = user
        out["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(user, self.lr_lambda)
        return out

    m.configure_optimizers = configure_optimizers
    return m


def run(graphed: bool, form: str, precision: str, steps: int, ckpt_path=None, callbacks=(), cb_kw=None,
        train_loader=None, **trainer_kw):
    cbs = list(callbacks)
    cb = CudaGraphCallback(**(cb_kw or {})) if graphed else None
    if cb is not None:
        cbs.insert(0, cb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = Recorder()
        trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=steps, callbacks=[*cbs, rec], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, precision=precision, **trainer_kw)
        trainer.fit(module(form, precision), train_dataloaders=train_loader or loader(steps), ckpt_path=ckpt_path)
    params = [p.detach().clone() for p in trainer.lightning_module.parameters()]
    return trainer, rec, params, cb


def assert_bitwise(g, e):
    _, grec, gp, cb = g
    _, erec, ep, _ = e
    assert cb.stats.replays > 0
    assert cb.stats.optimizer_math == "", cb.stats.optimizer_math
    gl, el = grec.loss_tensor(), erec.loss_tensor()
    assert torch.equal(gl, el), f"losses differ from step {int((gl != el).nonzero()[0])}: max |d| {(gl - el).abs().max()}"
    bad = [i for i, (a, b) in enumerate(zip(gp, ep)) if not torch.equal(a, b)]
    assert not bad, f"{len(bad)} parameters differ from the user's eager run"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_clipping_and_a_schedule_200_steps_equal_the_users_eager_run(form, precision):
    kw = dict(gradient_clip_val=1.0)
    assert_bitwise(run(True, form, precision, 200, **kw), run(False, form, precision, 200, **kw))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_fixed_accumulation_equals_the_users_eager_run(form, precision):
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=1.0, train_loader=loader(120))
    assert_bitwise(run(True, form, precision, 60, **kw), run(False, form, precision, 60, **kw))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_an_accumulation_schedule_and_verify_steps_equal_the_users_eager_run(precision):
    sched = lambda: [GradientAccumulationScheduler({0: 1, 1: 2})]  # noqa: E731
    kw = dict(train_loader=loader(40), max_epochs=3)
    g = run(True, "adamw-foreach", precision, 60, callbacks=sched(), cb_kw={"verify_steps": 3}, **kw)
    assert g[3].stats.verified_steps == 3
    assert_bitwise(g, run(False, "adamw-foreach", precision, 60, callbacks=sched(), **kw))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_resume_equals_the_users_resumed_eager_run(tmp_path, precision):
    first = run(False, "adamw-foreach", precision, 30)
    path = tmp_path / "thirty.ckpt"
    first[0].save_checkpoint(path)
    kw = dict(ckpt_path=str(path), train_loader=loader(80))
    assert_bitwise(run(True, "adamw-foreach", precision, 80, **kw), run(False, "adamw-foreach", precision, 80, **kw))


def test_the_for_loop_update_is_reported_as_graphed_with_other_math():
    g = run(True, "adamw-for-loop", "32-true", 20)
    assert g[3].stats.replays > 0 and "for-loop" in g[3].stats.optimizer_math, g[3].stats.optimizer_math


def test_bf16_parameters_are_reported_as_graphed_with_other_math():
    g = run(True, "adamw-foreach", "bf16-true", 20)
    assert g[3].stats.replays > 0
    assert "capturable" in g[3].stats.optimizer_math and "float32" in g[3].stats.optimizer_math
    assert "optimizer math differs" in g[3].stats.summary()
