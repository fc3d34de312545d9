"""The one-launch FP8 transpose kernel (Triton) on a GPU: bytes equal torch's transpose, in and out of graphs.

No TransformerEngine needed: the kernel moves bytes; ``tests/gpu/test_fp8_te.py`` runs it inside the real
refresh (``Fp8RefreshPlan(fused="auto")`` is the default there).
"""

from __future__ import annotations

import pytest
import torch

from nemo_cudagraph_plugin.fp8._multi_transpose import MultiTranspose, triton_available

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if not triton_available():
    pytest.skip("Triton does not import here (CUDA builds of torch ship it)", allow_module_level=True)

SHAPES = [(1, 1), (1, 17), (65, 3), (2, 33, 70), (64, 64), (768, 2304), (3072, 768), (127, 4097)]


def _pairs(shapes, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    srcs = [torch.randint(0, 256, s, generator=g, dtype=torch.uint8, device="cuda") for s in shapes]
    dsts = [torch.full((s.shape[-1], s.numel() // s.shape[-1]), 7, dtype=torch.uint8, device="cuda") for s in srcs]
    return srcs, dsts


def _check(srcs, dsts):
    for s, d in zip(srcs, dsts):
        assert torch.equal(d, s.reshape(-1, s.shape[-1]).t()), tuple(s.shape)


@pytest.mark.parametrize("bm,bk,nw", [(32, 64, 1), (16, 16, 1), (64, 64, 4), (128, 32, 8), (16, 256, 4)])
def test_triton_kernel_matches_torch_transpose(bm, bk, nw):
    srcs, dsts = _pairs(SHAPES)
    mt = MultiTranspose(list(zip(srcs, dsts)), block_m=bm, block_k=bk, num_warps=nw)
    assert mt.uses_triton
    mt.run()
    _check(srcs, dsts)


def test_float8_tensors_and_many_pairs():
    srcs = [torch.randn(16 + i, 32 + 3 * i, device="cuda").to(torch.float8_e4m3fn) for i in range(200)]
    dsts = [torch.empty(s.shape[1], s.shape[0], dtype=torch.float8_e4m3fn, device="cuda") for s in srcs]
    MultiTranspose(list(zip(srcs, dsts))).run()
    _check([s.view(torch.uint8) for s in srcs], [d.view(torch.uint8) for d in dsts])


def test_captured_launch_reads_the_current_bytes_on_every_replay():
    srcs, dsts = _pairs(SHAPES, seed=1)
    ptrs = [d.data_ptr() for d in dsts]
    mt = MultiTranspose(list(zip(srcs, dsts)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mt.run()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mt.run()
    for _ in range(3):
        for s in srcs:
            s.random_(0, 256)  # new bytes in place, as an optimizer writes them
        graph.replay()
        torch.cuda.synchronize()
        _check(srcs, dsts)
    assert [d.data_ptr() for d in dsts] == ptrs


def test_set_up_and_launch_do_not_sync_with_the_host():
    # The first refresh (which sets the kernel up) may run in the engine's last warm-up step, which is checked
    # under sync-debug mode "error".
    srcs, dsts = _pairs(SHAPES, seed=2)
    MultiTranspose(list(zip(srcs, dsts))).run()  # compile outside the check
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mt = MultiTranspose(list(zip(srcs, dsts)))
        mt.run()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    _check(srcs, dsts)


def test_offsets_past_two_to_the_31():
    m, k = 3, (1 << 31) // 3 + 4096  # M*K > 2**31: int64 offsets
    src = torch.randint(0, 256, (m, k), dtype=torch.uint8, device="cuda")
    dst = torch.empty(k, m, dtype=torch.uint8, device="cuda")
    MultiTranspose([(src, dst)]).run()
    assert torch.equal(dst, src.t())


def test_building_inside_a_capture_is_refused():
    srcs, dsts = _pairs(SHAPES[:2])
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="outside CUDA graph capture"):
        with torch.cuda.graph(graph):
            MultiTranspose(list(zip(srcs, dsts)))
