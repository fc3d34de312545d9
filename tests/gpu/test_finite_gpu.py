"""The NaN guard's one-launch finite check (``core/finite.py``) on a real GPU, against a plain torch count.

Every case compares the Triton kernel with ``(~torch.isfinite(t)).sum()`` per tensor: exact counts, the right slots,
nothing flagged for finite extremes, non-finite values at chunk edges and in the last element, in a CUDA graph whose
tensors the graph allocates itself, and through ``NanGuard`` end to end.
"""

from __future__ import annotations

import pytest
import torch

from nemo_cudagraph_plugin.core import finite
from nemo_cudagraph_plugin.core.finite import FiniteCheck, triton_available
from nemo_cudagraph_plugin.core.nan_guard import NanGuard

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs CUDA and Triton")

DEV = torch.device("cuda")
PER_PROGRAM = finite.BLOCK * finite.ITERS


def _reference(tensors, slots, n_slots):
    ref = torch.zeros(n_slots, dtype=torch.float32)
    for t, s in zip(tensors, slots):
        ref[s] += float((~torch.isfinite(t.float())).sum())
    return ref


def _tensors(dtype, gen):
    sizes = [1, 7, 768, PER_PROGRAM - 1, PER_PROGRAM, PER_PROGRAM + 1, 3 * PER_PROGRAM + 5, 1 << 20]
    return [torch.randn(n, generator=gen, device=DEV).to(dtype) for n in sizes]


def _poison(tensors, gen):
    """NaN/+Inf/-Inf at the first and last element, at chunk and block edges, and at random places."""
    specials = [float("nan"), float("inf"), float("-inf")]
    for j, t in enumerate(tensors):
        n = t.numel()
        if j % 3 == 0:
            continue  # some tensors stay finite
        places = {0, n - 1, min(n - 1, finite.BLOCK), min(n - 1, PER_PROGRAM), min(n - 1, PER_PROGRAM - 1)}
        places |= set(torch.randint(0, n, (5,), generator=torch.Generator().manual_seed(j)).tolist())
        for k, i in enumerate(sorted(places)):
            t[i] = specials[k % 3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_counts_equal_torch_per_tensor_and_slot(dtype):
    gen = torch.Generator(device=DEV).manual_seed(0)
    ts = _tensors(dtype, gen)
    _poison(ts, gen)
    slots = [7, 3, 0, 5, 1, 6, 2, 4]  # not in order
    check = FiniteCheck(ts, slots)
    assert check.uses_triton and len(check.launches) == 1
    acc = torch.zeros(8, device=DEV)
    step = torch.zeros((), device=DEV)
    check.run(acc, step)
    ref = _reference(ts, slots, 8)
    assert torch.equal(acc.cpu(), ref), (acc.cpu(), ref)
    assert float(step) == float(ref.sum()) > 0
    check.run(acc)  # accumulates
    assert torch.equal(acc.cpu(), 2 * ref)


def test_finite_extremes_are_not_flagged():
    ts = [
        torch.full((1000,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16, device=DEV),
        torch.full((1000,), -torch.finfo(torch.float16).max, dtype=torch.float16, device=DEV),
        torch.full((1000,), torch.finfo(torch.float32).tiny / 4, dtype=torch.float32, device=DEV),  # subnormal
        torch.zeros(1000, dtype=torch.float32, device=DEV).neg_(),  # -0.0
    ]
    acc = torch.zeros(4, device=DEV)
    FiniteCheck(ts, [0, 1, 2, 3]).run(acc)
    assert acc.abs().sum().item() == 0


def test_mixed_dtypes_and_non_contiguous_tensors_take_their_own_paths():
    a = torch.randn(300, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(40, 50, device=DEV).t()  # non-contiguous: the _foreach_norm fallback
    c = torch.randn(1000, device=DEV)
    a[17] = float("nan")
    b[3, 4] = float("inf")
    c[999] = float("-inf")
    check = FiniteCheck([a, b, c], [2, 0, 1])
    assert len(check.launches) == 2 and len(check._fallback) == 1
    acc = torch.zeros(3, device=DEV)
    check.run(acc)
    assert acc.tolist() == [1.0, 1.0, 1.0]


def test_in_a_graph_that_allocates_the_tensors_the_graph_copies_the_table_in():
    """Owned gradients: allocated inside the capture; the check built there is refilled by the graph's copy node."""
    src = torch.randn(5000, device=DEV)
    acc = torch.zeros(2, device=DEV)
    guard_checks = []
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        FiniteCheck([src * 1], [0]).run(acc)  # warm the kernel up (compilation) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    acc.zero_()
    with torch.cuda.graph(g, stream=s):
        owned = src * 2  # graph pool memory
        half = owned[:2500] + 0
        check = FiniteCheck([owned, half], [0, 1])
        guard_checks.append(check)
        check.run(acc)
    for k in range(3):
        src.copy_(torch.randn(5000, device=DEV))
        if k == 1:
            src[10] = float("nan")
            src[4000] = float("inf")
        g.replay()
    torch.cuda.synchronize()
    assert acc.tolist() == [2.0, 1.0]  # the NaN replay: two in `owned`, one in `half`


def test_nan_guard_in_a_graph_names_the_parameter_and_sets_found_inf():
    ps = [torch.nn.Parameter(torch.zeros(n, device=DEV)) for n in (10, 70000, 33)]
    guard = NanGuard([(f"p{i}", p) for i, p in enumerate(ps)], DEV, "full")
    found = torch.zeros((), device=DEV)
    x = torch.ones(70000, device=DEV)

    def step():
        for p in ps:
            p.grad = None
        for p in ps:
            p.grad = x[: p.numel()] * 3  # a gradient the graph allocates
        guard.observe_grads(found_inf=found)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        step()
    guard.after_capture()  # as the runner does before the first replay
    guard.reset()
    g.replay()
    assert guard.check(raise_on_bad=False) is None and float(found) == 0.0
    x[50000] = float("nan")
    g.replay()
    torch.cuda.synchronize()
    assert float(found) == 1.0 and guard.skipped_steps() == 1
    report = guard.check(raise_on_bad=False)
    assert report is not None and "'p1'" in report and "p0" not in report and "p2" not in report, report


def test_check_built_in_a_capture_after_freed_temporaries_reads_its_own_table():
    """During a capture, memory freed earlier in the same capture is
    handed out again, and the graph's earlier kernels write it on every replay. A table allocated there and filled
    after the capture is overwritten (illegal address); the guard's table comes from an eager step instead."""
    ps = [torch.nn.Parameter(torch.zeros(n, device=DEV)) for n in (4096, 70000, 33)]
    guard = NanGuard([(f"p{i}", p) for i, p in enumerate(ps)], DEV, "full")
    x = torch.ones(70000, device=DEV)

    def step():
        for p in ps:
            p.grad = None
        junk = torch.empty(1 << 16, dtype=torch.int64, device=DEV)
        junk.fill_(-1)  # a kernel on memory freed below: the graph rewrites it on every replay
        del junk
        for p in ps:
            p.grad = x[: p.numel()] * 3
        guard.observe_grads()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # eager: compiles the kernel and allocates the table memory the capture will use
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        step()
    pending = list(guard._pending)
    assert pending and not pending[0].filled  # its table is written after the capture: no copy node in the graph
    guard.after_capture()
    guard.reset()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert guard.check(raise_on_bad=False) is None
    x[50000] = float("inf")
    g.replay()
    torch.cuda.synchronize()
    report = guard.check(raise_on_bad=False)
    assert report is not None and "'p1'" in report and "p0" not in report, report


def test_loss_watch_kernel_counts_at_the_first_non_finite_loss_only_and_in_a_graph():
    """``FiniteCheck.watch`` (Triton, grid-stride, one launch per dtype): counts equal torch's at the first NaN loss
    (stage 2), nothing while the loss is finite or after it fired, the second count after a loss that went bad first
    (stage 1), and the same when every call is one replay of a CUDA graph."""
    nan = float("nan")
    gen = torch.Generator(device=DEV).manual_seed(0)
    a = torch.randn(3 * PER_PROGRAM + 17, device=DEV, generator=gen).to(torch.bfloat16)  # several chunks
    b = torch.randn(5, device=DEV, generator=gen).to(torch.bfloat16)
    c = torch.randn(PER_PROGRAM + 1, device=DEV, generator=gen)  # float32: a second launch
    tensors = [a, b, c]
    check = FiniteCheck(tensors, [0, 1, 2])
    assert len(check.launches) == 2
    state = check.watch_state()
    acc = torch.zeros(3, device=DEV)
    loss_sum = torch.zeros((), device=DEV)
    loss = torch.zeros((), device=DEV)

    def call(v):
        loss.fill_(v)
        check.watch(acc, loss, loss_sum, state)

    graph = torch.cuda.CUDAGraph()
    for replay in (False, True):
        acc.zero_()
        finite.arm(state)
        for t in tensors:
            t.copy_(t.nan_to_num(0.0))
        if replay:
            call(1.0)  # the launch the graph records (a finite loss: nothing counted)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                check.watch(acc, loss, loss_sum, state)
        step = (lambda v: (loss.fill_(v), graph.replay())) if replay else call
        step(2.0)
        assert float(acc.sum()) == 0.0
        a[PER_PROGRAM + 5] = nan
        a[-1] = nan
        c[0] = float("inf")
        step(nan)  # first NaN loss: counted
        torch.cuda.synchronize()
        assert acc.cpu().tolist() == _reference(tensors, [0, 1, 2], 3).tolist() == [2.0, 0.0, 1.0]
        b.fill_(nan)  # spread: no longer counted
        step(nan)
        step(3.0)
        assert acc.cpu().tolist() == [2.0, 0.0, 1.0]
        # re-armed; the loss goes bad with every tensor finite: the next call counts what the update spoiled
        acc.zero_()
        finite.arm(state)
        for t in tensors:
            t.copy_(t.nan_to_num(0.0))
        step(nan)
        b[1] = nan
        step(4.0)
        c[3] = nan
        step(nan)
        torch.cuda.synchronize()
        assert acc.cpu().tolist() == [0.0, 1.0, 0.0], replay
        assert state[:, 0].tolist() == [0.0, 0.0, 2.0]  # both launches done; the torch-ops row unused


def test_checks_keep_addresses_not_the_tensors_they_checked():
    """A check kept for later steps (the guard keeps its last eager steps' checks) holds the addresses of what it
    checked, not the tensors: an eager step's gradients, dropped by the next ``zero_grad(set_to_none=True)``, are
    freed at once (else every kept check held a whole gradient alive for the rest of the run)."""
    import gc
    import weakref

    ts = [torch.ones(1 << 20, device=DEV) for _ in range(2)] + [torch.ones(8, device=DEV, dtype=torch.bfloat16)]
    refs = [weakref.ref(t) for t in ts]
    check = FiniteCheck(ts, [0, 1, 2])
    acc = torch.zeros(3, device=DEV)
    check.run(acc)
    torch.cuda.synchronize()
    assert acc.tolist() == [0.0, 0.0, 0.0] and len(check.launches) == 2
    del ts
    gc.collect()
    assert [r() is None for r in refs] == [True] * 3

    ps = [torch.nn.Parameter(torch.zeros(1 << 20, device=DEV)) for _ in range(2)]
    guard = NanGuard([(f"p{i}", p) for i, p in enumerate(ps)], DEV, "full")
    refs = []
    for _ in range(3):
        for p in ps:
            p.grad = torch.ones_like(p)  # allocated while the previous one lives: a new address, a new check
        refs += [weakref.ref(p.grad) for p in ps]
        guard.observe_grads()
    for p in ps:
        p.grad = None
    torch.cuda.synchronize()
    gc.collect()
    assert len(guard._checks) >= 2 and [r() is None for r in refs] == [True] * len(refs)
    assert guard.check(raise_on_bad=False) is None
