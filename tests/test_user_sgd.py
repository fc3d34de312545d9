"""``optimizer_math="eager"``: the user's own torch SGD update, captured (``core/user_sgd.py``), on CPU.

torch's SGD takes ``lr`` as a Python float in its last operation, ``p.add_(g, alpha=-lr)``; the captured update reads
``lr`` from a float64 device tensor and computes ``p + float32(-lr) * g`` with one rounding, as torch's kernels do (an
FMA on CUDA and in the CPU's vectorised ``add``). BFloat16 parameters: torch's CPU ``add`` rounds ``alpha`` to BFloat16
and computes its vectorised lanes and its remaining elements differently, which the CPU mirror reproduces. Here the
graph is the tape and the kernels are torch's CPU kernels; the CUDA kernel's rounding is the GPU tier's part
(``tests/gpu/test_user_optimizer_gpu.py``).
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
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
from nemo_cudagraph_plugin.core import user_adam, user_fused_adam, user_sgd
from nemo_cudagraph_plugin.core.optim import OptimizerPrep
from nemo_cudagraph_plugin.core.user_sgd import UserMathSGD, add_bf16_cpu, bf16_cpu_why_not, fma_f32

LR = 3e-4  # not a float32
BF16_LR = 0.05  # BFloat16 parameters move at a larger lr; neither a float32 nor a BFloat16
needs_bf16_mirror = pytest.mark.skipif(bf16_cpu_why_not() is not None, reason=str(bf16_cpu_why_not()))


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


def _wild_bf16(n, gen):
    """BFloat16 values of every kind: magnitudes from 2^-140 to 2^127, subnormals, infinities, NaN, zeros."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-140, 128, (n,), generator=gen).float())
    r = torch.rand(n, generator=gen)
    x = torch.where(r < 0.01, float("nan"), x)
    x = torch.where((r >= 0.01) & (r < 0.02), torch.sign(torch.randn(n, generator=gen)) * float("inf"), x)
    x = torch.where((r >= 0.02) & (r < 0.15), torch.randn(n, generator=gen) * 1e-39, x)  # subnormal
    x = torch.where((r >= 0.15) & (r < 0.17), 0.0, x)
    x = torch.where((r >= 0.17) & (r < 0.6), torch.randn(n, generator=gen) * 0.1, x)
    return x.bfloat16()


def _bits(t):
    return t.view(torch.int16)


# sizes: none and some vectorised lanes, partial lanes, and ranges that a thread split cuts (above 32768 elements)
BF16_SIZES = [1, 5, 31, 32, 33, 63, 64, 65, 1000, 32768, 32769, 65600, 100_003]


@needs_bf16_mirror
def test_torchs_cpu_add_of_bf16_with_alpha_is_mirrored_bit_for_bit():
    # torch's CPU ``add`` with a Python alpha on BFloat16 (the ufunc kernel): alpha rounded to BFloat16, vectorised
    # lanes one float32 FMA then RNE (NaN 0xFFFF), the rest of each thread's range in BFloat16 arithmetic (NaN 0x7FC0)
    gen = torch.Generator().manual_seed(3)
    threads = torch.get_num_threads()
    seen = {"float32 alpha, FMA everywhere": False, "BFloat16 alpha, FMA everywhere": False}
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for n in BF16_SIZES:
                p, g = _wild_bf16(n, gen), _wild_bf16(n, gen)
                for lr in (3e-4, 0.05 * 0.97**7, 0.1, 1e-30, 3e30, 5.0):
                    want = p.clone().add_(g, alpha=-lr)
                    alpha = torch.tensor(lr, dtype=torch.float64).neg().float()
                    got = add_bf16_cpu(p, g, alpha)
                    assert torch.equal(_bits(got), _bits(want)), (
                        f"{t} threads, {n} elements, lr {lr}: {(_bits(got) != _bits(want)).sum()} differ")
                    ok = want.isfinite()
                    for name, a in (("float32 alpha, FMA everywhere", alpha),
                                    ("BFloat16 alpha, FMA everywhere", alpha.bfloat16().float())):
                        other = fma_f32(g.float(), a, p.float()).bfloat16()
                        seen[name] |= not torch.equal(other[ok], want[ok])
    finally:
        torch.set_num_threads(threads)
    assert all(seen.values()), seen  # the data tells torch's CPU kernel from either single-FMA model


def test_torchs_cpu_add_of_bf16_on_the_default_capability_is_mirrored_bit_for_bit():
    # ATEN_CPU_CAPABILITY=default: torch's generic Vectorized<BFloat16> computes every element in BFloat16 arithmetic
    code = (
        "import sys, torch\n"
        "from nemo_cudagraph_plugin.core.user_sgd import add_bf16_cpu, bf16_cpu_why_not\n"
        "if torch.backends.cpu.get_cpu_capability() != 'DEFAULT' or bf16_cpu_why_not(): sys.exit(3)\n"
        "gen = torch.Generator().manual_seed(5)\n"
        "for n in (5, 64, 1000, 70001):\n"
        "    p = (torch.randn(n, generator=gen) * 0.1).bfloat16(); g = torch.randn(n, generator=gen).bfloat16()\n"
        "    for lr in (3e-4, 0.05, 0.1):\n"
        "        want = p.clone().add_(g, alpha=-lr).view(torch.int16)\n"
        "        got = add_bf16_cpu(p, g, torch.tensor(-lr, dtype=torch.float64).float()).view(torch.int16)\n"
        "        assert torch.equal(got, want), (n, lr, int((got != want).sum()))\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if run.returncode == 3:
        pytest.skip("this torch does not run its DEFAULT CPU kernels on x86 here")
    assert run.returncode == 0, run.stderr[-3000:]


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


def _bf16_params():
    # element counts with partial vector lanes at their end, and one above 32768 that a thread split cuts
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter((torch.randn(shape, generator=g) * 0.1).bfloat16())
            for shape in [(5,), (37,), (16, 37), (2053,), (16, 2053), (2053, 5)]]


@needs_bf16_mirror
@pytest.mark.parametrize("kw", FORMS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_the_update_of_bf16_parameters_is_the_users_eager_sgd_step_bit_for_bit(kw):
    # torch's own momentum, decay and Nesterov in BFloat16, then its CPU add with alpha (see add_bf16_cpu). The
    # gradients are given (the same to both), of magnitudes 1e-3 to 10: no feedback can make the run diverge to
    # infinities and NaN, whose bits would hide the roundings.
    a, b = _bf16_params(), _bf16_params()
    ref, opt = torch.optim.SGD(a, lr=BF16_LR, **kw), torch.optim.SGD(b, lr=BF16_LR, **kw)
    assert user_sgd.why_not(opt, "cpu") is None
    user = UserMathSGD(opt, torch.device("cpu"))
    user.install()
    gen = torch.Generator().manual_seed(1)
    for i in range(12):
        for p, q in zip(a, b):
            scale = torch.exp2(torch.empty(p.shape).uniform_(-10, 3.3, generator=gen))
            p.grad = (torch.randn(p.shape, generator=gen) * scale).bfloat16()
            q.grad = p.grad.clone()
        for o in (ref, opt):
            for g in o.param_groups:
                g["lr"] = BF16_LR * 0.97**i  # a schedule assigning floats
        user.sync()
        ref.step()
        opt.step()
        for j, (p, q) in enumerate(zip(a, b)):
            assert p.isfinite().all(), "the reference diverged: the test's gradients need to be smaller"
            assert torch.equal(_bits(p), _bits(q)), f"step {i}, parameter {j}: {(p != q).sum()} elements differ"
    if kw["momentum"]:
        for p, q in zip(a, b):
            assert torch.equal(_bits(ref.state[p]["momentum_buffer"]), _bits(opt.state[q]["momentum_buffer"]))
    assert not any(torch.equal(p, q) for p, q in zip(a, _bf16_params()))  # every parameter moved
    user.remove()


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
    "sgd-foreach-momentum-bf16-true": ({"foreach": True, "momentum": 0.9}, {"precision": "bf16-true"}),
    "sgd-for-loop-nesterov-bf16-true": ({"momentum": 0.9, "nesterov": True}, {"precision": "bf16-true"}),
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
        (torch.optim.SGD([nn.Parameter(torch.ones(4, dtype=torch.float16))], lr=0.1), "cpu", False,
         "not a float32 or bfloat16 cpu tensor"),
        (torch.optim.SGD([nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4, dtype=torch.bfloat16))], lr=0.1),
         "cpu", False, "mix dtypes (torch.bfloat16, torch.float32)"),
    ]
    for opt, device_type, skip, why in cases:
        assert why in user_sgd.why_not(opt, device_type, skip)

    class MySGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    assert "not torch.optim.SGD with torch's own step" in user_sgd.why_not(MySGD([p], lr=0.1), "cpu")
    monkeypatch.setattr(user_sgd, "triton_available", lambda: False)
    assert "Triton" in user_sgd.why_not(torch.optim.SGD([p], lr=0.1), "cuda")
    # BFloat16 on the CPU: where the layout of torch's CPU kernel is mirrored only
    bf16 = torch.optim.SGD([nn.Parameter(torch.ones(4, dtype=torch.bfloat16))], lr=0.1, momentum=0.9)
    monkeypatch.setattr(user_sgd, "cpu_capability", lambda: "AVX2")
    assert user_sgd.why_not(bf16, "cpu") is None
    monkeypatch.setattr(user_sgd, "cpu_capability", lambda: "SVE256")
    assert "CPU capability SVE256" in user_sgd.why_not(bf16, "cpu")
    assert user_sgd.why_not(torch.optim.SGD([p], lr=0.1), "cpu") is None  # float32: one FMA on every CPU
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


def test_a_fused_adam_keeps_the_users_math_and_says_why_where_it_cannot():
    p = nn.Parameter(torch.ones(4))
    assert user_fused_adam.why_not(torch.optim.AdamW([p], lr=LR, fused=True), "cpu") is None
    tensor_lr = torch.optim.AdamW([p], lr=torch.tensor(LR), fused=True)  # the kernel reads it: the user's own
    assert user_fused_adam.why_not(tensor_lr, "cpu") is None
    tensor_betas = torch.optim.AdamW([p], lr=LR, betas=(torch.tensor(0.9), torch.tensor(0.99)), fused=True)
    assert "tensor betas" in user_fused_adam.why_not(tensor_betas, "cpu")
    # nan_action="skip": the fused kernel reads found_inf itself, so the user's update is kept
    assert user_fused_adam.why_not(torch.optim.AdamW([p], lr=LR, fused=True), "cpu", skip_nonfinite=True) is None
    assert "nan_action='skip'" in user_adam.why_not(torch.optim.AdamW([p], lr=LR, foreach=True), "cpu", True)


def test_adam_with_fused_false_and_foreach_unset_runs_the_for_loop_update_on_cuda(monkeypatch):
    # torch's adam(): foreach unset and fused=False is its for-loop update, not its default (multi-tensor on CUDA).
    # The CPU taken for a device with multi-tensor kernels, as CUDA is; the update the captured step runs
    # (runs_foreach) must be the one torch's own step runs.
    import torch.optim.adam as torch_adam
    from torch.optim import optimizer as torch_optimizer

    from nemo_cudagraph_plugin.core._torch_compat import runs_foreach

    monkeypatch.setattr(torch_optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    # as on a GPU host (Triton there, the parameters' device check passed as for CUDA tensors): either update captured
    real = user_adam.plain_float32_params
    monkeypatch.setattr(user_adam, "triton_available", lambda: True)
    monkeypatch.setattr(user_adam, "plain_float32_params", lambda i, g, device_type, *a: real(i, g, "cpu", *a))
    ran: list[str] = []
    for kw, foreach in (({}, True), ({"fused": False}, False), ({"foreach": False}, False), ({"foreach": True}, True)):
        p = nn.Parameter(torch.ones(4))
        opt = torch.optim.AdamW([p], lr=LR, **kw)
        assert runs_foreach(opt.param_groups[0], [p]) is foreach, kw
        assert user_adam.why_not(opt, "cuda") is None, kw
        p.grad = torch.ones(4)
        ran.clear()
        with monkeypatch.context() as m:  # which of torch's updates its own step runs
            for name in ("_multi_tensor_adam", "_single_tensor_adam"):
                fn = getattr(torch_adam, name)
                m.setattr(torch_adam, name, lambda *a, fn=fn, name=name, **k: ran.append(name) or fn(*a, **k))
            opt.step()
        assert ran == ["_multi_tensor_adam" if foreach else "_single_tensor_adam"], kw


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


def _fma_or_not_in_bf16(n, gen, alpha):
    """``n`` (p, g) BFloat16 pairs whose update rounded to BFloat16 differs between one FMA and a float32 multiply and
    add (rare: the float32 sums differ by an ulp across a BFloat16 midpoint), picked from random candidates."""
    ps, gs = [], []
    while sum(len(p) for p in ps) < n:
        p = (torch.randn(1 << 20, generator=gen) * 1e-1).bfloat16()
        g = torch.randn(1 << 20, generator=gen).bfloat16()
        one = fma_f32(g.float(), alpha, p.float()).bfloat16()
        two = (p.float() + g.float() * alpha).bfloat16()
        differ = one != two
        ps.append(p[differ])
        gs.append(g[differ])
    return torch.cat(ps)[:n], torch.cat(gs)[:n]


def test_the_sgd_tail_kernel_on_bf16_rounds_as_torchs_cuda_add_with_alpha(interpreted):  # noqa: F811
    # CUDA's add with a Python alpha on BFloat16: the float32 alpha, one FMA in float32, the result rounded to
    # BFloat16 (to nearest even); Triton's interpreter truncates its cast, so the kernel's own rounding decides
    from nemo_cudagraph_plugin.core import adam_tail
    from nemo_cudagraph_plugin.core.adam_tail import EagerSgdTail

    adam_tail._sgd_kernel.cache_clear()
    gen = torch.Generator().manual_seed(4)
    alpha = torch.tensor(-0.05 * 0.97**5, dtype=torch.float64).to(torch.float32)
    sizes = [1, 31, 32, 33, 100, 2000]
    ps = [(torch.randn(n, generator=gen) * 1e-1).bfloat16() for n in sizes]
    gs = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    ps[-1][:64], gs[-1][:64] = _fma_or_not_in_bf16(64, gen, alpha)  # where one FMA and two roundings part
    before = [p.clone() for p in ps]
    EagerSgdTail(block=16, iters=2, num_warps=1)(ps, gs, alpha)
    adam_tail._sgd_kernel.cache_clear()
    for j, (p, p0, g) in enumerate(zip(ps, before, gs)):
        want = fma_f32(g.float(), alpha, p0.float()).bfloat16()  # torch's float32 -> BFloat16 cast: RNE
        assert torch.equal(_bits(p), _bits(want)), f"tensor {j}: {(p != want).sum()} elements differ"
    p0, g, want = before[-1].float(), gs[-1].float(), ps[-1]
    exact = fma_f32(g, alpha, p0)
    truncated = (exact.view(torch.int32) & -65536).view(torch.float32).bfloat16()
    assert not torch.equal(want, truncated)  # the data tells RNE from truncation,
    assert not torch.equal(want, (p0 + g * alpha).bfloat16())  # one FMA from a multiply and an add,
    assert not torch.equal(want, fma_f32(g, alpha.bfloat16().float(), p0).bfloat16())  # and alpha from CPU's alpha


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
    # fused and non-fused groups: the capturable preparation, which changes the groups
    a = torch.optim.AdamW([{"params": [nn.Parameter(torch.ones(4))]},
                           {"params": [nn.Parameter(torch.ones(4))], "fused": False}], lr=LR, fused=True)
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
