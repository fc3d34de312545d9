"""``optimizer_math="eager"``: the user's own torch SGD update, captured (``core/user_sgd.py``), on CPU.

torch's SGD takes ``lr`` as a Python float in its last operation, ``p.add_(g, alpha=-lr)``; the captured update reads
``lr`` from a float64 device tensor and computes ``p + float32(-lr) * g`` with one rounding, as torch's kernels do (an
FMA on CUDA and in the CPU's vectorised ``add``). Here the graph is the tape and the kernels are torch's CPU kernels;
the CUDA kernel's rounding is the GPU tier's part (``tests/gpu/test_user_optimizer_gpu.py``).
"""

from __future__ import annotations

import itertools
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from _tape import TapeBackend
from test_lightning_cpu import Rec, Windows
from test_user_adam import UserAdamGPT, _model, _step_side_by_side, interpreted  # noqa: F401  (a fixture)
from torch import nn
from torch.utils.data import DataLoader

from nemo_cudagraph_plugin import CudaGraphCallback
from nemo_cudagraph_plugin.core import user_adam, user_sgd
from nemo_cudagraph_plugin.core.optim import OptimizerPrep
from nemo_cudagraph_plugin.core.user_sgd import UserMathSGD, fma_f32

LR = 3e-4  # not a float32


# ----------------------------------------------------------------------------------------------------------
# the rounding of p + alpha * g
# ----------------------------------------------------------------------------------------------------------
def test_fma_f32_rounds_once_where_a_float64_sum_would_round_twice():
    # 1 + 2^-23 + (1 + 2^-23) * 2^-24 * (1 - 2^-23) = 1 + 3 * 2^-24 - 2^-70: just below a float32 midpoint. A float64
    # sum lands on the midpoint (ties to even: up); one rounding of the exact value goes down.
    c = torch.tensor([1 + 2**-23], dtype=torch.float32)
    a = torch.tensor([1 + 2**-23], dtype=torch.float32)
    b = torch.tensor([2**-24 * (1 - 2**-23)], dtype=torch.float32)
    want = torch.tensor([1 + 2**-23], dtype=torch.float32)
    assert torch.equal(fma_f32(a, b, c), want)
    assert not torch.equal((c.double() + a.double() * b.double()).float(), want)
    # torch's own CPU add with alpha is that one rounding as well (the kernel mirrored on the tape)
    assert torch.equal(c.clone().add_(b, alpha=float(a)), want)


def test_fma_f32_is_torchs_cpu_add_with_alpha_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(1_000_003, generator=g) * 1e-2
    grad = torch.randn(1_000_003, generator=g)
    for lr in (3e-4, 1e-3 * 0.97**7, 0.1, 7.7e-5):
        alpha = torch.tensor(-lr, dtype=torch.float64).to(torch.float32)
        want = p.clone().add_(grad, alpha=-lr)
        assert torch.equal(fma_f32(grad, alpha, p), want)
        assert not torch.equal(p + grad * alpha, want)  # the data tells one rounding from two


def test_the_device_alpha_is_the_float32_a_python_minus_lr_becomes():
    lrs = torch.logspace(-7, 0, 200_000, dtype=torch.float64)
    want = torch.tensor([float(-lr) for lr in lrs.tolist()], dtype=torch.float64).to(torch.float32)
    assert torch.equal((-lrs).to(torch.float32), want)


# ----------------------------------------------------------------------------------------------------------
# the update, against torch's own step
# ----------------------------------------------------------------------------------------------------------
FORMS = [dict(foreach=fe, momentum=mo, dampening=da, nesterov=ne, weight_decay=wd, maximize=mx)
         for fe, mo, da, ne, wd, mx in itertools.product((True, False, None), (0.0, 0.9), (0.0, 0.1), (False, True),
                                                         (0.0, 0.01), (False, True))
         if not (ne and (mo == 0 or da != 0))]  # torch: Nesterov needs momentum and no dampening


@pytest.mark.parametrize("kw", FORMS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_the_update_is_the_users_eager_sgd_step_bit_for_bit(kw):
    a, b = _model(), _model()
    ref, opt = torch.optim.SGD(a.parameters(), lr=LR, **kw), torch.optim.SGD(b.parameters(), lr=LR, **kw)
    user = UserMathSGD(opt, torch.device("cpu"))
    user.install()
    _step_side_by_side(a, ref, b, opt, user)
    if kw["momentum"]:
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(ref.state[p]["momentum_buffer"], opt.state[q]["momentum_buffer"])
    user.remove()
    assert "step" not in opt.__dict__


# ----------------------------------------------------------------------------------------------------------
# Lightning fits on the tape
# ----------------------------------------------------------------------------------------------------------
class UserSGDGPT(UserAdamGPT):
    """The tiny GPT with torch's SGD as a user writes it: float lr, decay on matrices only, warm-up + cosine."""

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        opt = torch.optim.SGD([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=0.05,
                              **self.opt_kw)

        def warm_cos(step):
            return min(1.0, (step + 1) / 3) * 0.5 * (1 + math.cos(math.pi * min(step, 40) / 40))

        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, warm_cos), "interval": "step"}}


def _fit(graphed, opt_kw, cb_kw=None, steps=12, trainer_kw=None):
    pl.seed_everything(0, verbose=False)
    module = UserSGDGPT(opt_kw)
    cb = None
    cbs = []
    if graphed:
        cb = CudaGraphCallback(**(cb_kw or {}))
        cb.step_runner.backend = TapeBackend()
        cbs.append(cb)
    rec = Rec()
    trainer_kw = dict(trainer_kw or {})
    acc = trainer_kw.get("accumulate_grad_batches", 1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=3, callbacks=[*cbs, rec],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, **trainer_kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=DataLoader(Windows(steps * acc), batch_size=2))
    return rec, [p.detach().clone() for p in module.parameters()], cb


CASES = {
    "sgd-foreach-momentum": ({"foreach": True, "momentum": 0.9}, {}),
    "sgd-for-loop-nesterov": ({"momentum": 0.9, "nesterov": True}, {}),  # torch's CPU default
    "sgd-foreach-plain-clip": ({"foreach": True}, {"gradient_clip_val": 0.5}),
    "sgd-foreach-dampening-maximize-accumulate": (
        {"foreach": True, "momentum": 0.8, "dampening": 0.1, "maximize": True},
        {"accumulate_grad_batches": 2}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_graphed_fit_with_the_users_sgd_equals_their_eager_fit_bitwise(case):
    opt_kw, trainer_kw = CASES[case]
    e = _fit(False, opt_kw, trainer_kw=trainer_kw)
    g = _fit(True, opt_kw, trainer_kw=trainer_kw, cb_kw={"verify_steps": 2})
    stats = g[2].stats
    assert stats.replays > 0 and stats.verified_steps == 2
    assert stats.optimizer_math == "", stats.optimizer_math
    assert g[0].losses == e[0].losses, "the graphed losses differ from the user's eager fit"
    assert all(torch.equal(a, b) for a, b in zip(g[1], e[1])), "parameters differ from the user's eager fit"


# ----------------------------------------------------------------------------------------------------------
# what is not covered says why
# ----------------------------------------------------------------------------------------------------------
def test_not_covered_sgd_keeps_the_capturable_preparation_and_says_why(monkeypatch):
    p = nn.Parameter(torch.ones(4))
    cases = [
        (torch.optim.SGD([p], lr=torch.tensor(0.1)), "cpu", False, "tensor lr"),
        (torch.optim.SGD([p], lr=0.1, fused=True), "cpu", False, "param group 0 is fused"),
        (torch.optim.SGD([p], lr=0.1), "cpu", True, "nan_action='skip'"),
        (torch.optim.SGD([nn.Parameter(torch.ones(4, dtype=torch.bfloat16))], lr=0.1), "cpu", False,
         "not a float32 cpu tensor"),
    ]
    for opt, device_type, skip, why in cases:
        assert why in user_sgd.why_not(opt, device_type, skip)

    class MySGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    assert "not torch.optim.SGD with torch's own step" in user_sgd.why_not(MySGD([p], lr=0.1), "cpu")
    monkeypatch.setattr(user_sgd, "triton_available", lambda: False)
    assert "Triton" in user_sgd.why_not(torch.optim.SGD([p], lr=0.1), "cuda")
    plain = torch.optim.SGD([nn.Parameter(torch.ones(4))], lr=LR, momentum=0.9)
    prep = OptimizerPrep(plain, torch.device("cpu"), math="eager")
    prep.apply()
    assert isinstance(prep.user, UserMathSGD) and prep.math_differs == ""
    assert isinstance(plain.param_groups[0]["lr"], float) and not plain.param_groups[0]["fused"]
    prep.restore()
    assert "step" not in plain.__dict__
    fused = torch.optim.SGD([nn.Parameter(torch.ones(4))], lr=LR, fused=True)
    prep = OptimizerPrep(fused, torch.device("cpu"), math="eager")
    prep.apply()
    assert prep.user is None and "param group 0 is fused" in prep.math_differs
    prep.restore()


def test_fused_adam_says_why_no_device_lr_gives_the_users_bits():
    opt = torch.optim.AdamW([nn.Parameter(torch.ones(4))], lr=LR, fused=True)
    why = user_adam.why_not(opt, "cpu")
    assert "fused" in why and "float64 kernel argument" in why and "as float32" in why


def test_adam_with_fused_false_and_foreach_unset_runs_the_for_loop_update_on_cuda(monkeypatch):
    # torch's adam(): foreach unset and fused=False is its for-loop update, not its default (multi-tensor on CUDA)
    monkeypatch.setattr(user_adam, "triton_available", lambda: True)
    p = nn.Parameter(torch.ones(4))
    assert "for-loop" in user_adam.why_not(torch.optim.AdamW([p], lr=LR, fused=False), "cuda")
    assert "for-loop" not in (user_adam.why_not(torch.optim.AdamW([p], lr=LR), "cuda") or "")


# ----------------------------------------------------------------------------------------------------------
# the kernel (Triton's interpreter on the CPU)
# ----------------------------------------------------------------------------------------------------------
def test_the_sgd_tail_kernel_rounds_as_torchs_add_with_alpha(interpreted):  # noqa: F811
    from nemo_cudagraph_plugin.core import adam_tail
    from nemo_cudagraph_plugin.core.adam_tail import EagerSgdTail

    adam_tail._sgd_kernel.cache_clear()
    g = torch.Generator().manual_seed(1)
    sizes = [1, 31, 32, 33, 100, 2000]
    ps = [torch.randn(n, generator=g) * 1e-2 for n in sizes]
    gs = [torch.randn(n, generator=g) for n in sizes]
    alpha = torch.tensor(-3e-4 * 0.97**5, dtype=torch.float64).to(torch.float32)
    want = [p.clone().add_(gr, alpha=float(alpha)) for p, gr in zip(ps, gs)]  # the CPU's FMA
    two = [p + gr * alpha for p, gr in zip(ps, gs)]
    EagerSgdTail(block=16, iters=2, num_warps=1)(ps, gs, alpha)
    adam_tail._sgd_kernel.cache_clear()
    for j, (p, w) in enumerate(zip(ps, want)):
        assert torch.equal(p, w), f"tensor {j}: {(p != w).sum()} elements differ"
    assert not torch.equal(want[-1], two[-1])  # the data tells an FMA from a multiply and an add


# ----------------------------------------------------------------------------------------------------------
# where the graphed math is not the user's: by how much
# ----------------------------------------------------------------------------------------------------------
def test_where_the_math_differs_the_first_verified_step_measures_by_how_much():
    from test_user_adam import _fit as adam_fit

    # nan_action="skip": the fused kernel with a float32 lr tensor is graphed instead of the user's multi-tensor update
    skip = {"verify_steps": 2, "nan_action": "skip"}
    g = adam_fit(True, {"foreach": True}, cb_kw=skip)
    stats = g[2].stats
    assert stats.verified_steps == 2 and "nan_action='skip'" in stats.optimizer_math
    gap_abs, gap_rel = stats.optimizer_math_gap
    assert 0 < gap_abs and 0 < gap_rel < 1e-4, stats.optimizer_math_gap  # a few float32 roundings apart
    text = stats.optimizer_math_text()
    assert text.startswith("optimizer math differs from your eager step: the plugin's capturable update")
    assert f"differ from your own step's by up to {gap_abs:.3g}" in text and text in stats.summary()
    # unmeasured: the summary says how to measure it; the user's own math: nothing to say, nothing run
    assert "verify_steps >= 1 measures" in adam_fit(True, {"foreach": True}, cb_kw={"nan_action": "skip"})[2].stats.summary()
    own = _fit(True, CASES["sgd-foreach-momentum"][0], cb_kw={"verify_steps": 2})[2].stats
    assert own.optimizer_math_gap is None and own.optimizer_math_text() == "" and "optimizer math" not in own.summary()


def test_the_users_settings_are_back_only_inside_the_block():
    a = torch.optim.AdamW([nn.Parameter(torch.ones(4))], lr=LR, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(a, lambda step: 0.97 ** step)  # made before the fit, as in Lightning
    prep = OptimizerPrep(a, torch.device("cpu"), math="eager")
    prep.apply()
    g = a.param_groups[0]
    assert isinstance(g["lr"], torch.Tensor)
    tensor = g["lr"]
    for step in range(1, 4):
        a.step()
        sched.step()  # fills the tensor with the float it computes: the tensor keeps its float32 rounding
        assert float(tensor) != LR * 0.97 ** step
        with prep.users_step():
            assert g["lr"] == LR * 0.97 ** step and isinstance(g["lr"], float) and g["capturable"] is False
        assert g["lr"] is tensor and g["capturable"] is True
    g["lr"] = LR * 0.5  # a float assigned by the user's code, copied into the tensor
    prep.sync_hyperparams()
    with prep.users_step():
        assert g["lr"] == LR * 0.5
    assert g["lr"] is tensor
    # a state_dict copied or saved meanwhile holds plain tensors (it loads without the plugin)
    import copy
    import io

    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    for sd in (copy.deepcopy(a.state_dict()), torch.load(buf)):
        assert type(sd["param_groups"][0]["lr"]) is torch.Tensor
    prep.restore()
    plain = torch.optim.SGD([nn.Parameter(torch.ones(4))], lr=LR)
    prep = OptimizerPrep(plain, torch.device("cpu"), math="eager")
    prep.apply()
    assert prep.users_step() is None  # the graphed update is the user's own
    prep.restore()


def test_an_empty_parameter_is_left_alone_as_torch_leaves_it():
    def params():
        return [nn.Parameter(torch.zeros(0)), nn.Parameter(torch.linspace(-1, 1, 7))]

    a, b = params(), params()
    ref, opt = torch.optim.SGD(a, lr=LR, momentum=0.9), torch.optim.SGD(b, lr=LR, momentum=0.9)
    user = UserMathSGD(opt, torch.device("cpu"))
    user.install()
    for _ in range(3):
        for ps, o in ((a, ref), (b, opt)):
            for p in ps:
                p.grad = torch.ones_like(p) * 0.3
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and b[0].numel() == 0
