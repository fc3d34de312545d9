"""``optimizer_math="eager"``: the user's own torch Adam/AdamW update, captured (``core/user_adam.py``), on CPU.

Graphed training must give the bits of the user's eager run with their unmodified optimizer. Here the graph is the tape
(``tests/_tape.py``) and the kernels are torch's CPU kernels, so these tests prove the scalar path: every number torch's
Python computes on the host (bias corrections, step size, decay factor) reaches the kernels as the same float32 from
device memory, from the host's own float64 values. That the CUDA kernels' rounding is mirrored too is the GPU tier's part
(``tests/gpu/test_user_optimizer_gpu.py``).
"""

from __future__ import annotations

import importlib
import itertools
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from _tape import TapeBackend
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from test_lightning_cpu import CFG, Rec, TinyGPT, Windows
from torch import nn
from torch.utils.data import DataLoader

from nemo_cudagraph_plugin import CudaGraphCallback
from nemo_cudagraph_plugin.core import user_adam
from nemo_cudagraph_plugin.core.optim import OptimizerPrep
from nemo_cudagraph_plugin.core.user_adam import SLOTS, ScalarTable, UserMathAdam, device_scalars

LR = 3e-4  # not a float32: a float32 lr tensor would already change the update


# ----------------------------------------------------------------------------------------------------------
# the scalars, against torch's own host computation
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta1,beta2,lr,wd", [(0.9, 0.999, 1e-3, 0.01), (0.9, 0.95, 3e-4, 0.1),
                                               (0.8, 0.99, 7.7e-5, 0.0), (0.95, 0.9999, 2.5e-2, 1e-4)])
def test_device_scalars_are_torchs_host_scalars_bit_for_bit_over_a_million_steps(beta1, beta2, lr, wd):
    steps = range(1, 10**6 + 1)
    # torch's non-capturable multi-tensor update, as its Python computes them (torch/optim/adam.py)
    bc1 = [1 - beta1 ** float(k) for k in steps]
    want_step = torch.tensor([(lr / b) * -1 for b in bc1], dtype=torch.float64).to(torch.float32)
    want_bc2s = torch.tensor([(1 - beta2 ** float(k)) ** 0.5 for k in steps], dtype=torch.float64).to(torch.float32)
    table = ScalarTable(beta1, beta2, torch.device("cpu"))
    lr_t = torch.tensor(lr, dtype=torch.float64)
    got_step, got_bc2s = [], []
    for start in range(1, 10**6 + 1, SLOTS // 2):  # the ring, filled ahead as training goes
        stop = min(start + SLOTS // 2, 10**6 + 1)
        table.fill_to(stop - 1)
        s, b = device_scalars(table.values, torch.arange(start, stop, dtype=torch.float32), lr_t)
        got_step.append(s)
        got_bc2s.append(b)
    assert torch.equal(torch.cat(got_step), want_step)
    assert torch.equal(torch.cat(got_bc2s), want_bc2s)
    want_decay = torch.tensor(1 - lr * wd, dtype=torch.float64).to(torch.float32)
    assert torch.equal(user_adam.decay_factor(lr_t, wd), want_decay)


def test_the_decay_factor_is_the_hosts_double_rounded_once_to_float32():
    lrs = torch.logspace(-6, -1, 100_000, dtype=torch.float64)
    for wd in (0.1, 0.01, 0.05):
        want = torch.tensor([1 - lr * wd for lr in lrs.tolist()], dtype=torch.float64).to(torch.float32)
        assert torch.equal(user_adam.decay_factor(lrs, wd), want)


def test_the_table_holds_the_hosts_pow_not_a_device_pow():
    # the host's (1 - b2 ** k) ** 0.5 is libm pow(x, 0.5), which need not be sqrt(x) rounded; the table keeps the former
    table = ScalarTable(0.9, 0.999, torch.device("cpu"))
    table.fill_to(5000)
    k = torch.arange(1, 5001)
    host = torch.tensor([(1 - 0.999 ** float(i)) ** 0.5 for i in k.tolist()], dtype=torch.float64)
    assert torch.equal(table.values[1, k], host)


# ----------------------------------------------------------------------------------------------------------
# the update, against torch's own step
# ----------------------------------------------------------------------------------------------------------
def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _step_side_by_side(a, ref, b, opt, user, steps=20):
    """Train ``a`` with torch's own optimizer ``ref`` and ``b`` with ``opt`` whose step ``user`` captured, on the same
    batches, a schedule assigning float learning rates; the parameters must agree bit for bit."""
    x = torch.randn(8, 16)
    for i in range(steps):
        for m, o in ((a, ref), (b, opt)):
            o.zero_grad()
            m(x * (1 + i % 3)).square().mean().backward()
            for g in o.param_groups:
                g["lr"] = LR * 0.97 ** i  # a schedule assigning floats
        user.sync()
        ref.step()
        opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("cls,foreach,amsgrad,maximize,wd", [
    (cls, fe, ams, mx, wd) for cls, fe, ams, mx, wd in itertools.product(
        (torch.optim.AdamW, torch.optim.Adam), (True, False, None), (False, True), (False, True), (0.0, 0.1))])
def test_the_update_is_the_users_eager_step_bit_for_bit(cls, foreach, amsgrad, maximize, wd):
    a, b = _model(), _model()
    kw = dict(lr=LR, betas=(0.9, 0.95), weight_decay=wd, foreach=foreach, amsgrad=amsgrad, maximize=maximize)
    ref, opt = cls(a.parameters(), **kw), cls(b.parameters(), **kw)
    user = UserMathAdam(opt, torch.device("cpu"))
    user.install()
    _step_side_by_side(a, ref, b, opt, user)
    user.remove()
    assert "step" not in opt.__dict__


# ----------------------------------------------------------------------------------------------------------
# Lightning fits on the tape
# ----------------------------------------------------------------------------------------------------------
class UserAdamGPT(TinyGPT):
    """The tiny GPT with the optimizer a user writes: torch's AdamW, float lr, warm-up + cosine."""

    def __init__(self, opt_kw=None, schedule=True):
        super().__init__()
        self.opt_kw = opt_kw or {}
        self.schedule = schedule

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        kw = {"lr": LR, "betas": (0.9, 0.95), **self.opt_kw}
        if callable(kw["lr"]):  # a tensor lr: a new one for each fit (a scheduler writes it in place)
            kw["lr"] = kw["lr"]()
        cls = kw.pop("cls", torch.optim.AdamW)
        opt = cls([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], **kw)
        if not self.schedule:
            return opt

        def warm_cos(step):
            return min(1.0, (step + 1) / 3) * 0.5 * (1 + math.cos(math.pi * min(step, 40) / 40))

        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, warm_cos), "interval": "step"}}


def _fit(graphed, opt_kw=None, cb_kw=None, steps=12, callbacks=(), ckpt_path=None, trainer_kw=None, batches=None):
    pl.seed_everything(0, verbose=False)
    module = UserAdamGPT(opt_kw)
    cbs = list(callbacks)
    cb = None
    if graphed:
        cb = CudaGraphCallback(**(cb_kw or {}))
        cb.step_runner.backend = TapeBackend()
        cbs.insert(0, cb)
    rec = Rec()
    trainer_kw = dict(trainer_kw or {})
    acc = trainer_kw.get("accumulate_grad_batches", 1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=3, callbacks=[*cbs, rec],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, **trainer_kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=DataLoader(Windows(batches or steps * acc), batch_size=2),
                    ckpt_path=ckpt_path)
    return rec, [p.detach().clone() for p in module.parameters()], cb, trainer


def _same(g, e):
    (grec, gp, _, _), (erec, ep, _, _) = g, e
    return grec.losses == erec.losses and all(torch.equal(a, b) for a, b in zip(gp, ep))


CASES = {
    "adamw-foreach": ({"foreach": True}, {}),
    "adamw-for-loop": ({}, {}),  # torch's default on CPU tensors
    "adam-amsgrad-maximize": ({"cls": torch.optim.Adam, "foreach": True, "amsgrad": True}, {}),
    "adamw-foreach-clip": ({"foreach": True}, {"gradient_clip_val": 0.5}),
    "adamw-foreach-accumulate": ({"foreach": True}, {"accumulate_grad_batches": 2}),
    "adamw-foreach-bf16-true": ({"foreach": True}, {"precision": "bf16-true"}),
    "adam-for-loop-amsgrad-bf16-true": ({"cls": torch.optim.Adam, "amsgrad": True}, {"precision": "bf16-true"}),
    # a tensor lr with foreach unset: torch runs its for-loop update with tensor operations on the lr
    "adamw-tensor-lr": ({"lr": lambda: torch.tensor(LR)}, {}),
    "adamw-tensor-lr-float64-clip": ({"lr": lambda: torch.tensor(LR, dtype=torch.float64)}, {"gradient_clip_val": 0.5}),
    "adam-tensor-lr-amsgrad-bf16-true": ({"cls": torch.optim.Adam, "amsgrad": True, "weight_decay": 0.01,
                                         "lr": lambda: torch.tensor(LR)}, {"precision": "bf16-true"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_graphed_fit_with_the_users_adamw_equals_their_eager_fit_bitwise(case):
    opt_kw, trainer_kw = CASES[case]
    e = _fit(False, opt_kw, trainer_kw=trainer_kw)
    g = _fit(True, opt_kw, trainer_kw=trainer_kw)
    stats = g[2].stats
    assert stats.replays > 0 and stats.optimizer_math == ""
    assert _same(g, e), "the graphed fit differs from the user's eager fit"


@pytest.mark.parametrize("math_", ["capturable", "eager"])
def test_only_the_eager_math_reproduces_the_users_run(monkeypatch, math_):
    # torch refuses capturable=True on CPU parameters (a device check only): lifted for this comparison
    monkeypatch.setattr(importlib.import_module("torch.optim.adam"), "_get_capturable_supported_devices",
                        lambda supports_xla=True: ["cuda", "cpu"])
    a, b = _model(), _model()
    ref = torch.optim.AdamW(a.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    opt = torch.optim.AdamW(b.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    prep = OptimizerPrep(opt, torch.device("cpu"), math=math_)
    prep.apply()  # what a graph replays is this optimizer's step (the tape fits above: the eager math's)
    x = torch.randn(8, 16)
    for i in range(10):
        for m, o in ((a, ref), (b, opt)):
            o.zero_grad()
            m(x * (1 + i % 3)).square().mean().backward()
        prep.sync_hyperparams()
        ref.step()
        opt.step()
    same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert same == (math_ == "eager")  # float32 lr and device bias corrections do not give the user's bits
    prep.restore()


def test_an_accumulation_schedule_and_verify_steps_against_the_users_step():
    sched = lambda: [GradientAccumulationScheduler({0: 1, 1: 2})]  # noqa: E731  (epochs of 8 batches)
    e = _fit(False, {"foreach": True}, callbacks=sched(), batches=8)
    g = _fit(True, {"foreach": True}, cb_kw={"verify_steps": 3}, callbacks=sched(), batches=8)
    assert g[2].stats.verified_steps == 3
    assert _same(g, e)


@pytest.mark.parametrize("opt_kw", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_resume_from_a_checkpoint_equals_the_users_resumed_eager_fit(tmp_path, opt_kw):
    first = _fit(False, opt_kw, steps=6)
    path = tmp_path / "six.ckpt"
    first[3].save_checkpoint(path)
    e = _fit(False, opt_kw, steps=14, ckpt_path=str(path))
    g = _fit(True, opt_kw, steps=14, ckpt_path=str(path))
    assert g[2].stats.replays > 0
    assert _same(g, e)


def test_not_covered_optimizers_keep_the_capturable_preparation_and_say_why():
    p, q = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    mixed = torch.optim.AdamW([{"params": [p], "fused": True}, {"params": [q], "fused": False}], lr=LR)
    prep = OptimizerPrep(mixed, torch.device("cpu"), math="eager")
    prep.apply()
    assert prep.user is None and "fused while another is not" in prep.math_differs
    prep.restore()
    plain = torch.optim.AdamW([nn.Parameter(torch.ones(4))], lr=LR, foreach=True)
    prep = OptimizerPrep(plain, torch.device("cpu"), math="eager")
    prep.apply()
    assert prep.user is not None and prep.math_differs == "" and isinstance(plain.param_groups[0]["lr"], float)
    prep.restore()
    assert "step" not in plain.__dict__


def test_the_table_is_filled_ahead_and_counters_are_read_only_when_they_may_leave_the_ring(monkeypatch):
    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=LR, foreach=True)
    count = [0]
    user = UserMathAdam(opt, torch.device("cpu"), step_count=lambda: count[0])
    user.install()
    p.grad = torch.ones(4)
    opt.step()  # the state (a counter at 1)
    count[0] += 1
    reads = []
    real = user._read_counters
    monkeypatch.setattr(user, "_read_counters", lambda: reads.append(1) or real())
    for _ in range(SLOTS):  # the host counts steps the device never took: its bound runs ahead of the counter
        count[0] += 1
        user.sync()
        assert user.groups[0].table.filled_to >= user.groups[0].hi + count[0] - user._count0 + 1
    assert 1 <= len(reads) <= 2  # one read per SLOTS - CHUNK steps of spread, none per step
    assert CFG.n_embd  # the shared GPT config is importable (the fits above use it)


# ----------------------------------------------------------------------------------------------------------
# the kernel (Triton's interpreter on the CPU)
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def interpreted(monkeypatch):
    import os

    from nemo_cudagraph_plugin.core import adam_tail

    if os.environ.get("NCG_REQUIRE_TRITON") == "1":
        importlib.import_module("triton")
    else:
        pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    adam_tail._eager_kernel.cache_clear()
    yield
    adam_tail._eager_kernel.cache_clear()


def test_the_eager_tail_kernel_rounds_as_torchs_cuda_addcdiv(interpreted):
    from nemo_cudagraph_plugin.core.adam_tail import EagerAdamTail

    g = torch.Generator().manual_seed(1)
    sizes = [1, 31, 32, 33, 100, 200]
    ps = [torch.randn(n, generator=g) * 1e-3 for n in sizes]  # updates of their size: roundings show
    ms = [torch.randn(n, generator=g) * 1e-2 for n in sizes]
    vs = [torch.rand(n, generator=g) * 1e-4 + 1e-12 for n in sizes]
    step_size = torch.tensor([-5.2631e-4, -1e-3, -3.3e-4, -2e-3, -7.1e-4, -1e-4], dtype=torch.float32)
    bc2s = torch.tensor([0.0447, 0.1, 0.3, 0.99, 0.5, 0.7], dtype=torch.float32)
    before = [p.clone() for p in ps]
    EagerAdamTail(block=16, iters=2, num_warps=1)(ps, ms, vs, bc2s, step_size, 1e-8)
    f32 = lambda x: x.to(torch.float32).to(torch.float64)  # noqa: E731  (round to float32, keep computing exactly)
    for j, (p, p0, m, v) in enumerate(zip(ps, before, ms, vs)):
        # _foreach_sqrt, _foreach_div_ by the float32 scalar, _foreach_add_(eps): each rounded
        d = v.double()
        d = f32(f32(f32(d.sqrt()) / bc2s[j].double()) + f32(torch.tensor(1e-8, dtype=torch.float64)))
        q = f32(m.double() / d)
        # one rounding of p + s * q (an FMA); s * q is exact in float64, the float64 sum then rounds once more (a
        # float32 tie after it has probability ~2^-29 per element)
        want = (p0.double() + step_size[j].double() * q).to(torch.float32)
        two_roundings = f32(p0.double() + f32(step_size[j].double() * q)).float()
        assert torch.equal(p, want), f"tensor {j}: {(p != want).sum()} elements differ"
        if j == len(sizes) - 1:
            assert not torch.equal(want, two_roundings)  # the data tells an FMA from a multiply and an add


def test_the_eager_tail_and_scale_kernels_on_bf16_round_each_operation_as_torchs_cuda_kernels(interpreted):
    from nemo_cudagraph_plugin.core import adam_tail
    from nemo_cudagraph_plugin.core.adam_tail import EagerAdamTail
    from nemo_cudagraph_plugin.core.user_sgd import fma_f32

    adam_tail._scale_kernel.cache_clear()
    g = torch.Generator().manual_seed(2)
    sizes = [1, 31, 32, 33, 100, 2000]
    ps = [(torch.randn(n, generator=g) * 1e-1).bfloat16() for n in sizes]
    ms = [(torch.randn(n, generator=g) * 1e-2).bfloat16() for n in sizes]
    vs = [(torch.rand(n, generator=g) * 1e-4 + 1e-12).bfloat16() for n in sizes]
    step_size = torch.tensor([-5.2631e-2, -1e-1, -3.3e-2, -2e-1, -7.1e-2, -1e-1], dtype=torch.float32)
    bc2s = torch.tensor([0.0447, 0.1, 0.3, 0.99, 0.5, 0.7], dtype=torch.float32)
    before = [p.clone() for p in ps]
    tail = EagerAdamTail(block=16, iters=2, num_warps=1)
    tail(ps, ms, vs, bc2s, step_size, 1e-8)
    bf = lambda x: x.to(torch.bfloat16).float()  # noqa: E731  (a float32 result stored as BFloat16)
    eps = torch.tensor(1e-8, dtype=torch.float32)
    for j, (p, p0, m, v) in enumerate(zip(ps, before, ms, vs)):
        # _foreach_sqrt, _foreach_div_ by the float32 scalar, _foreach_add_(eps): float32 each, stored as BFloat16
        d = bf(bf(bf(v.float().sqrt()) / bc2s[j]) + eps)
        q = m.float() / d
        want = fma_f32(step_size[j].expand_as(q), q, p0.float()).to(torch.bfloat16)  # addcdiv: one FMA, then stored
        assert torch.equal(p, want), f"tensor {j}: {(p != want).sum()} elements differ"
        if j == len(sizes) - 1:  # the data tells the intermediate roundings apart from a float32 denominator
            d32 = v.float().sqrt() / bc2s[j] + eps
            assert not torch.equal(want, fma_f32(step_size[j].expand_as(q), m.float() / d32, p0.float()).bfloat16())
    factor = torch.tensor(1 - 3.7e-2 * 0.1, dtype=torch.float64).to(torch.float32)
    before = [p.clone() for p in ps]
    tail.scale(ps, factor)
    adam_tail._scale_kernel.cache_clear()
    for p, p0 in zip(ps, before):  # torch's mul_ of BFloat16 by a Python float: float32 product, stored once
        assert torch.equal(p, (p0.float() * factor).bfloat16())
        assert torch.equal(p, p0.clone().mul_(float(factor)))
    assert not torch.equal(ps[-1], before[-1])
    # what CUDA's mul_ with a float32 0-d tensor computes (the factor rounded to BFloat16 first) differs
    assert not torch.equal(ps[-1], (before[-1].float() * factor.bfloat16().float()).bfloat16())


def test_the_for_loop_reciprocal_is_formed_in_double_or_in_float32_as_asked_bit_for_bit():
    # CUDA's division by a Python float multiplies by a reciprocal the host forms: ``float32(1.0 / x)`` (the double's,
    # rounded once) or ``1.0f / float32(x)``; device_scalars forms the one asked for, and the two differ on some steps
    n = 20_000
    table = ScalarTable(0.9, 0.999, torch.device("cpu"))
    table.fill_to(n)
    steps = torch.arange(1, n + 1, dtype=torch.float32)
    lr = torch.tensor(LR, dtype=torch.float64)
    bc2s = [(1 - 0.999 ** float(k)) ** 0.5 for k in range(1, n + 1)]
    want_double = torch.tensor([1.0 / b for b in bc2s], dtype=torch.float64).to(torch.float32)
    want_float = torch.ones((), dtype=torch.float32) / torch.tensor(bc2s, dtype=torch.float64).to(torch.float32)
    _, got_double = device_scalars(table.values, steps, lr, "double")
    _, got_float = device_scalars(table.values, steps, lr, "float32")
    assert torch.equal(got_double, want_double)
    assert torch.equal(got_float, want_float)
    assert int((got_double != got_float).sum()) > 100  # the steps tell the two apart


def test_the_division_probe_names_each_form_of_torchs_division_by_a_python_float():
    from nemo_cudagraph_plugin.core._torch_compat import _PROBE_DIVISOR, scalar_division, scalar_division_kind

    x = torch.linspace(1, 2, 4097)
    b = torch.tensor(_PROBE_DIVISOR, dtype=torch.float64)
    assert scalar_division_kind(x, _PROBE_DIVISOR, x / _PROBE_DIVISOR) == "divide"  # the CPU's kernel
    assert scalar_division(torch.device("cpu")) == "divide"
    assert scalar_division_kind(x, _PROBE_DIVISOR, x * (1.0 / b).to(torch.float32)) == "double"
    assert scalar_division_kind(x, _PROBE_DIVISOR, x * (1.0 / b.to(torch.float32))) == "float32"
    assert scalar_division_kind(x, _PROBE_DIVISOR, (x.double() / b).to(torch.float32)) is None  # in double: none


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_the_for_loop_denominator_multiplies_by_the_reciprocal_as_torchs_cuda_division(interpreted, dtype):
    # torch's for-loop update: ``d = (v.sqrt() / bc2s).add_(eps)`` with a Python float bc2s, which CUDA's division by
    # a CPU scalar computes as ``v.sqrt() * inv``, ``inv`` a float32 reciprocal formed on the host (here the double's,
    # rounded once); then ``p.addcdiv_(m, d, value=s)``
    from nemo_cudagraph_plugin.core.adam_tail import EagerAdamTail
    from nemo_cudagraph_plugin.core.user_sgd import fma_f32

    g = torch.Generator().manual_seed(3)
    sizes = [1, 31, 32, 33, 100, 2000, 64]
    ps = [(torch.randn(n, generator=g) * 1e-3).to(dtype) for n in sizes]
    ms = [(torch.randn(n, generator=g) * 1e-2).to(dtype) for n in sizes]
    vs = [(torch.rand(n, generator=g) * 1e-4 + 1e-12).to(dtype) for n in sizes]
    # a BFloat16 square root has 8 significant bits: its quotient and its product with the reciprocal round to
    # different BFloat16 for some divisors only, as bf16(sqrt(v)) = 0.01153564453125 with 0.9287469387054443
    vs[-1] = torch.tensor([1.3256072998046875e-4, 1.33514404296875e-4]).repeat(32).to(dtype)
    bc2s64 = torch.tensor([(1 - b2 ** k) ** 0.5 for b2, k in [(0.95, 3), (0.999, 1000), (0.95, 100), (0.999, 3),
                                                               (0.95, 7), (0.999, 5000)]] + [0.9287469387054443],
                          dtype=torch.float64)
    bc2s = bc2s64.float()
    scale = 1.0 if dtype == torch.float32 else 100.0  # BFloat16: updates above the parameters' rounding
    step_size = torch.tensor([-3e-4 * scale / (1 - 0.9 ** k) for k in (3, 1000, 100, 3, 7, 5000, 1)],
                             dtype=torch.float64).float()
    recips = (1.0 / bc2s64).to(torch.float32)  # what device_scalars(kind="double") forms
    before = [p.clone() for p in ps]
    EagerAdamTail(block=16, iters=2, num_warps=1)(ps, ms, vs, recips, step_size, 1e-8, reciprocal=True)
    eps = torch.tensor(1e-8, dtype=torch.float32)
    bf = lambda x: x.to(torch.bfloat16).float() if dtype == torch.bfloat16 else x  # noqa: E731  (stored as dtype)
    told_apart = 0
    for j, (p, p0, m, v) in enumerate(zip(ps, before, ms, vs)):
        inv = torch.tensor(1.0 / bc2s64[j].item(), dtype=torch.float64).to(torch.float32)  # the host's, once
        sqrt = bf(v.double().sqrt().float())  # sqrtf: correctly rounded
        d = bf(bf(sqrt * inv) + eps)  # float32 multiply, float32 add
        # addcdiv: an IEEE division, then one rounding of p + s * q (an FMA), stored once
        want = fma_f32(step_size[j].expand_as(d), m.float() / d, p0.float()).to(dtype)
        assert torch.equal(p, want), f"tensor {j}: {(p != want).sum()} elements differ"
        d_div = bf(bf(sqrt / bc2s[j]) + eps)  # a true division by the float32 divisor (the multi-tensor path's)
        told_apart += int((fma_f32(step_size[j].expand_as(d), m.float() / d_div, p0.float()).to(dtype) != want).sum())
    assert told_apart > (20 if dtype == torch.float32 else 10)  # the data tells the reciprocal from a division


def test_warm_compiles_every_kernel_variant_the_update_launches(monkeypatch):
    # a capture must never meet a variant not compiled before it (compiling and loading a module while it captures)
    from nemo_cudagraph_plugin.core.adam_tail import EagerAdamTail

    monkeypatch.setattr(user_adam, "scalar_division", lambda device: "double")  # CUDA's for-loop division, on the CPU

    class Spy(EagerAdamTail):
        def __init__(self):
            super().__init__()
            self.launched = set()

        def __call__(self, params, exp_avgs, exp_avg_sqs, bc2s, step_size, eps, reciprocal=False):
            self.launched.add(("tail", params[0].dtype, reciprocal))

        def scale(self, params, factor):
            self.launched.add(("scale", params[0].dtype))

    dtypes = [torch.bfloat16, torch.float32]
    warmed = Spy()
    warmed.warm(torch.device("cpu"), dtypes)
    used = Spy()
    for dtype, foreach, amsgrad in itertools.product(dtypes, (True, False), (True, False)):
        ps = [torch.zeros(32, dtype=dtype) for _ in range(2)]
        state = [[torch.zeros(32, dtype=dtype) for _ in ps] for _ in range(3)]
        table = ScalarTable(0.9, 0.95, torch.device("cpu"))
        table.fill_to(4)
        user_adam.update(ps, [torch.ones(32, dtype=dtype) for _ in ps], *state, [torch.zeros(()) for _ in ps],
                         foreach=foreach, amsgrad=amsgrad, maximize=False, beta1=0.9, beta2=0.95,
                         lr=torch.tensor(LR, dtype=torch.float64), weight_decay=0.1, eps=1e-8,
                         decoupled_weight_decay=True, table=table.values, tail=used)
    assert {("tail", d, r) for d in dtypes for r in (False, True)} <= used.launched  # both forms ran
    assert used.launched <= warmed.launched, used.launched - warmed.launched


def test_the_for_loop_update_on_cuda_keeps_the_users_math(monkeypatch):
    from nemo_cudagraph_plugin.core.user_adam import why_not

    # as on a GPU host: Triton there, the parameters' device check passed as for CUDA tensors, and CUDA's division by a
    # Python float a multiply by the reciprocal formed in double
    real = user_adam.plain_float32_params
    monkeypatch.setattr(user_adam, "triton_available", lambda: True)
    monkeypatch.setattr(user_adam, "plain_float32_params", lambda i, g, device_type, *a: real(i, g, "cpu", *a))
    monkeypatch.setattr(user_adam, "scalar_division", lambda device: "double")
    p = nn.Parameter(torch.ones(4))
    for kw in ({"foreach": False}, {"fused": False}, {"foreach": True}, {}):
        assert why_not(torch.optim.AdamW([p], lr=LR, **kw), "cuda") is None, kw
        assert why_not(torch.optim.AdamW([p], lr=LR, **kw), "cpu") is None, kw
    # a torch whose CUDA division by a Python float is none of the known forms: the for-loop update is not claimed
    monkeypatch.setattr(user_adam, "scalar_division", lambda device: None)
    assert "divides by a Python float" in why_not(torch.optim.AdamW([p], lr=LR, foreach=False), "cuda")
    assert why_not(torch.optim.AdamW([p], lr=LR, foreach=True), "cuda") is None  # the multi-tensor one divides
    monkeypatch.setattr(user_adam, "triton_available", lambda: False)
    assert "Triton is not available" in why_not(torch.optim.AdamW([p], lr=LR, foreach=False), "cuda")


@pytest.mark.parametrize("cls,dtype,amsgrad,maximize,wd", [
    (cls, dt, ams, mx, wd) for cls, dt, ams, mx, wd in itertools.product(
        (torch.optim.AdamW, torch.optim.Adam), (torch.float32, torch.float64), (False, True), (False, True),
        (0.0, 0.1))])
def test_a_tensor_lr_update_is_the_users_eager_for_loop_step_bit_for_bit(cls, dtype, amsgrad, maximize, wd):
    # torch's for-loop update with a tensor lr: ``1 - lr * wd`` and ``lr / bias_correction1`` are tensor operations
    # in the lr's dtype; a schedule writes the tensors in place, and once a new tensor is assigned
    a, b = _model(), _model()
    kw = dict(betas=(0.9, 0.95), weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    ref = cls(a.parameters(), lr=torch.tensor(LR, dtype=dtype), **kw)
    opt = cls(b.parameters(), lr=torch.tensor(LR, dtype=dtype), **kw)
    assert user_adam.why_not(opt, "cpu") is None
    user = UserMathAdam(opt, torch.device("cpu"))
    user.install()
    x = torch.randn(8, 16)
    for i in range(20):
        for m, o in ((a, ref), (b, opt)):
            o.zero_grad()
            m(x * (1 + i % 3)).square().mean().backward()
            for g in o.param_groups:
                if i == 11:
                    g["lr"] = torch.tensor(LR * 0.5, dtype=dtype)  # a new tensor: the copy follows it
                else:
                    g["lr"].fill_(LR * 0.97 ** i)
        assert user.sync() is None  # same kind: no re-capture
        ref.step()
        opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    user.remove()


def test_a_tensor_lr_that_changes_kind_asks_for_a_new_capture():
    opt = torch.optim.AdamW(_model().parameters(), lr=torch.tensor(LR))
    user = UserMathAdam(opt, torch.device("cpu"))
    user.install()
    assert user.sync() is None
    opt.param_groups[0]["lr"] = torch.tensor(LR, dtype=torch.float64)
    assert "float64 tensor" in user.sync()
    opt.param_groups[0]["lr"] = 1e-4
    assert "now a float" in user.sync()
    opt.param_groups[0]["lr"] = torch.tensor(LR)
    assert "float32 tensor" in user.sync() and user.sync() is None
    user.remove()


def test_a_tensor_lr_keeps_the_capturable_math_where_torch_does_not_run_the_for_loop_or_the_tensor_is_odd():
    p = nn.Parameter(torch.ones(4))
    assert "tensor lr" in user_adam.why_not(torch.optim.AdamW([p], lr=torch.tensor(LR, requires_grad=True)), "cpu")
    assert "tensor lr" in user_adam.why_not(torch.optim.AdamW([p], lr=torch.tensor(LR, dtype=torch.bfloat16)), "cpu")
    assert "tensor betas" in user_adam.why_not(
        torch.optim.AdamW([p], lr=LR, betas=(torch.tensor(0.9), torch.tensor(0.99))), "cpu")
    assert user_adam.why_not(torch.optim.AdamW([p], lr=torch.tensor(LR)), "cpu") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_host_tensor_lr_with_gpu_parameters_computes_its_decay_factor_as_the_cpu_does(dtype):
    # the user's lr on the CPU while the parameters are on a GPU: torch computes ``1 - lr * wd`` and ``lr / bc1``
    # with the CPU's kernels; the copy forms the same on the host (the factor) and divides as the CPU does
    lr = torch.tensor(3e-4, dtype=dtype)
    tl = user_adam.TensorLr(lr, torch.device("cpu"))
    tl.on_host = True  # as with CUDA parameters
    tl.fill(lr, 0.1)
    assert torch.equal(tl.factor, (1 - lr * 0.1).to(torch.float32))
    bc1 = torch.tensor([1 - 0.9 ** k for k in range(1, 200)], dtype=torch.float64)
    want = torch.stack([-(lr / b) for b in bc1.tolist()]).to(torch.float32)  # torch's own: tensor / Python float
    assert torch.equal(tl.step_size(bc1), want)
    lr.fill_(1e-4)
    tl.fill(lr, 0.1)
    assert torch.equal(tl.value, lr) and torch.equal(tl.factor, (1 - lr * 0.1).to(torch.float32))


@pytest.mark.parametrize("cls,foreach,amsgrad,maximize,wd", [
    (cls, fe, ams, mx, wd) for cls, fe, ams, mx, wd in itertools.product(
        (torch.optim.AdamW, torch.optim.Adam), (True, False), (False, True), (False, True), (0.0, 0.1))])
def test_the_update_of_bf16_parameters_is_the_users_eager_step_bit_for_bit(cls, foreach, amsgrad, maximize, wd):
    # torch's update of BFloat16 tensors computes each operation in float32 with the Python scalars converted to
    # float32, and rounds each result to BFloat16: the scalars read from the device must reach the same float32
    a, b = _model().to(torch.bfloat16), _model().to(torch.bfloat16)
    kw = dict(lr=LR, betas=(0.9, 0.95), weight_decay=wd, foreach=foreach, amsgrad=amsgrad, maximize=maximize)
    ref, opt = cls(a.parameters(), **kw), cls(b.parameters(), **kw)
    assert user_adam.why_not(opt, "cpu") is None
    user = UserMathAdam(opt, torch.device("cpu"))
    user.install()
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    for i in range(20):
        for m, o in ((a, ref), (b, opt)):
            o.zero_grad()
            m(x * (1 + i % 3)).float().square().mean().backward()
            for g in o.param_groups:
                g["lr"] = LR * 0.97 ** i
        user.sync()
        ref.step()
        opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert not torch.equal(next(a.parameters()), next(_model().to(torch.bfloat16).parameters()))  # it trained
    user.remove()


def test_mixed_parameter_dtypes_keep_the_capturable_math_and_say_why():
    opt = torch.optim.AdamW([nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4, dtype=torch.bfloat16))], lr=LR)
    assert "mix dtypes" in user_adam.why_not(opt, "cpu")
    half = torch.optim.AdamW([nn.Parameter(torch.ones(4, dtype=torch.float16))], lr=LR)
    assert "not a float32 or bfloat16 cpu tensor" in user_adam.why_not(half, "cpu")


def test_torchs_adam_runs_its_for_loop_update_for_a_tensor_lr_where_foreach_is_unset(monkeypatch):
    # on CUDA tensors torch defaults to the multi-tensor update, except Adam's with a tensor lr and no capturable
    from torch.optim import optimizer as torch_optimizer

    from nemo_cudagraph_plugin.core._torch_compat import runs_foreach

    monkeypatch.setattr(torch_optimizer, "_default_to_fused_or_foreach", lambda *a, **k: (False, True))  # as CUDA
    params = [torch.ones(2)]
    assert runs_foreach({"lr": LR, "foreach": None, "fused": None}, params)
    assert not runs_foreach({"lr": torch.tensor(LR), "foreach": None, "fused": None, "capturable": False}, params)
    assert runs_foreach({"lr": torch.tensor(LR), "foreach": None, "fused": None, "capturable": True}, params)
    assert runs_foreach({"lr": torch.tensor(LR), "foreach": None, "fused": None}, params, adam=False)  # SGD's
    assert not runs_foreach({"lr": LR, "foreach": None, "fused": False}, params)


def test_a_tensor_lrs_decay_factor_is_torchs_tensor_arithmetic_in_its_dtype():
    # ``1 - lr * weight_decay`` on a float32 tensor: float32(weight_decay) and two float32 roundings, which the double
    # computed once and rounded differs from for some learning rates (weight decay 0.3: about 2 % of them)
    tl = user_adam.TensorLr(torch.tensor(LR), torch.device("cpu"))
    grid = torch.logspace(-5, -2, 200_000, dtype=torch.float32)
    apart = grid[(1 - grid * 0.3) != (1 - grid.double() * 0.3).to(torch.float32)]
    lrs = torch.cat([apart[:50], grid[::4000]])
    assert len(apart) > 50
    got = []
    for lr in lrs:
        tl.fill(lr, 0.3)
        got.append(tl.decay_factor(0.3))
    assert torch.equal(torch.stack(got), 1 - lrs * 0.3)  # torch's own elementwise operations, the same roundings
