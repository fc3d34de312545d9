"""CPU tests of the batched FP8 transpose refresh (``nemo_cudagraph_plugin.fp8._multi_transpose``).

The Triton kernel itself runs in ``tests/gpu/test_multi_transpose_gpu.py``; here: the tile bookkeeping
it relies on, the per-pair path (what runs without Triton), input checks, and how
``Fp8RefreshPlan(fused=...)`` uses it with the TE 2.x doubles.
"""

from __future__ import annotations

import pytest
import torch
from fp8_doubles import TransposeLog, make_fp8_param, transpose_is_current, write_fp8_bytes

import nemo_cudagraph_plugin.core.warn as warn_mod
import nemo_cudagraph_plugin.fp8.refresh as refresh_mod
from nemo_cudagraph_plugin.fp8 import Fp8RefreshPlan, verify_fp8_transposes
from nemo_cudagraph_plugin.fp8 import _te_compat as te
from nemo_cudagraph_plugin.fp8._multi_transpose import MultiTranspose, plan_tiles


@pytest.fixture(autouse=True)
def _no_real_te(monkeypatch):
    monkeypatch.setattr(warn_mod, "_WARNED", set())
    monkeypatch.setattr(te, "te_version", lambda: None)


@pytest.mark.parametrize("bm,bk", [(16, 16), (32, 64), (64, 16)])
def test_plan_tiles_covers_every_element_exactly_once(bm, bk):
    shapes = [(1, 1), (3, 70), (64, 64), (65, 129), (200, 17)]
    tile_start, k_tiles, owner = plan_tiles(shapes, bm, bk)
    covered = [torch.zeros(m, k, dtype=torch.int32) for m, k in shapes]
    for pid, p in enumerate(owner):  # what the kernel computes for program ``pid``
        local = pid - tile_start[p]
        r0, c0 = (local // k_tiles[p]) * bm, (local % k_tiles[p]) * bk
        covered[p][r0 : r0 + bm, c0 : c0 + bk] += 1
    for (m, k), c in zip(shapes, covered):
        assert c.shape == (m, k) and bool((c == 1).all())
    assert tile_start[0] == 0 and owner == sorted(owner)


def test_plan_tiles_rejects_empty_matrices():
    with pytest.raises(ValueError, match="empty"):
        plan_tiles([(4, 0)])


def test_multi_transpose_per_pair_path_matches_te_layout():
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randint(0, 256, s, generator=g, dtype=torch.uint8) for s in [(8, 4), (2, 5, 7), (1, 9), (3,)]]
    dsts = [torch.empty(s.shape[-1], s.numel() // s.shape[-1], dtype=torch.uint8) for s in srcs]
    ptrs = [d.data_ptr() for d in dsts]
    mt = MultiTranspose(list(zip(srcs, dsts)), use_triton=False)
    assert not mt.uses_triton and len(mt) == 4
    mt.run()
    for s, d, p in zip(srcs, dsts, ptrs):
        assert torch.equal(d, s.reshape(-1, s.shape[-1]).t())  # TE: data [*M, K] -> transpose [K, *M]
        assert d.data_ptr() == p
    srcs[0].add_(1)  # new bytes in place: run again reads them
    mt.run()
    assert torch.equal(dsts[0], srcs[0].t())


def test_multi_transpose_accepts_float8_views():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 dtype in this torch")
    src = torch.randn(6, 10).to(torch.float8_e4m3fn)
    dst = torch.empty(10, 6, dtype=torch.float8_e4m3fn)
    MultiTranspose([(src, dst)], use_triton=False).run()
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8).t())


def test_multi_transpose_input_checks():
    u8 = torch.zeros(4, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="at least one"):
        MultiTranspose([])
    with pytest.raises(ValueError, match="1-byte"):
        MultiTranspose([(torch.zeros(4, 4), torch.zeros(4, 4))])
    with pytest.raises(ValueError, match="contiguous"):
        MultiTranspose([(torch.zeros(4, 8, dtype=torch.uint8)[:, :4], u8)])
    with pytest.raises(ValueError, match="bytes"):
        MultiTranspose([(u8, torch.zeros(3, 4, dtype=torch.uint8))])
    with pytest.raises(ValueError, match="power of two"):
        MultiTranspose([(u8, u8.clone())], block_k=48)


def _stale_te2(n=3, log=None):
    log = log or TransposeLog()
    params = [make_fp8_param("te2", (8 + i, 4 + 3 * i), fp8_name=f"w{i}", log=log, seed=i) for i in range(n)]
    for p in params:
        p._create_transpose()
        write_fp8_bytes(p)  # new bytes, flagged stale
    return params, log


def test_fused_plan_refreshes_in_place_and_sets_flags_like_create_transpose():
    params, log = _stale_te2()
    ptrs = [p._transpose.data_ptr() for p in params]
    plan = Fp8RefreshPlan(params, fused=True)
    assert plan.fused
    log.mark("refresh")
    assert plan.refresh() == 3 and plan.last_fused == 3
    for p, ptr in zip(params, ptrs):
        assert transpose_is_current(p) and not p._transpose_invalid and p._transpose.data_ptr() == ptr
        # _reset_caches() first, as the per-tensor path does; no per-tensor kernel
        assert log.seqs("reset", p.fp8_name)[-1] > log.seqs("mark", "refresh")[-1]
        assert log.count("compute", p.fp8_name) == 1  # only the set-up's _create_transpose above
    assert verify_fp8_transposes(params).ok
    # A second refresh reuses the set-up (one per distinct set of buffers).
    for i, p in enumerate(params):
        write_fp8_bytes(p, seed=50 + i, reset=False)  # raw write: TE is not told
    assert plan.refresh() == 3 and len(plan._multi) == 1
    assert all(transpose_is_current(p) for p in params)


def test_fused_plan_sends_other_generations_through_te_methods():
    log = TransposeLog()
    w18 = make_fp8_param("te1.8", (8, 4), fp8_name="old", log=log, seed=1, with_transpose=True)
    (w2,), _ = _stale_te2(1, log)
    write_fp8_bytes(w18)
    plan = Fp8RefreshPlan([w18, w2], fused=True)
    assert plan.refresh() == 2 and plan.last_fused == 1
    assert transpose_is_current(w18) and transpose_is_current(w2)
    assert log.count("compute", "old") >= 1


def test_fused_plan_first_run_inside_a_capture_uses_te_method(monkeypatch):
    params, log = _stale_te2()
    plan = Fp8RefreshPlan(params, fused=True)
    monkeypatch.setattr(refresh_mod, "_capturing", lambda: True)
    assert plan.refresh() == 3 and plan.last_fused == 0 and not plan._multi  # no host copy while capturing
    assert all(transpose_is_current(p) for p in params)
    assert all(log.count("compute", p.fp8_name) == 2 for p in params)
    monkeypatch.setattr(refresh_mod, "_capturing", lambda: False)
    plan.refresh()  # outside the capture: set up, and used from then on
    monkeypatch.setattr(refresh_mod, "_capturing", lambda: True)
    for p in params:
        write_fp8_bytes(p, reset=False)
    assert plan.refresh() == 3 and plan.last_fused == 3
    assert all(transpose_is_current(p) for p in params)


def test_fused_plan_keeps_old_set_ups_alive_when_buffers_move():
    params, _ = _stale_te2(2)
    plan = Fp8RefreshPlan(params, fused=True)
    plan.refresh()
    first = next(iter(plan._multi.values()))
    params[0]._transpose = torch.empty_like(params[0]._transpose)  # e.g. a model reloaded into new storage
    params[0]._reset_caches()
    plan.refresh()
    assert len(plan._multi) == 2 and first in plan._multi.values()  # a graph may still launch the first
    assert all(transpose_is_current(p) for p in params)


def test_fused_auto_without_triton_uses_te_methods_and_bad_values_are_refused():
    params, log = _stale_te2(1)
    plan = Fp8RefreshPlan(params)  # "auto": no CUDA/Triton here
    assert not plan.fused
    plan.refresh()
    assert plan.last_fused == 0 and log.count("compute", "w0") == 2
    with pytest.raises(ValueError, match="fused"):
        Fp8RefreshPlan(params, fused="yes")


def test_fused_auto_falls_back_to_te_methods_when_the_kernel_cannot_be_set_up(monkeypatch):
    params, log = _stale_te2(2)
    monkeypatch.setattr(refresh_mod, "triton_available", lambda: True)
    plan = Fp8RefreshPlan(params)  # "auto" with (pretended) Triton

    def broken(*args, **kwargs):
        raise RuntimeError("triton compile error")

    monkeypatch.setattr(refresh_mod, "MultiTranspose", broken)
    with pytest.warns(RuntimeWarning, match="per-tensor"):
        assert plan.refresh() == 2
    assert not plan.fused and plan.last_fused == 0
    assert all(transpose_is_current(p) for p in params)
    strict = Fp8RefreshPlan(params, fused=True)
    with pytest.raises(RuntimeError, match="compile"):
        strict.refresh()
