"""The fused tail of the capturable Adam update (``core/adam_tail.py``), run by Triton's interpreter on the CPU.

Each element must be what torch's CUDA kernels compute: every operation in float32, correctly rounded (``sqrtf``
and IEEE division are, on CUDA), in torch's order. The reference below rounds each operation from float64 (exact for
these values). That the kernel equals torch's own update on a GPU, bit for bit, is
``tests/gpu/test_capture_gpu.py``'s part; torch's CPU ``sqrt`` is not correctly rounded, so it is no reference here.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from nemo_cudagraph_plugin.core import adam_step, adam_tail
from nemo_cudagraph_plugin.core.adam_tail import FusedAdamTail, tail_applies


@pytest.fixture
def interpreted(monkeypatch):
    if os.environ.get("NCG_REQUIRE_TRITON") == "1":  # CI's unit stage installs it (the test extra): never skip there
        importlib.import_module("triton")
    else:
        pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    adam_tail._kernel.cache_clear()
    yield
    adam_tail._kernel.cache_clear()


def reference(p, m, v, bc2s, step_size, eps):
    f32 = lambda x: x.to(torch.float32).to(torch.float64)  # noqa: E731  (round to float32, keep computing exactly)
    d = f32(v.double().sqrt())
    d = f32(d / bc2s.double())
    d = f32(d + f32(torch.tensor(eps, dtype=torch.float64)))
    d = f32(d / step_size.double())
    return f32(p.double() + f32(m.double() / d)).float()


SIZES = [1, 31, 32, 33, 100, 64, 200]  # partial chunks, exact chunks, several chunks (block 16 x 2 iters = 32)


def tensors(seed=0, offset=0):
    """Three buffers, each holding the SIZES tensors at 16-element (64-byte) aligned places, sentinels between."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for kind in ("p", "m", "v"):
        total = sum(-(-(n + 1) // 16) * 16 for n in SIZES) + 16
        buf = torch.full((total,), 7.0)
        views, at = [], 16
        for n in SIZES:
            x = torch.randn(n, generator=g)
            if kind == "v":  # second moments over twelve decades: eps changes the small ones' denominators
                x = x.square() * torch.pow(10.0, torch.empty(n).uniform_(-14, -2, generator=g))
            buf[at:at + n] = x * (1e-2 if kind == "m" else 1.0)
            views.append(buf[at:at + n])
            at += -(-(n + 1) // 16) * 16
        out.append((buf, views))
    return out


def test_each_element_is_torchs_five_operations_rounded_as_torch_rounds_them(interpreted):
    (pb, ps), (mb, ms), (vb, vs) = tensors()
    before = [t.clone() for t in ps]
    m0, v0 = mb.clone(), vb.clone()
    bc2s = torch.tensor(0.0447213)  # sqrt(1 - 0.999 ** 2)
    step_size = torch.tensor(-5.263158e-4)  # -lr / (1 - 0.9 ** 2)
    tail = FusedAdamTail(block=16, iters=2, num_warps=1)
    assert tail_applies(ps, ms, vs)
    tail(ps, ms, vs, bc2s, step_size, 1e-8)
    for i, (p, p0, m, v) in enumerate(zip(ps, before, ms, vs)):
        want = reference(p0, m, v, bc2s, step_size, 1e-8)
        assert torch.equal(p, want), f"tensor {i} ({p.numel()} elements): {(p != want).sum()} elements differ"
    assert torch.equal(mb, m0) and torch.equal(vb, v0)  # read only
    gaps = torch.ones_like(pb, dtype=torch.bool)
    for p in ps:
        gaps[p.storage_offset():p.storage_offset() + p.numel()] = False
    assert (pb[gaps] == 7.0).all()  # nothing written outside the tensors


def test_tensors_it_cannot_take_leave_the_update_to_torchs_operations(monkeypatch):
    (_, ps), (_, ms), (_, vs) = tensors()
    assert not tail_applies(ps[:1] + [torch.randn(8, 8).t()], ms[:2], vs[:2])  # not contiguous
    assert not tail_applies([torch.randn(40)[1:33]], ms[:1], vs[:1])  # not 16-byte aligned
    assert not tail_applies([torch.randn(32, dtype=torch.bfloat16)], ms[:1], vs[:1])

    class Spy(FusedAdamTail):
        def __call__(self, *a, **k):
            raise AssertionError("the fused tail ran on tensors it cannot take")

    p = [torch.randn(8, 8).t()]
    steps = [torch.zeros(())]
    adam_step.update(p, [torch.randn(8, 8)], [torch.zeros(8, 8)], [torch.zeros(8, 8)], steps, beta1=0.9, beta2=0.999,
                     lr=1e-3, weight_decay=0.0, eps=1e-8, decoupled_weight_decay=True, tail=Spy())
    assert torch.isfinite(p[0]).all() and steps[0].item() == 1.0


def test_a_tail_kernel_that_cannot_run_leaves_torchs_operations_and_warns_once(monkeypatch):
    from nemo_cudagraph_plugin.core import warn
    from nemo_cudagraph_plugin.core.adam_step import GroupScalarAdam

    monkeypatch.setattr(importlib.import_module("torch.optim.adam"), "_get_capturable_supported_devices",
                        lambda supports_xla=True: ["cuda", "cpu"])
    monkeypatch.setattr(warn, "_WARNED", set())

    def broken(self, device):
        raise RuntimeError("PTX compile failed")

    monkeypatch.setattr(FusedAdamTail, "warm", broken)
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(32)) for _ in range(3)]
    opt = torch.optim.AdamW(ps, lr=torch.tensor(1e-2), foreach=True, capturable=True)
    for p in ps:
        p.grad = torch.randn(32)
    opt.step()
    fast = GroupScalarAdam(opt, device_type="cpu", fused_tail=True)
    with pytest.warns(UserWarning, match="fused Adam tail kernel did not run .RuntimeError: PTX compile failed"):
        with fast.during_capture():
            opt.step()
    assert fast.tail is None and fast.counted_groups == 1 and torch.isfinite(ps[0]).all()
