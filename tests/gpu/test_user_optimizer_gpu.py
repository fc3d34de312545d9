"""Graphed training bitwise equal to the user's own eager run with their unmodified torch Adam/AdamW (``optimizer_math=
"eager"``, ``core/user_adam.py``): loss and every parameter, in one process, on CUDA's kernels.

The recipe's GPT module configures ``torch.optim.AdamW(groups, lr, betas)`` (torch's default: the multi-tensor update
on CUDA) with a warm-up + cosine ``LambdaLR``; the forms below change only the optimizer's keywords. The lr is not a
float32 (3e-4): a float32 lr tensor alone would already change the bits.
"""

from __future__ import annotations

import functools
import warnings

import lightning.pytorch as pl
import pytest
import torch
from _lightning_utils import Recorder, loader, make_module
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from nemo_cudagraph_plugin import CudaGraphCallback
from nemo_cudagraph_plugin.core._torch_compat import scalar_division
from nemo_cudagraph_plugin.core.adam_tail import EagerAdamTail, EagerSgdTail

pytestmark = pytest.mark.gpu

LR = 3e-4
ADAM = {"lr": LR, "betas": (0.9, 0.95)}
SGD_LR = 0.03  # not a float32 either
FORMS = {
    "adamw-foreach": (torch.optim.AdamW, ADAM),
    "adam-amsgrad-maximize": (torch.optim.Adam, {**ADAM, "amsgrad": True, "maximize": True, "weight_decay": 0.01}),
    # torch's for-loop update: its division by a Python float is CUDA's multiply by a float32 reciprocal
    "adamw-for-loop": (torch.optim.AdamW, {**ADAM, "foreach": False}),
    # torch's SGD (multi-tensor by default on CUDA; the groups carry weight decay)
    "sgd-foreach-momentum": (torch.optim.SGD, {"lr": SGD_LR, "momentum": 0.9}),
    "sgd-foreach-nesterov": (torch.optim.SGD, {"lr": SGD_LR, "momentum": 0.9, "nesterov": True}),
    "sgd-foreach-plain": (torch.optim.SGD, {"lr": SGD_LR}),
    "sgd-for-loop-dampening-maximize": (torch.optim.SGD, {"lr": 1e-3, "foreach": False, "momentum": 0.8,
                                                          "dampening": 0.1, "maximize": True}),
    # a tensor lr with foreach unset: torch's for-loop update with tensor operations on the lr (on the GPU, or on the
    # CPU where torch computes the step size and AdamW's decay factor with the CPU's kernels)
    "adamw-tensor-lr": (torch.optim.AdamW, {**ADAM, "lr": lambda: torch.tensor(LR, device="cuda")}),
    "adamw-tensor-lr-host": (torch.optim.AdamW, {**ADAM, "lr": lambda: torch.tensor(LR)}),
}
# torch's fused update: its float lr is a kernel argument, set in the graph before each replay (core/kernel_args.py)
FUSED = {"adamw-fused": (torch.optim.AdamW, {**ADAM, "fused": True}),
         "adam-fused-amsgrad-maximize": (torch.optim.Adam, {**ADAM, "fused": True, "amsgrad": True, "maximize": True,
                                                           "weight_decay": 0.01}),
         # a tensor lr, which the kernel reads from the device (a new one per fit: the scheduler writes it in place)
         "adamw-fused-tensor-lr": (torch.optim.AdamW, {**ADAM, "fused": True,
                                                       "lr": lambda: torch.tensor(LR, device="cuda")})}
# torch's for-loop update again: fused=False with foreach unset runs it too (amsgrad: the denominator from the maximum)
FOR_LOOP = {"adam-for-loop-amsgrad-maximize": (torch.optim.Adam, {**ADAM, "fused": False, "amsgrad": True,
                                                                  "maximize": True, "weight_decay": 0.01})}


def module(form: str, precision: str):
    cls, kw = {**FORMS, **FUSED, **FOR_LOOP}[form]
    m = make_module(lr=LR, warmup_steps=10, max_steps=200)
    groups_of = type(m).configure_optimizers

    def configure_optimizers(self=m):
        out = groups_of(self)
        opt = out["optimizer"]
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.param_groups]
        user = cls(groups, **{k: v() if callable(v) else v for k, v in kw.items()})  # as the user writes it
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


def assert_step_given_back(opt):
    """After fit the instance's ``step`` is the LR scheduler's wrapper again (torch's schedulers set it on the
    instance), not the plugin's takeover (a ``functools.partial``)."""
    own = opt.__dict__.get("step")
    assert getattr(own, "_wrapped_by_lr_sched", False) and not isinstance(own, functools.partial), own


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


def test_resume_with_sgd_momentum_equals_the_users_resumed_eager_run(tmp_path):
    first = run(False, "sgd-foreach-momentum", "32-true", 30)
    path = tmp_path / "thirty.ckpt"
    first[0].save_checkpoint(path)
    kw = dict(ckpt_path=str(path), train_loader=loader(80))
    assert_bitwise(run(True, "sgd-foreach-momentum", "32-true", 80, **kw),
                   run(False, "sgd-foreach-momentum", "32-true", 80, **kw))


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_the_for_loop_update_200_steps_equals_the_users_eager_run_and_its_counters_go_back_to_the_cpu(precision):
    form = "adam-for-loop-amsgrad-maximize"
    kw = dict(gradient_clip_val=1.0)
    g = run(True, form, precision, 200, **kw)
    assert_bitwise(g, run(False, form, precision, 200, **kw))
    # after fit the step counters are back where torch's for-loop update keeps them (a fused one's stay on the GPU)
    opt = g[0].optimizers[0]
    assert opt.state and all(not s["step"].is_cuda for s in opt.state.values())
    assert_step_given_back(opt)


ADAM_FORMS = ["adamw-foreach", "adam-amsgrad-maximize", "adamw-for-loop", "adamw-tensor-lr", "adamw-tensor-lr-host"]
SGD_FORMS = sorted(f for f in FORMS if f.startswith("sgd"))


@pytest.mark.parametrize("form", ADAM_FORMS + SGD_FORMS)
def test_bf16_parameters_200_steps_equal_the_users_eager_run(form):
    # bf16-true: BFloat16 parameters, moments and momentum buffers, each operation of torch's update in float32,
    # stored as BFloat16
    kw = dict(gradient_clip_val=1.0)
    assert_bitwise(run(True, form, "bf16-true", 200, **kw), run(False, form, "bf16-true", 200, **kw))


def test_bf16_parameters_with_accumulation_equal_the_users_eager_run():
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=1.0, train_loader=loader(120))
    assert_bitwise(run(True, "adamw-foreach", "bf16-true", 60, **kw),
                   run(False, "adamw-foreach", "bf16-true", 60, **kw))


# Lightning refuses clipping for an optimizer that unscales its gradients itself (fused) under bf16-mixed
@pytest.mark.parametrize("precision,clip", [("32-true", 1.0), ("bf16-true", 1.0), ("bf16-mixed", 0.0)])
@pytest.mark.parametrize("form", sorted(FUSED))
def test_the_fused_update_200_steps_equals_the_users_eager_run(form, precision, clip):
    kw = {"gradient_clip_val": clip} if clip else {}
    g = run(True, form, precision, 200, **kw)
    assert_bitwise(g, run(False, form, precision, 200, **kw))
    # after fit the step counters stay where torch's fused update keeps them (a non-fused one's go back to the CPU)
    opt = g[0].optimizers[0]
    assert all(s["step"].is_cuda for s in opt.state.values())
    assert_step_given_back(opt)


def test_the_fused_update_with_accumulation_and_verify_steps_equals_the_users_eager_run():
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=1.0, train_loader=loader(120))
    g = run(True, "adamw-fused", "32-true", 60, cb_kw={"verify_steps": 3}, **kw)
    assert g[3].stats.verified_steps == 3
    assert_bitwise(g, run(False, "adamw-fused", "32-true", 60, **kw))


def test_the_fused_update_with_nan_action_skip_equals_the_users_eager_run():
    # the kernel reads the guard's found_inf on the device; with no non-finite gradient it is the user's update
    g = run(True, "adamw-fused", "32-true", 60, cb_kw={"nan_action": "skip"}, gradient_clip_val=1.0)
    assert_bitwise(g, run(False, "adamw-fused", "32-true", 60, gradient_clip_val=1.0))


def test_the_fused_kernels_lr_argument_is_set_in_the_graph_before_each_replay():
    # torch's fused AdamW captured through the backend: every launch's lr argument found and set, the replays equal to
    # torch's eager fused step at each new lr (a sentinel left in a launch would turn its parameters NaN)
    from nemo_cudagraph_plugin.core.backend import CudaBackend
    from nemo_cudagraph_plugin.core.user_fused_adam import UserMathFusedAdam

    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [3, 4097, 1 << 20, 3_000_001] * 20  # more tensors and blocks than one launch takes
    ref = [torch.randn(n, device="cuda", generator=g).requires_grad_() for n in sizes]
    mine = [p.detach().clone().requires_grad_() for p in ref]
    grads = [torch.randn(n, device="cuda", generator=g) for n in sizes]
    opts = [torch.optim.AdamW(ps, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=True) for ps in (ref, mine)]
    for ps in (ref, mine):
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
    user = UserMathFusedAdam(opts[1], torch.device("cuda"))
    user.install()
    opts[0].step()
    opts[1].step()  # eager: state created, the float itself
    be = CudaBackend()
    graph = be.new_graph()
    with be.capture(graph, be.pool(), torch.cuda.Stream()):
        opts[1].step()
    be.finish(graph, None)
    assert graph.args is not None and graph.args.nodes >= 2, "every launch of the fused kernel holds the lr"
    for i in range(6):
        lr = LR * 0.93 ** i
        for o in opts:
            o.param_groups[0]["lr"] = lr
        user.sync()
        opts[0].step()
        graph.replay()
        torch.cuda.synchronize()
        bad = [j for j, (a, b) in enumerate(zip(ref, mine)) if not torch.equal(a, b)]
        assert not bad, f"replay {i}: {len(bad)} tensors differ from torch's eager fused step"
    user.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("foreach", [True, False])
def test_the_sgd_kernel_is_torchs_cuda_add_with_alpha_bit_for_bit(foreach, dtype):
    # p + alpha * g as torch's CUDA kernels compute it for a Python alpha (multi-tensor and for-loop): the float32
    # alpha, one FMA in float32; BFloat16 tensors: the result rounded once to BFloat16 (to nearest even)
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1, 3, 4095, 4096, 4097, 1 << 20, 3_000_001]
    scale = 1e-2 if dtype == torch.float32 else 1e-1
    ps = [(torch.randn(n, device="cuda", generator=g) * scale).to(dtype) for n in sizes]
    gs = [torch.randn(n, device="cuda", generator=g).to(dtype) for n in sizes]
    for lr in (SGD_LR, 3e-4 * 0.97**7, 0.1, 7.7e-5):
        want = [p.clone() for p in ps]
        if foreach:
            torch._foreach_add_(want, gs, alpha=-lr)
        else:
            for w, gr in zip(want, gs):
                w.add_(gr, alpha=-lr)
        got = [p.clone() for p in ps]
        alpha = torch.tensor(lr, dtype=torch.float64, device="cuda").neg().to(torch.float32)
        EagerSgdTail()(got, gs, alpha)
        for j, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"lr {lr}, tensor {j}: {(a != b).sum().item()} elements differ"
        if dtype == torch.float32:
            two = ps[-1] + gs[-1] * alpha
            assert not torch.equal(two, want[-1])  # the data tells one rounding from two
            continue
        f32 = ps[-1].float() + gs[-1].float() * alpha  # the update in float32 (an FMA's rounding aside)
        truncated = (f32.view(torch.int32) & -65536).view(torch.float32).bfloat16()
        assert not torch.equal(truncated, want[-1])  # the data tells round to nearest even from truncation
        cpu_alpha = ps[-1].float() + gs[-1].float() * alpha.bfloat16().float()  # torch's CPU kernel's alpha
        assert not torch.equal(cpu_alpha.bfloat16(), want[-1])  # and the float32 alpha from a BFloat16 one


def test_the_bf16_adam_kernels_are_torchs_cuda_foreach_ops_bit_for_bit():
    # the multi-tensor update's end on BFloat16 tensors, as torch runs it with the Python scalars, against the kernels
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1, 3, 4095, 4096, 4097, 1 << 20, 3_000_001]
    ps = [(torch.randn(n, device="cuda", generator=g) * 1e-1).bfloat16() for n in sizes]
    ms = [(torch.randn(n, device="cuda", generator=g) * 1e-2).bfloat16() for n in sizes]
    vs = [(torch.rand(n, device="cuda", generator=g) * 1e-4).bfloat16() for n in sizes]
    step_size = torch.tensor([-3e-4 / (1 - 0.9 ** k) for k in range(1, 8)], dtype=torch.float64).float().cuda()
    bc2s = torch.tensor([(1 - 0.95 ** k) ** 0.5 for k in range(1, 8)], dtype=torch.float64).float().cuda()
    want = [p.clone() for p in ps]
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, bc2s.tolist())
    torch._foreach_add_(denom, 1e-8)
    torch._foreach_addcdiv_(want, ms, denom, step_size.tolist())
    got = [p.clone() for p in ps]
    tail = EagerAdamTail()
    tail(got, ms, vs, bc2s, step_size, 1e-8)
    for j, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"addcdiv, tensor {j}: {(a != b).sum().item()} elements differ"
    factor = 1 - 3e-2 * 0.1  # AdamW's decay factor as a Python float
    torch._foreach_mul_(want, factor)
    tail.scale(got, torch.tensor(factor, dtype=torch.float64, device="cuda").float())
    for j, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"decay, tensor {j}: {(a != b).sum().item()} elements differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_the_for_loop_adam_kernel_is_torchs_cuda_for_loop_ops_bit_for_bit(dtype):
    # the for-loop update's end as torch runs it with its Python floats, against the kernel's reciprocal mode:
    # ``(v.sqrt() / bc2s).add_(eps)`` (CUDA multiplies by a float32 reciprocal formed on the host),
    # ``p.addcdiv_(m, d, value=s)``
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1, 3, 4095, 4096, 4097, 1 << 20, 3_000_001]
    ps = [(torch.randn(n, device="cuda", generator=g) * 1e-3).to(dtype) for n in sizes]
    ms = [(torch.randn(n, device="cuda", generator=g) * 1e-2).to(dtype) for n in sizes]
    vs = [(torch.rand(n, device="cuda", generator=g) * 1e-4).to(dtype) for n in sizes]
    # a BFloat16 square root has 8 significant bits: its quotient and its product with the reciprocal round to
    # different BFloat16 for some divisors only, as bf16(sqrt(v)) = 0.01153564453125 with 0.9287469387054443
    ps.append((torch.randn(4096, device="cuda", generator=g) * 1e-3).to(dtype))
    ms.append((torch.randn(4096, device="cuda", generator=g) * 1e-2).to(dtype))
    vs.append(torch.tensor([1.3256072998046875e-4, 1.33514404296875e-4], device="cuda").repeat(2048).to(dtype))
    n = len(ps)
    # (bias_correction2_sqrt, step size) as the host computes them: beta2 0.95 or 0.999, lr 3e-4, beta1 0.9
    cases = [((1 - b2 ** k) ** 0.5, -(LR / (1 - 0.9 ** k))) for b2, k in [(0.95, 1), (0.95, 3), (0.95, 7), (0.95, 100),
                                                                         (0.95, 1000), (0.999, 1), (0.999, 3),
                                                                         (0.999, 1000), (0.999, 5000)]]
    cases.append((0.9287469387054443, -5e-2))  # the divisor above; a step size whose updates show in BFloat16
    tail = EagerAdamTail()
    kind = scalar_division(torch.device("cuda"))
    assert kind in ("double", "float32"), kind  # CUDA's division by a Python float multiplies by a reciprocal
    told_apart = 0
    for bc2s, step_size in cases:
        want = [p.clone() for p in ps]
        for w, m, v in zip(want, ms, vs):
            w.addcdiv_(m, (v.sqrt() / bc2s).add_(1e-8), value=step_size)
        got = [p.clone() for p in ps]
        bc2s64 = torch.full((n,), bc2s, dtype=torch.float64, device="cuda")
        bc2s_t = bc2s64.float()
        recips = (1.0 / bc2s64).float() if kind == "double" else 1.0 / bc2s_t  # as device_scalars forms them
        step_t = torch.full((n,), step_size, dtype=torch.float64, device="cuda").float()
        tail(got, ms, vs, recips, step_t, 1e-8, reciprocal=True)
        for j, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"bc2s {bc2s}, tensor {j}: {(a != b).sum().item()} elements differ"
        divided = [p.clone() for p in ps]
        tail(divided, ms, vs, bc2s_t, step_t, 1e-8)  # the multi-tensor mode: a division by float32(bc2s)
        told_apart += sum(int((a != b).sum()) for a, b in zip(divided, want))
    assert told_apart > 1000  # the data tells the reciprocal from a division
