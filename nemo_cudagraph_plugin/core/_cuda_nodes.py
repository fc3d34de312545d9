"""A captured graph's memset nodes rewritten as kernel nodes, through the CUDA driver API (ctypes).

Why: in a replayed graph a memset node is followed by an idle gap of 3-4.5 µs before the next kernel
starts, against ~0.5 µs between two kernels (H200, CUDA 13; profile in ``docs/gpu-evidence``). torch's split
reductions zero their semaphores with ``cudaMemsetAsync`` and cuDNN's attention zeroes its accumulators the
same way: 72 memsets per step of a 12-layer GPT. A kernel node that writes the same bytes, with the same
dependencies, takes each one's place: 129-142 µs less per step there (``benchmarks/graph_memsets.py``).

What is rewritten: 1-D memset nodes (``height == 1``) of 1-, 2- or 4-byte elements. The fill kernel
stores 16, 4 or 1 byte(s) per thread, whichever the address and size allow (a 2- or 4-byte memset whose
address or size is not 4-byte aligned stays a memset). Everything else in the graph is left alone; the
graph must not be instantiated yet (``torch.cuda.CUDAGraph(keep_graph=True)``).

This is the only module that calls the driver (versioned entry points of CUDA 12.3 and newer, e.g.
``cuGraphNodeGetDependencies_v2``); where one is missing, :func:`unavailable` says so and graphs keep their
memsets.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["FillPlan", "GraphIO", "RewriteResult", "fill_plan", "node_types", "rewrite_memsets", "unavailable"]

# CUgraphNodeType
_KERNEL, _MEMSET = 0, 2
_THREADS = 256

def _grid_stride(index: str, tmp: str, stride: str) -> str:
    """PTX setting ``index`` to this thread's global index and ``stride`` to the grid's thread count (uses
    %r2-%r5 and ``tmp``): the start of every grid-stride loop here."""
    return (f"    mov.u32 %r2, %ctaid.x;\n    mov.u32 %r3, %ntid.x;\n    mov.u32 %r4, %tid.x;\n"
            f"    mov.u32 %r5, %nctaid.x;\n    mul.wide.u32 {index}, %r2, %r3;\n    cvt.u64.u32 {tmp}, %r4;\n"
            f"    add.u64 {index}, {index}, {tmp};\n    mul.wide.u32 {stride}, %r5, %r3;")


# The fill kernels: grid-stride loops over ``n`` units of 16, 4 or 1 byte(s). PTX, so no compiler is
# needed; the driver compiles it for the device once per context. One body, three stores.
_PTX_HEAD = """
.version 7.0
.target sm_70
.address_size 64
"""
_PTX_KERNEL = """
.visible .entry {name}(.param .u64 dst, .param .u32 val, .param .u64 n)
{{
    .reg .pred %p;{regs}
    .reg .b32 %r<6>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [dst];
    ld.param.u32 %r1, [val];
    ld.param.u64 %rd2, [n];
    cvta.to.global.u64 %rd1, %rd1;{setup}
{grid}
L{tag}:
    setp.ge.u64 %p, %rd3, %rd2;
    @%p bra D{tag};{address}
    {store}
    add.u64 %rd3, %rd3, %rd5;
    bra L{tag};
D{tag}:
    ret;
}}
"""
# The batch-in / outputs-out copy of a replayed step (GraphIO): up to _COPY_SEGMENTS spans, each ``nbytes`` from
# ``src`` to ``dst``, one after the other in every thread (a node per span would cost the device a kernel and a gap
# each, ~1.8 µs, and the host a driver call each per replay). Per span, 16 bytes per thread where both addresses and
# the size allow (decided per launch: a batch may sit at another alignment than the one captured), else one byte per
# thread. Grid-stride, so the grid fixed at capture fits any alignment; an unused span has nbytes 0 and copies nothing.
_COPY_SEGMENTS = 8
_PTX_COPY_HEAD = """
.visible .entry ncg_copy({params})
{{
    .reg .pred %p<3>;
    .reg .b16 %rs1;
    .reg .b32 %r<10>;
    .reg .b64 %rd<15>;
{grid}
    mov.u64 %rd14, %rd5;
"""
_PTX_COPY_SPAN = """    ld.param.u64 %rd1, [dst{i}];
    ld.param.u64 %rd2, [src{i}];
    ld.param.u64 %rd3, [nbytes{i}];
    or.b64 %rd4, %rd1, %rd2;
    or.b64 %rd4, %rd4, %rd3;
    and.b64 %rd4, %rd4, 15;
    setp.ne.u64 %p2, %rd4, 0;
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u64 %rd5, %rd14;
    @%p2 bra BYTES{i};
    shr.u64 %rd8, %rd3, 4;
VEC{i}:
    setp.ge.u64 %p1, %rd5, %rd8;
    @%p1 bra DONE{i};
    shl.b64 %rd9, %rd5, 4;
    add.u64 %rd10, %rd2, %rd9;
    add.u64 %rd11, %rd1, %rd9;
    ld.global.v4.u32 {%r6, %r7, %r8, %r9}, [%rd10];
    st.global.v4.u32 [%rd11], {%r6, %r7, %r8, %r9};
    add.u64 %rd5, %rd5, %rd7;
    bra VEC{i};
BYTES{i}:
    setp.ge.u64 %p1, %rd5, %rd3;
    @%p1 bra DONE{i};
    add.u64 %rd12, %rd2, %rd5;
    add.u64 %rd13, %rd1, %rd5;
    ld.global.u8 %rs1, [%rd12];
    st.global.u8 [%rd13], %rs1;
    add.u64 %rd5, %rd5, %rd7;
    bra BYTES{i};
DONE{i}:
"""
_PTX_COPY = (
    _PTX_COPY_HEAD.format(params=", ".join(f".param .u64 {a}{i}" for i in range(_COPY_SEGMENTS)
                                           for a in ("dst", "src", "nbytes")), grid="{grid}")
    + "".join(_PTX_COPY_SPAN.replace("{i}", str(i)) for i in range(_COPY_SEGMENTS))
    + "    ret;\n}\n"
)
_KERNELS = ("ncg_fill_v4", "ncg_fill_u32", "ncg_fill_u8", "ncg_copy")
_PTX = _PTX_HEAD + _PTX_COPY.replace("{grid}", _grid_stride("%rd5", "%rd6", "%rd7")) + "".join(
    _PTX_KERNEL.format(name=name, tag=tag, regs=regs, setup=setup, address=address, store=store,
                       grid=_grid_stride("%rd3", "%rd4", "%rd5"))
    for name, tag, regs, setup, address, store in (
        ("ncg_fill_v4", 4, "", "", "\n    shl.b64 %rd6, %rd3, 4;\n    add.u64 %rd7, %rd1, %rd6;",
         "st.global.v4.u32 [%rd7], {%r1, %r1, %r1, %r1};"),
        ("ncg_fill_u32", 1, "", "", "\n    shl.b64 %rd6, %rd3, 2;\n    add.u64 %rd7, %rd1, %rd6;",
         "st.global.u32 [%rd7], %r1;"),
        ("ncg_fill_u8", 0, "\n    .reg .b16 %rs1;", "\n    cvt.u16.u32 %rs1, %r1;", "\n    add.u64 %rd7, %rd1, %rd3;",
         "st.global.u8 [%rd7], %rs1;"),
    )
)


@dataclass(frozen=True)
class FillPlan:
    """The kernel that writes what one memset node writes: ``units`` stores of ``pattern``."""

    kernel: str  # ncg_fill_v4 / ncg_fill_u32 / ncg_fill_u8
    pattern: int  # the 32-bit word stored (the low byte for ncg_fill_u8)
    units: int


def fill_plan(dst: int, value: int, element_size: int, width: int, height: int) -> Optional[FillPlan]:
    """The fill for a memset node (``CUDA_MEMSET_NODE_PARAMS``), or None where it stays a memset."""
    if height != 1 or width <= 0 or element_size not in (1, 2, 4):
        return None
    nbytes = width * element_size
    if element_size == 1:
        word = (value & 0xFF) * 0x01010101
    elif element_size == 2:
        word = (value & 0xFFFF) * 0x00010001
    else:
        word = value & 0xFFFFFFFF
    if dst % 16 == 0 and nbytes % 16 == 0:
        return FillPlan("ncg_fill_v4", word, nbytes // 16)
    if dst % 4 == 0 and nbytes % 4 == 0:
        return FillPlan("ncg_fill_u32", word, nbytes // 4)
    if element_size == 1:
        return FillPlan("ncg_fill_u8", word & 0xFF, nbytes)
    return None


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p),
                ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


_P, _S = ctypes.c_void_p, ctypes.c_size_t
# Looked up by their versioned symbol names, so each has exactly the signature written here on every driver that
# exports it (CUDA 12.3 and newer; CUDA 13's headers map the plain names of the edge functions to the _v2 ones).
_SIGNATURES: dict[str, tuple] = {
    "cuCtxGetCurrent": (_P,),
    "cuModuleLoadData": (_P, ctypes.c_char_p),
    "cuModuleGetFunction": (_P, _P, ctypes.c_char_p),
    "cuGraphGetNodes": (_P, _P, _P),
    "cuGraphNodeGetType": (_P, _P),
    "cuGraphMemsetNodeGetParams": (_P, _P),
    "cuGraphNodeGetDependencies_v2": (_P, _P, _P, _P),  # node, nodes, edge data, count
    "cuGraphNodeGetDependentNodes_v2": (_P, _P, _P, _P),
    "cuGraphAddKernelNode_v2": (_P, _P, _P, _S, _P),  # CUDA_KERNEL_NODE_PARAMS_v2
    "cuGraphAddDependencies_v2": (_P, _P, _P, _P, _S),  # graph, from, to, edge data, count
    "cuGraphDestroyNode": (_P,),
    "cuGraphGetRootNodes": (_P, _P, _P),
    "cuGraphExecKernelNodeSetParams_v2": (_P, _P, _P),  # exec, node (of the graph it was made from), params
}
_MIN_DRIVER = 12030


class _Driver:
    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.lib = lib
        missing = [n for n in ("cuDriverGetVersion", "cuGetErrorString", *_SIGNATURES) if not hasattr(lib, n)]
        if missing:
            raise OSError(f"libcuda.so.1 lacks {', '.join(missing)}")
        for name in ("cuDriverGetVersion", "cuGetErrorString"):
            getattr(lib, name).restype = ctypes.c_int
        v = ctypes.c_int()
        self.check(lib.cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
        if v.value < _MIN_DRIVER:
            raise OSError(f"CUDA driver {v.value} is older than 12.3")
        self.version = v.value
        self.fn: dict[str, Any] = {}
        for name, args in _SIGNATURES.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = list(args), ctypes.c_int
            self.fn[name] = f
        self.functions: dict[tuple[int, str], ctypes.c_void_p] = {}  # (context, kernel) -> CUfunction
        self.modules: list[ctypes.c_void_p] = []  # loaded once per context, never unloaded

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")

    def function(self, name: str) -> ctypes.c_void_p:
        ctx = ctypes.c_void_p()
        self.check(self.fn["cuCtxGetCurrent"](ctypes.byref(ctx)), "cuCtxGetCurrent")
        key = (ctx.value or 0, name)
        if key not in self.functions:
            mod = ctypes.c_void_p()
            self.check(self.fn["cuModuleLoadData"](ctypes.byref(mod), ctypes.c_char_p(_PTX.encode())), "cuModuleLoadData")
            self.modules.append(mod)
            for k in _KERNELS:
                f = ctypes.c_void_p()
                self.check(self.fn["cuModuleGetFunction"](ctypes.byref(f), mod, k.encode()), "cuModuleGetFunction")
                self.functions[(key[0], k)] = f
        return self.functions[key]

    def nodes(self, graph: int) -> list[int]:
        n = ctypes.c_size_t(0)
        self.check(self.fn["cuGraphGetNodes"](ctypes.c_void_p(graph), None, ctypes.byref(n)), "cuGraphGetNodes")
        arr = (ctypes.c_void_p * n.value)()
        self.check(self.fn["cuGraphGetNodes"](ctypes.c_void_p(graph), arr, ctypes.byref(n)), "cuGraphGetNodes")
        return [a or 0 for a in arr[: n.value]]

    def node_type(self, node: int) -> int:
        t = ctypes.c_int()
        self.check(self.fn["cuGraphNodeGetType"](ctypes.c_void_p(node), ctypes.byref(t)), "cuGraphNodeGetType")
        return t.value

    def _edges(self, fn: str, node: int) -> list[int]:
        # Edge data NULL: the driver refuses (an error, raised) an edge that carries data we would drop.
        f = self.fn[fn]
        n = ctypes.c_size_t(0)
        self.check(f(ctypes.c_void_p(node), None, None, ctypes.byref(n)), fn)
        if n.value == 0:
            return []
        arr = (ctypes.c_void_p * n.value)()
        self.check(f(ctypes.c_void_p(node), arr, None, ctypes.byref(n)), fn)
        return [a or 0 for a in arr[: n.value]]

    def replace_memset(self, graph: int, node: int, sm_count: int) -> bool:
        """Put a fill kernel in ``node``'s place; False (graph unchanged) where the memset stays."""
        p = _MemsetParams()
        self.check(self.fn["cuGraphMemsetNodeGetParams"](ctypes.c_void_p(node), ctypes.byref(p)), "cuGraphMemsetNodeGetParams")
        plan = fill_plan(p.dst, p.value, p.elementSize, p.width, p.height)
        if plan is None:
            return False
        deps = self._edges("cuGraphNodeGetDependencies_v2", node)
        after = self._edges("cuGraphNodeGetDependentNodes_v2", node)
        dst, val, n = ctypes.c_uint64(p.dst), ctypes.c_uint32(plan.pattern), ctypes.c_uint64(plan.units)
        kp = self.kernel_params(plan.kernel, (dst, val, n), max(1, min(-(-plan.units // _THREADS), 4 * sm_count)))
        self.add_kernel(graph, kp, deps, after)
        # The memset's own edges go with it; what waited for it now waits for the kernel.
        self.check(self.fn["cuGraphDestroyNode"](ctypes.c_void_p(node)), "cuGraphDestroyNode")
        return True

    def kernel_params(self, kernel: str, args: tuple, grid: int) -> _KernelParams:
        """Launch parameters of one of the module's kernels; ``args`` (ctypes values) are read when a node is
        added or updated with them (the driver copies them)."""
        arr = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        kp = _KernelParams()
        kp.func = self.function(kernel).value
        kp.gridDimX, kp.gridDimY, kp.gridDimZ = grid, 1, 1
        kp.blockDimX, kp.blockDimY, kp.blockDimZ = _THREADS, 1, 1
        kp.kernelParams = ctypes.cast(arr, ctypes.c_void_p)
        kp._keep = (arr, args)  # alive as long as the params are
        return kp

    def add_kernel(self, graph: int, kp: _KernelParams, deps: list[int], before: list[int]) -> int:
        """A kernel node after ``deps`` that the nodes ``before`` wait for; returns it. Raises with the graph as it
        was where an edge cannot be added."""
        new = ctypes.c_void_p()
        dep_arr = (ctypes.c_void_p * max(len(deps), 1))(*deps)
        self.check(self.fn["cuGraphAddKernelNode_v2"](ctypes.byref(new), ctypes.c_void_p(graph), dep_arr,
                                                    ctypes.c_size_t(len(deps)), ctypes.byref(kp)), "cuGraphAddKernelNode")
        if before:
            src = (ctypes.c_void_p * len(before))(*([new.value] * len(before)))
            dst_arr = (ctypes.c_void_p * len(before))(*before)
            rc = self.fn["cuGraphAddDependencies_v2"](ctypes.c_void_p(graph), src, dst_arr, None,
                                                      ctypes.c_size_t(len(before)))
            if rc != 0:
                self.fn["cuGraphDestroyNode"](new)
                self.check(rc, "cuGraphAddDependencies")
        return new.value or 0

    def roots(self, graph: int) -> list[int]:
        f = self.fn["cuGraphGetRootNodes"]
        n = ctypes.c_size_t(0)
        self.check(f(ctypes.c_void_p(graph), None, ctypes.byref(n)), "cuGraphGetRootNodes")
        arr = (ctypes.c_void_p * max(n.value, 1))()
        self.check(f(ctypes.c_void_p(graph), arr, ctypes.byref(n)), "cuGraphGetRootNodes")
        return [a or 0 for a in arr[: n.value]]

    def sinks(self, graph: int) -> list[int]:
        return [n for n in self.nodes(graph) if not self._edges("cuGraphNodeGetDependentNodes_v2", n)]


_lock = threading.Lock()
_driver: Optional[_Driver] = None
_driver_error: Optional[str] = None
_loaded = False


def _get() -> Optional[_Driver]:
    global _driver, _driver_error, _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            try:
                _driver = _Driver()
            except (OSError, AttributeError, RuntimeError) as exc:
                _driver_error = str(exc)
        return _driver


def unavailable() -> Optional[str]:
    """Why memsets cannot be rewritten on this machine, or None where they can."""
    return None if _get() is not None else _driver_error


@dataclass
class RewriteResult:
    replaced: int = 0
    kept: int = 0  # memsets no fill kernel covers (2-D, unaligned 2-byte)


def rewrite_memsets(graph: int, sm_count: int) -> RewriteResult:
    """Replace the memset nodes of the (not yet instantiated) graph ``graph`` (a ``CUgraph`` handle, e.g.
    ``torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph()``) by fill kernels. Each replacement leaves a
    valid graph, so an error midway (raised) leaves the memsets not yet reached in place."""
    drv = _get()
    if drv is None:
        raise RuntimeError(f"memset rewrite unavailable: {_driver_error}")
    res = RewriteResult()
    for node in drv.nodes(graph):
        if drv.node_type(node) != _MEMSET:
            continue
        if drv.replace_memset(graph, node, sm_count):
            res.replaced += 1
        else:
            res.kept += 1
    return res


class GraphIO:
    """Copy kernel nodes at the edges of a graph, whose far addresses are set before each launch.

    ``inputs``: ``(buffer address, bytes)`` of each input buffer the graph reads. One node, before every root node of
    the graph, copies into each of them from the address given by :meth:`bind` (the batch where it landed).
    ``outputs``: ``(buffer address, bytes)`` of each output the graph writes. One node, after every sink node, copies
    each of them to the address given by :meth:`bind` (fresh memory of this step). A node copies up to
    ``_COPY_SEGMENTS`` buffers; more take a node per that many. A replay then needs no copy launch of its own before
    or after the graph: on an H200 each such launch costs the device 2.5-3.5 µs between two replays
    (``benchmarks/step_boundary.py``) and the host one torch operation.

    The graph must not be instantiated yet; call :meth:`instantiated` with its executable graph after, and
    :meth:`bind` before every launch (until bound, each node copies its buffers onto themselves). A launch that is
    already queued keeps the addresses it was launched with (``cuGraphExecKernelNodeSetParams``).
    """

    def __init__(self, graph: int, inputs: list[tuple[int, int]], outputs: list[tuple[int, int]], sm_count: int) -> None:
        drv = _get()
        if drv is None:
            raise RuntimeError(f"graph I/O nodes unavailable: {_driver_error}")
        self._drv = drv
        roots, sinks = drv.roots(graph), drv.sinks(graph)
        k = _COPY_SEGMENTS
        self._in = [self._node(graph, inputs[i:i + k], sm_count, [], roots, far_is_src=True)
                    for i in range(0, len(inputs), k)]
        self._out = [self._node(graph, outputs[i:i + k], sm_count, sinks, [], far_is_src=False)
                     for i in range(0, len(outputs), k)]
        self._exec: Optional[ctypes.c_void_p] = None
        self._set = drv.fn["cuGraphExecKernelNodeSetParams_v2"]

    def _node(self, graph: int, spans: list[tuple[int, int]], sm_count: int, deps: list[int], before: list[int],
              far_is_src: bool) -> tuple:
        args: list[ctypes.c_uint64] = []
        far = []  # the argument bind() sets, per span
        for addr, nbytes in spans + [(0, 0)] * (_COPY_SEGMENTS - len(spans)):  # unused spans copy 0 bytes
            dst, src = ctypes.c_uint64(addr), ctypes.c_uint64(addr)
            args += (dst, src, ctypes.c_uint64(nbytes))
            far.append(src if far_is_src else dst)
        grid = max(1, min(-(-max(n for _, n in spans) // (16 * _THREADS)), 4 * sm_count))
        kp = self._drv.kernel_params("ncg_copy", tuple(args), grid)
        node = self._drv.add_kernel(graph, kp, deps, before)
        # (the arguments bind() sets, the node, the params passed by reference): built once, used per launch
        return (far[: len(spans)], ctypes.c_void_p(node), ctypes.byref(kp), kp)

    def instantiated(self, graph_exec: int) -> None:
        """The executable graph made from this graph (its nodes are updated there)."""
        self._exec = ctypes.c_void_p(graph_exec)

    def bind(self, srcs: list[Any], dsts: list[Any]) -> None:
        """The next launch copies the batch in from the tensors ``srcs`` (one per input, laid out as its buffer)
        and the outputs out into the tensors ``dsts`` (one per output). A driver call per node; no device work, no
        sync. The tensors must stay allocated until that launch has run (stream order on the launch's stream)."""
        set_params, ex = self._set, self._exec
        for nodes, tensors in ((self._in, iter(srcs)), (self._out, iter(dsts))):
            for far, node, ref, _ in nodes:
                for arg, t in zip(far, tensors):  # far first: zip stops there without taking the next node's tensor
                    arg.value = t.data_ptr()
                rc = set_params(ex, node, ref)
                if rc:
                    self._drv.check(rc, "cuGraphExecKernelNodeSetParams")


def node_types(graph: int) -> dict[str, int]:
    """Node count by kind ("kernel", "memset", "other") of a graph: for tests and evidence."""
    drv = _get()
    if drv is None:
        raise RuntimeError(f"graph inspection unavailable: {_driver_error}")
    out = {"kernel": 0, "memset": 0, "other": 0}
    for node in drv.nodes(graph):
        t = drv.node_type(node)
        out["kernel" if t == _KERNEL else "memset" if t == _MEMSET else "other"] += 1
    return out
