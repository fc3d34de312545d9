"""Memset nodes of a captured graph rewritten as fill kernels (``core/_cuda_nodes.py``) on a real GPU.

Memsets of every width the driver records (8-, 16- and 32-bit, aligned and not, odd lengths, non-zero values) are
put into a captured graph with the driver's own ``cuMemsetD*Async`` on the capturing stream, next to torch's split
reduction (whose semaphores torch zeroes with a memset). After the rewrite the graph has no memset node left but
the one the fill kernels cannot express, and every byte a replay writes equals what the memsets wrote.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from nemo_cudagraph_plugin.core import _cuda_nodes

pytestmark = pytest.mark.skipif(_cuda_nodes.unavailable() is not None, reason="needs the CUDA driver API")

DEV = torch.device("cuda")


def _driver_memsets() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    for name, arg in (("cuMemsetD8Async", ctypes.c_ubyte), ("cuMemsetD16Async", ctypes.c_ushort),
                      ("cuMemsetD32Async", ctypes.c_uint)):
        getattr(lib, name).argtypes = [ctypes.c_uint64, arg, ctypes.c_size_t, ctypes.c_void_p]
        getattr(lib, name).restype = ctypes.c_int
    return lib


# (function, byte offset into the buffer, value, element count): every fill kernel, every alignment case
CASES = [
    ("cuMemsetD8Async", 0, 0x00, 4096),       # 16-byte stores
    ("cuMemsetD8Async", 3, 0xA7, 37),         # unaligned, odd length: byte stores
    ("cuMemsetD8Async", 128, 0x5C, 20),       # 4-byte stores of a repeated byte
    ("cuMemsetD16Async", 256, 0xBEEF, 64),    # 16-bit pattern, 16-byte stores
    ("cuMemsetD16Async", 514, 0x1234, 3),     # 16-bit, not 4-byte aligned: stays a memset
    ("cuMemsetD32Async", 1024, 0xDEADBEEF, 5),  # 4-byte stores
    ("cuMemsetD32Async", 2048, 0x3F800000, 1 << 16),  # 16-byte stores, many blocks
]
_SIZE = {"cuMemsetD8Async": 1, "cuMemsetD16Async": 2, "cuMemsetD32Async": 4}


def _expected(buf_len: int) -> torch.Tensor:
    want = torch.full((buf_len,), 0x11, dtype=torch.uint8)
    for fn, off, value, n in CASES:
        size = _SIZE[fn]
        pattern = torch.tensor(list(value.to_bytes(size, "little")), dtype=torch.uint8)
        want[off:off + n * size] = pattern.repeat(n)
    return want


def _capture(rewrite: bool):
    buf_len = 2048 + 4 * (1 << 16) + 64
    buf = torch.full((buf_len,), 0x11, dtype=torch.uint8, device=DEV)
    x = torch.randn(1 << 16, 16, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.sum(0)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    lib = _driver_memsets()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        stream = torch.cuda.current_stream().cuda_stream
        for fn, off, value, n in CASES:
            assert getattr(lib, fn)(buf.data_ptr() + off, value, n, stream) == 0
        total = x.sum(0)  # a split reduction: torch zeroes its semaphores with a memset
    raw = g.raw_cuda_graph()
    before = _cuda_nodes.node_types(raw)
    res = _cuda_nodes.rewrite_memsets(raw, torch.cuda.get_device_properties(DEV).multi_processor_count) if rewrite else None
    after = _cuda_nodes.node_types(raw)
    g.instantiate()
    return g, buf, x, total, before, after, res


def test_memset_nodes_become_fill_kernels_that_write_the_same_bytes():
    g, buf, x, total, before, after, res = _capture(rewrite=True)
    n_cases = len(CASES)
    assert before["memset"] > n_cases, f"torch's reduction recorded no memset: {before}"
    assert (res.replaced, res.kept) == (before["memset"] - 1, 1), (res, before)
    assert after["memset"] == 1  # the unaligned 16-bit memset
    assert after["kernel"] == before["kernel"] + res.replaced
    for _ in range(3):  # the graph rewrites its bytes on every replay
        buf.fill_(0x11)
        x.normal_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(buf.cpu(), _expected(buf.numel()))
        torch.testing.assert_close(total, x.sum(0), rtol=0, atol=1e-4)


def test_the_rewritten_graph_equals_the_captured_one_bitwise():
    ref = _capture(rewrite=False)
    new = _capture(rewrite=True)
    assert ref[5]["memset"] == ref[4]["memset"]  # not rewritten
    for _ in range(2):
        for g, buf, x, *_ in (ref, new):
            buf.fill_(0x11)
            torch.manual_seed(0)
            x.copy_(torch.randn(x.shape, device=DEV))
            g.replay()
        torch.cuda.synchronize()
        assert torch.equal(ref[1], new[1])
        assert torch.equal(ref[3], new[3])


# ------------------------------------------------------------------------------------------------ GraphIO


def _io_graph(n: int):
    """A graph computing ``out = inp + 1`` on uint8 buffers of ``n`` bytes, with GraphIO copy nodes at its edges."""
    inp = torch.zeros(n, dtype=torch.uint8, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        inp + 1  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        out = inp + 1
    raw = g.raw_cuda_graph()
    before = _cuda_nodes.node_types(raw)["kernel"]
    io = _cuda_nodes.GraphIO(raw, [(inp.data_ptr(), n)], [(out.data_ptr(), n)], 132)
    assert _cuda_nodes.node_types(raw)["kernel"] == before + 2
    g.instantiate()
    io.instantiated(g.raw_cuda_graph_exec())
    return g, io, inp, out


@pytest.mark.parametrize("n", [1, 37, 4096, (1 << 20) + 3])
@pytest.mark.parametrize("src_off, dst_off", [(0, 0), (1, 0), (0, 5), (3, 16), (8, 8)])
def test_graph_io_nodes_copy_the_bound_batch_in_and_outputs_out_at_any_alignment(n, src_off, dst_off):
    g, io, inp, out = _io_graph(n)
    for step in range(3):  # each replay reads the batch bound for it and writes the memory bound for it
        src_buf = torch.randint(0, 250, (n + 32,), dtype=torch.uint8, device=DEV)
        dst_buf = torch.full((n + 32,), 0xEE, dtype=torch.uint8, device=DEV)
        src, dst = src_buf[src_off:src_off + n], dst_buf[dst_off:dst_off + n]
        io.bind([src], [dst])
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(inp, src), "the batch was not copied into the input buffer"
        assert torch.equal(dst, src + 1), f"step {step}: the output was not copied to the bound memory"
        assert torch.equal(out, src + 1)
        # bytes around the bound output are untouched
        assert (dst_buf[:dst_off] == 0xEE).all() and (dst_buf[dst_off + n:] == 0xEE).all()


def test_graph_io_copies_many_buffers_of_any_size_and_alignment_with_a_node_per_eight():
    """More inputs and outputs than one copy node takes (``_COPY_SEGMENTS``): one node per that many on each side;
    every buffer is copied whole, at its own size and alignment, and nothing around a bound output is touched."""
    k = _cuda_nodes._COPY_SEGMENTS
    sizes = [1, 4096, 37, 16, (1 << 20) + 3, 0, 48, 5, 100, 4099][: k + 2]  # k + 2 inputs and outputs
    ins = [torch.zeros(n, dtype=torch.uint8, device=DEV) for n in sizes]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        [x + 1 for x in ins]
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        outs = [x + 1 for x in ins]
    raw = g.raw_cuda_graph()
    before = _cuda_nodes.node_types(raw)["kernel"]
    io = _cuda_nodes.GraphIO(raw, [(x.data_ptr(), x.numel()) for x in ins], [(y.data_ptr(), y.numel()) for y in outs],
                             132)
    assert _cuda_nodes.node_types(raw)["kernel"] == before + 2 * 2  # k + 2 buffers: two nodes a side
    g.instantiate()
    io.instantiated(g.raw_cuda_graph_exec())
    for step in range(3):
        srcs, dsts, bufs = [], [], []
        for i, n in enumerate(sizes):
            so, do = (i + step) % 5, (3 * i + step) % 7
            sb = torch.randint(0, 250, (n + 16,), dtype=torch.uint8, device=DEV)
            db = torch.full((n + 16,), 0xEE, dtype=torch.uint8, device=DEV)
            srcs.append(sb[so:so + n])
            dsts.append(db[do:do + n])
            bufs.append((db, do, n))
        io.bind(srcs, dsts)
        g.replay()
        torch.cuda.synchronize()
        for i, (src, dst, (db, do, n)) in enumerate(zip(srcs, dsts, bufs)):
            assert torch.equal(ins[i], src), f"step {step}: input {i} ({n} bytes) was not copied in"
            assert torch.equal(dst, src + 1), f"step {step}: output {i} ({n} bytes) was not copied out"
            assert (db[:do] == 0xEE).all() and (db[do + n:] == 0xEE).all(), f"step {step}: around output {i}"


def test_graph_io_a_queued_replay_keeps_the_addresses_it_was_launched_with():
    """bind() for the next step while this step's replay still waits in the queue (behind a 50 ms sleep kernel):
    the queued replay reads and writes what was bound for it."""
    n = 1 << 16
    g, io, inp, out = _io_graph(n)
    a = torch.randint(0, 250, (n,), dtype=torch.uint8, device=DEV)
    b = torch.randint(0, 250, (n,), dtype=torch.uint8, device=DEV)
    da, db = torch.empty_like(a), torch.empty_like(b)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    io.bind([a], [da])
    g.replay()
    io.bind([b], [db])
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(da, a + 1) and torch.equal(db, b + 1)


# ------------------------------------------------------------------------------------------------ failure


class _FailingAt:
    """Makes the real driver layer's ``what`` raise at its ``n``-th call (the calls before it really happen)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, what: str, n: int) -> None:
        drv = _cuda_nodes._get()
        real = getattr(drv, what)
        self.calls = 0

        def failing(*args, **kwargs):
            self.calls += 1
            if self.calls == n:
                raise RuntimeError(f"{what} failed: injected")
            return real(*args, **kwargs)

        monkeypatch.setattr(drv, what, failing)


@pytest.mark.parametrize("what, n", [("add_kernel", 3), ("add_edges", 2), ("destroy", 2)])
def test_a_memset_rewrite_that_fails_midway_leaves_the_captured_graph_on_the_real_driver(monkeypatch, what, n):
    """A failure after some fill kernels were added (or memsets removed) is undone: the graph has the nodes and
    edges it was captured with and replays bitwise as the graph never rewritten."""
    ref = _capture(rewrite=False)
    buf_len = ref[1].numel()
    g, buf, x, total = ref[:4]
    # a second capture, rewritten with a failure injected
    _FailingAt(monkeypatch, what, n)
    buf2 = torch.full((buf_len,), 0x11, dtype=torch.uint8, device=DEV)
    lib = _driver_memsets()
    g2 = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g2):
        stream = torch.cuda.current_stream().cuda_stream
        for fn, off, value, cnt in CASES:
            assert getattr(lib, fn)(buf2.data_ptr() + off, value, cnt, stream) == 0
        total2 = x.sum(0)
    raw = g2.raw_cuda_graph()
    shape = _cuda_nodes.graph_shape(raw)
    with pytest.raises(_cuda_nodes.RewriteError, match="injected"):
        _cuda_nodes.rewrite_memsets(raw, torch.cuda.get_device_properties(DEV).multi_processor_count)
    assert _cuda_nodes.graph_shape(raw) == shape
    g2.instantiate()
    for _ in range(2):
        for bb in (buf, buf2):
            bb.fill_(0x11)
        x.normal_()
        g.replay()
        g2.replay()
        torch.cuda.synchronize()
        assert torch.equal(buf, buf2) and torch.equal(buf2.cpu(), _expected(buf_len))
        assert torch.equal(total, total2)


@pytest.mark.parametrize("what, n", [("add_kernel", 2), ("add_edges", 2)])
def test_graph_io_that_fails_midway_leaves_the_captured_graph_on_the_real_driver(monkeypatch, what, n):
    inp = torch.zeros(4096, dtype=torch.uint8, device=DEV)
    inp + 1
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        out = inp + 1
    raw = g.raw_cuda_graph()
    shape = _cuda_nodes.graph_shape(raw)
    _FailingAt(monkeypatch, what, n)
    with pytest.raises(_cuda_nodes.RewriteError, match="injected"):
        _cuda_nodes.GraphIO(raw, [(inp.data_ptr(), 4096)], [(out.data_ptr(), 4096)], 132)
    assert _cuda_nodes.graph_shape(raw) == shape
    g.instantiate()
    inp.fill_(41)
    g.replay()
    torch.cuda.synchronize()
    assert (out == 42).all()
