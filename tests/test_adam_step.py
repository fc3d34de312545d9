"""``fast_adam``'s update (``core/adam_step.py``) against torch's own capturable multi-tensor Adam/AdamW, on CPU.

torch refuses ``capturable=True`` on CPU parameters in its multi-tensor update (a device check only); these tests
lift that check for torch's function so both updates run here. On CPU every ``_foreach_*`` op loops over its
tensors, so the bits compared are those of the same operations on the same numbers; that the CUDA kernels agree
too is ``tests/gpu/test_capture_gpu.py``'s part.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_cudagraph_plugin.core import adam_step
from nemo_cudagraph_plugin.core.adam_step import GroupScalarAdam, why_not


@pytest.fixture(autouse=True)
def capturable_on_cpu(monkeypatch):
    monkeypatch.setattr(importlib.import_module("torch.optim.adam"), "_get_capturable_supported_devices",
                        lambda supports_xla=True: ["cuda", "cpu"])


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def groups(m, wd):
    decay = [p for p in m.parameters() if p.dim() >= 2]
    rest = [p for p in m.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0, "lr": torch.tensor(3e-3)}]


def backward(m, x):
    m.zero_grad(set_to_none=True)
    m(x).square().mean().backward()


CASES = {
    "adamw": (torch.optim.AdamW, {"lr": torch.tensor(1e-2), "betas": (0.9, 0.95)}, 0.1),
    "adam-coupled-decay": (torch.optim.Adam, {"lr": torch.tensor(1e-2)}, 0.01),
    "adam-float-lr": (torch.optim.Adam, {"lr": 1e-2, "eps": 1e-6}, 0.0),
    "adamw-tensor-betas": (torch.optim.AdamW, {"lr": torch.tensor(1e-2),
                                               "betas": (torch.tensor(0.9), torch.tensor(0.99))}, 0.1),
}


def pair(case):
    cls, kw, wd = CASES[case]
    a, b = model(), model()
    clone = lambda v: v.clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    def make(m):
        kws = {k: (tuple(clone(x) for x in v) if isinstance(v, tuple) else clone(v)) for k, v in kw.items()}
        return cls(groups(m, wd), foreach=True, capturable=True, **kws)
    return a, make(a), b, make(b)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_group_scalar_update_is_torchs_capturable_step_bit_for_bit(case):
    ref_m, ref, m, opt = pair(case)
    fast = GroupScalarAdam(opt, device_type="cpu")
    assert fast.reason is None
    x = torch.randn(8, 16)
    for i in range(8):
        for mm in (ref_m, m):
            backward(mm, x * (1 + i))
        ref.step()
        if i == 0:
            opt.step()  # the state is created by torch's eager step, as the warm-up does
        else:
            with fast.during_capture():
                opt.step()
    assert fast.counted_groups == 2 * 7 and fast.torch_groups == 0
    for (n, p), q in zip(ref_m.named_parameters(), m.parameters()):
        assert torch.equal(p, q), n
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref.state[p][k], opt.state[q][k]), f"{n} {k}"
    assert "step" not in opt.__dict__  # the instance's step is torch's again after the capture


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith("_foreach_div"):
            tensors, other = args[0], args[1]
            divisor = (f"list of {len(other)} {'0-d' if other[0].dim() == 0 else 'n-d'}" if isinstance(other, list)
                       else type(other).__name__)
            self.calls.append((func.__name__, f"{len(tensors)} {'0-d' if tensors[0].dim() == 0 else 'n-d'}", divisor))
        return func(*args, **(kwargs or {}))


def divisions(opt, fast=None):
    with Ops() as ops:
        if fast is None:
            opt.step()
        else:
            with fast.during_capture():
                opt.step()
    return ops.calls


def test_it_divides_the_moments_by_one_tensor_per_group_where_torch_divides_by_one_per_parameter():
    ref_m, ref, m, opt = pair("adamw")
    fast = GroupScalarAdam(opt, device_type="cpu")
    x = torch.randn(8, 16)
    for mm, o in ((ref_m, ref), (m, opt)):
        backward(mm, x)
        o.step()
        backward(mm, x)
    n = len(ref.param_groups[0]["params"])
    # torch: the moments of a group divided by a list of 0-d tensors, twice (on CUDA a kernel per parameter each)
    assert divisions(ref).count(("_foreach_div_.List", f"{n} n-d", f"list of {n} 0-d")) == 2
    # ours: by one tensor, twice per group; the bias corrections computed on one-element lists
    ours = divisions(opt, fast)
    assert [c for c in ours if c[1].endswith("n-d")] == [("_foreach_div_.Tensor", f"{n} n-d", "Tensor")] * 2 + [
        ("_foreach_div_.Tensor", f"{len(opt.param_groups[1]['params'])} n-d", "Tensor")] * 2
    assert all(c[1] == "1 0-d" for c in ours if c[1].endswith("0-d")), ours


def one_step_after(history):
    """Both optimizers through ``history(model, optimizer, x)`` eagerly, then torch's step against the group-scalar
    one in a capture; the parameters must agree bit for bit. Returns the stand-in."""
    ref_m, ref, m, opt = pair("adamw")
    fast = GroupScalarAdam(opt, device_type="cpu")
    x = torch.randn(8, 16)
    for mm, o in ((ref_m, ref), (m, opt)):
        history(mm, o, x)
    ref.step()
    with fast.during_capture():
        opt.step()
    for p, q in zip(ref_m.parameters(), m.parameters()):
        assert torch.equal(p, q)
    return fast


def test_a_group_whose_counters_differ_is_updated_by_torch_and_stays_exact():
    def history(m, opt, x):
        backward(m, x)
        opt.step()
        backward(m, x)
        m[0].bias.grad = None  # the first layer's bias misses a step: its counter falls behind its group's
        opt.step()
        backward(m, x)

    fast = one_step_after(history)
    assert (fast.counted_groups, fast.torch_groups) == (1, 1)


def test_a_step_that_creates_some_states_of_a_group_but_not_all_is_left_to_torch():
    def history(m, opt, x):
        backward(m, x)
        m[3].weight.grad = None  # no state yet for this one: it first steps in the captured step
        opt.step()
        backward(m, x)

    fast = one_step_after(history)
    assert (fast.counted_groups, fast.torch_groups) == (1, 1)


def test_step_hooks_run_once_and_the_closure_runs_with_gradients():
    _, _, m, opt = pair("adamw")
    fast = GroupScalarAdam(opt, device_type="cpu")
    x = torch.randn(8, 16)
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append("pre"))
    opt.register_step_post_hook(lambda *a: seen.append("post"))
    backward(m, x)
    opt.step()
    seen.clear()

    def closure():
        backward(m, x)
        return torch.tensor(1.0)

    with fast.during_capture():
        assert opt.step(closure=closure) is not None
    assert seen == ["pre", "post"] and fast.counted_groups == 2


class OwnStep(torch.optim.AdamW):
    def step(self, closure=None):
        return super().step(closure)


@pytest.mark.parametrize("make, says", [
    (lambda ps: torch.optim.AdamW(ps, fused=True, capturable=True), "fused"),
    (lambda ps: torch.optim.AdamW(ps, foreach=True, capturable=True, amsgrad=True), "amsgrad"),
    (lambda ps: torch.optim.AdamW(ps, foreach=False, capturable=True), "capturable/foreach off"),
    (lambda ps: torch.optim.AdamW(ps, fused=False, capturable=True), "capturable/foreach off"),
    (lambda ps: torch.optim.AdamW(ps, foreach=True), "capturable/foreach off"),
    (lambda ps: OwnStep(ps, foreach=True, capturable=True), "OwnStep is not torch.optim.Adam/AdamW"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "SGD is not torch.optim.Adam/AdamW"),
])
def test_what_it_does_not_stand_in_for_is_named(make, says):
    opt = make(model().parameters())
    assert says in why_not(opt, "cpu")


def test_parameters_that_are_not_float32_on_the_capture_device_are_named():
    m = model().to(torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), foreach=True, capturable=True)
    assert "not a float32 cpu tensor (torch.bfloat16" in why_not(opt, "cpu")
    assert "not a float32 cuda tensor" in why_not(torch.optim.AdamW(model().parameters(), capturable=True))


def test_torch_versions_outside_the_mirrored_shape_keep_torchs_step(monkeypatch):
    from packaging.version import Version

    opt = torch.optim.AdamW(model().parameters(), foreach=True, capturable=True)
    monkeypatch.setattr(adam_step, "TORCH_VERSION", Version("2.10.0"))
    assert "torch 2.10.0 is outside 2.11.0 - 2.13" in why_not(opt, "cpu")
    fast = GroupScalarAdam(opt, device_type="cpu")
    with fast.during_capture():
        assert "step" not in opt.__dict__
