"""Two rewrites of a captured, not yet instantiated graph, through NVIDIA's typed driver bindings (``cuda-bindings``).

* **Memsets as fill kernels** (:func:`rewrite_memsets`). In a replayed graph a memset node is followed by an idle gap
  of 3-4.5 µs before the next kernel starts, against ~0.5 µs between two kernels (H200, CUDA 13). torch's split
  reductions zero their semaphores with ``cudaMemsetAsync`` and cuDNN's attention zeroes its accumulators the same
  way: 72 memsets per step of a 12-layer GPT. A kernel node that writes the same bytes, with the same dependencies,
  takes each one's place: 129-142 µs less per step there (``benchmarks/graph_memsets.py``). Rewritten: 1-D memset
  nodes (``height == 1``) of 1-, 2- or 4-byte elements; the fill kernel stores 16, 4 or 1 byte(s) per thread,
  whichever the address and size allow (a 2- or 4-byte memset whose address or size is not 4-byte aligned stays a
  memset).
* **Batch and output copy nodes** (:class:`GraphIO`): a copy kernel node before every root node copies the batch into
  the graph's input buffers, one after every sink node copies the outputs into this step's fresh memory; their far
  addresses are set on the executable graph before each replay.

Failure: each rewrite reads everything it needs (nodes, parameters, edges, the kernels' module) before its first
change to the graph, and records every change; an error at any point undoes what was done (added nodes destroyed,
removed memset nodes added back with their parameters and edges) and is raised as :class:`RewriteError`, with the
graph as captured. Only when that undo itself fails is :class:`GraphDamaged` raised instead (the graph must not be
used). Everything else in the graph is left alone; the graph must not be instantiated yet
(``torch.cuda.CUDAGraph(keep_graph=True)``).

This is the only module that calls the driver, through ``cuda.bindings.driver`` (its structs and signatures are
NVIDIA's, generated from the driver's headers). Where the bindings are not importable, the driver is older than
12.3 or lacks an entry point, :func:`unavailable` says why and graphs stay as captured.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["FillPlan", "GraphDamaged", "GraphIO", "RewriteError", "RewriteResult", "ScalarArgs", "fill_plan",
           "graph_shape", "node_types", "rewrite_memsets", "scalar_args_unavailable", "unavailable"]

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


_MIN_DRIVER = 12030
# The driver entry points used here. Those of edges carry edge data: CUDA 12.x's bindings name them ``..._v2``,
# CUDA 13's bindings give the plain name that signature (:func:`_edge_variant`).
_ENTRY_POINTS = ("cuDriverGetVersion", "cuGetErrorString", "cuCtxGetCurrent", "cuModuleLoadData", "cuModuleGetFunction",
                 "cuGraphGetNodes", "cuGraphGetRootNodes", "cuGraphNodeGetType", "cuGraphMemsetNodeGetParams",
                 "cuGraphAddKernelNode", "cuGraphAddMemsetNode", "cuGraphDestroyNode", "cuGraphExecKernelNodeSetParams",
                 "cuGraphKernelNodeGetParams")
_EDGE_ENTRY_POINTS = ("cuGraphNodeGetDependencies", "cuGraphNodeGetDependentNodes", "cuGraphAddDependencies")


class RewriteError(RuntimeError):
    """A graph rewrite failed; the graph is exactly as it was before the rewrite."""


class GraphDamaged(RuntimeError):
    """A graph rewrite failed and undoing it failed too: the graph must not be instantiated."""


def _edge_variant(cu: Any, name: str) -> Any:
    return getattr(cu, name + "_v2", None) or getattr(cu, name)


@dataclass
class _Launch:
    """A kernel node's parameters (a ``CUDA_KERNEL_NODE_PARAMS``) and the ctypes argument values it points at, which
    must outlive every use of the parameters (the driver copies them when a node is added or updated)."""

    params: Any
    keep: tuple


class _Driver:
    """The driver calls of the rewrites, one method each (``cuda.bindings.driver``). Node handles are the bindings'
    ``CUgraphNode`` objects; ``key(node)`` is the handle's address, for sets and maps. Every method raises
    ``RuntimeError`` naming the call on a driver error."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver as cu
        except ImportError as exc:
            raise OSError(f"cuda-bindings is not importable ({exc}); it comes with torch's CUDA wheels (or "
                          "pip install 'nemo_cudagraph_plugin[cuda]')") from exc
        missing = [n for n in _ENTRY_POINTS if not hasattr(cu, n)]
        missing += [n for n in _EDGE_ENTRY_POINTS if not (hasattr(cu, n + "_v2") or hasattr(cu, n))]
        if missing:
            import cuda.bindings

            raise OSError(f"cuda-bindings {getattr(cuda.bindings, '__version__', '?')} lacks {', '.join(missing)}")
        self.cu = cu
        try:
            err, version = cu.cuDriverGetVersion()
        except Exception as exc:  # noqa: BLE001 - cuda-bindings raises its own error when libcuda cannot be loaded
            raise OSError(f"no CUDA driver (libcuda.so.1 could not be loaded: {exc})") from exc
        self.check(err, "cuDriverGetVersion")
        if version < _MIN_DRIVER:
            raise OSError(f"CUDA driver {version} is older than 12.3")
        self.version = int(version)
        self._deps = _edge_variant(cu, "cuGraphNodeGetDependencies")
        self._dependents = _edge_variant(cu, "cuGraphNodeGetDependentNodes")
        self._add_edges = _edge_variant(cu, "cuGraphAddDependencies")
        #: ``(exec, node, params) -> (CUresult,)``: the per-replay call of :meth:`GraphIO.bind`
        self.exec_kernel_set: Callable[..., tuple] = cu.cuGraphExecKernelNodeSetParams
        #: the size of each argument of a captured kernel (CUDA 12.4+): :class:`ScalarArgs` reads node arguments
        self.param_info: Optional[Callable[..., tuple]] = getattr(cu, "cuFuncGetParamInfo", None)
        self.kernel_param_info: Optional[Callable[..., tuple]] = getattr(cu, "cuKernelGetParamInfo", None)
        self.functions: dict[tuple[int, str], Any] = {}  # (context, kernel) -> CUfunction
        self.modules: list[Any] = []  # loaded once per context, never unloaded

    def check(self, err: Any, what: str) -> None:
        if err:
            _, msg = self.cu.cuGetErrorString(err)
            text = msg.decode() if isinstance(msg, bytes) else str(msg)
            raise RuntimeError(f"{what} failed: CUDA error {int(err)} ({text})")

    @staticmethod
    def key(node: Any) -> int:
        return int(node)

    def graph(self, raw: int) -> Any:
        return self.cu.CUgraph(raw)

    def graph_exec(self, raw: int) -> Any:
        return self.cu.CUgraphExec(raw)

    def function(self, name: str) -> Any:
        err, ctx = self.cu.cuCtxGetCurrent()
        self.check(err, "cuCtxGetCurrent")
        key = (int(ctx), name)
        if key not in self.functions:
            image = ctypes.create_string_buffer(_PTX.encode())  # NUL-terminated, alive during the call
            err, mod = self.cu.cuModuleLoadData(ctypes.addressof(image))
            self.check(err, "cuModuleLoadData")
            self.modules.append(mod)
            for k in _KERNELS:
                err, f = self.cu.cuModuleGetFunction(mod, k.encode())
                self.check(err, "cuModuleGetFunction")
                self.functions[(key[0], k)] = f
        return self.functions[key]

    def _list(self, fn: Any, what: str, handle: Any) -> list:
        err, _, n = fn(handle, 0)
        self.check(err, what)
        if not n:
            return []
        err, out, n = fn(handle, n)
        self.check(err, what)
        return list(out[:n])

    def nodes(self, graph: Any) -> list:
        return self._list(self.cu.cuGraphGetNodes, "cuGraphGetNodes", graph)

    def roots(self, graph: Any) -> list:
        return self._list(self.cu.cuGraphGetRootNodes, "cuGraphGetRootNodes", graph)

    def node_type(self, node: Any) -> int:
        err, t = self.cu.cuGraphNodeGetType(node)
        self.check(err, "cuGraphNodeGetType")
        return int(t)

    def memset(self, node: Any) -> tuple[Any, tuple[int, int, int, int, int]]:
        """The memset node's parameters: the driver's struct and ``(dst, value, elementSize, width, height)``."""
        err, p = self.cu.cuGraphMemsetNodeGetParams(node)
        self.check(err, "cuGraphMemsetNodeGetParams")
        return p, (int(p.dst), int(p.value), int(p.elementSize), int(p.width), int(p.height))

    def _edges(self, fn: Any, what: str, node: Any) -> list:
        err, _, _, n = fn(node, 0)
        self.check(err, what)
        if not n:
            return []
        err, nodes, data, n = fn(node, n)
        self.check(err, what)
        for e in list(data or [])[:n]:
            # An edge with data (a programmatic dependency, a port) would be added back as a plain one: refuse.
            if int(e.type) or int(e.from_port) or int(e.to_port):
                raise RuntimeError(f"{what}: an edge carries data (type {int(e.type)}), which these rewrites do not "
                                   "keep")
        return list(nodes[:n])

    def dependencies(self, node: Any) -> list:
        return self._edges(self._deps, "cuGraphNodeGetDependencies", node)

    def dependents(self, node: Any) -> list:
        return self._edges(self._dependents, "cuGraphNodeGetDependentNodes", node)

    def launch(self, kernel: str, args: tuple, grid: int) -> _Launch:
        """Launch parameters of one of the module's kernels; ``args`` (ctypes values) are read when a node is added
        or updated with them."""
        arr = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        kp = self.cu.CUDA_KERNEL_NODE_PARAMS()
        kp.func = self.function(kernel)
        kp.gridDimX, kp.gridDimY, kp.gridDimZ = grid, 1, 1
        kp.blockDimX, kp.blockDimY, kp.blockDimZ = _THREADS, 1, 1
        kp.sharedMemBytes = 0
        kp.kernelParams = ctypes.addressof(arr)  # void**: the driver reads each argument through it
        kp.extra = 0
        return _Launch(kp, (arr, args))

    def kernel_args(self, node: Any) -> tuple[Any, list[bytes]]:
        """A kernel node's parameters (the driver's struct) and a copy of each of its arguments' bytes."""
        err, p = self.cu.cuGraphKernelNodeGetParams(node)
        self.check(err, "cuGraphKernelNodeGetParams")
        if int(getattr(p, "extra", 0) or 0):  # one argument buffer (a library's launch): not torch's, not read
            return p, []
        func, kern = p.func, getattr(p, "kern", None)
        info, handle = (self.param_info, func) if int(func or 0) else (self.kernel_param_info, kern)
        if info is None or handle is None or not int(handle):
            raise RuntimeError("the driver cannot size a captured kernel's arguments (cuFuncGetParamInfo: CUDA 12.4+)")
        sizes: list[int] = []
        while True:
            err, _, size = info(handle, len(sizes))
            if err:  # past the last argument: CUDA_ERROR_INVALID_VALUE
                break
            sizes.append(int(size))
        addr = int(p.kernelParams or 0)
        if sizes and not addr:
            raise RuntimeError("a captured kernel node has no argument array")
        ptrs = (ctypes.c_void_p * len(sizes)).from_address(addr) if sizes else []
        return p, [ctypes.string_at(ptrs[k], n) for k, n in enumerate(sizes)]

    def add_kernel(self, graph: Any, launch: _Launch) -> Any:
        err, node = self.cu.cuGraphAddKernelNode(graph, None, 0, launch.params)
        self.check(err, "cuGraphAddKernelNode")
        return node

    def add_memset(self, graph: Any, params: Any) -> Any:
        err, ctx = self.cu.cuCtxGetCurrent()
        self.check(err, "cuCtxGetCurrent")
        err, node = self.cu.cuGraphAddMemsetNode(graph, None, 0, params, ctx)
        self.check(err, "cuGraphAddMemsetNode")
        return node

    def add_edges(self, graph: Any, src: list, dst: list) -> None:
        (err,) = self._add_edges(graph, src, dst, None, len(src))
        self.check(err, "cuGraphAddDependencies")

    def destroy(self, node: Any) -> None:
        (err,) = self.cu.cuGraphDestroyNode(node)
        self.check(err, "cuGraphDestroyNode")


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


def _need(what: str) -> _Driver:
    drv = _get()
    if drv is None:
        raise RewriteError(f"{what} unavailable: {_driver_error}")
    return drv


def unavailable() -> Optional[str]:
    """Why graphs cannot be rewritten on this machine, or None where they can."""
    return None if _get() is not None else _driver_error


class _Changes:
    """The changes one rewrite made to a graph, in order, and how to undo them all (:meth:`undo`)."""

    def __init__(self, drv: Any, graph: Any) -> None:
        self.drv, self.graph = drv, graph
        self.added: list[Any] = []  # nodes added (their edges go with them when destroyed)
        self.removed: list[tuple[Any, int, list, list]] = []  # (params, key, dependencies, dependents) of memsets

    def add_kernel(self, launch: _Launch) -> Any:
        node = self.drv.add_kernel(self.graph, launch)
        self.added.append(node)
        return node

    def add_edges(self, src: list, dst: list) -> None:
        if src:  # every edge added here touches an added node: undone with it
            self.drv.add_edges(self.graph, src, dst)

    def remove_memset(self, node: Any, params: Any, deps: list, after: list) -> None:
        self.drv.destroy(node)
        self.removed.append((params, self.drv.key(node), deps, after))

    def undo(self, exc: BaseException) -> RewriteError:
        """Put the graph back as it was; the error to raise (:class:`GraphDamaged` where that failed too)."""
        drv = self.drv
        try:
            # Memsets first, then their edges: an edge may join two of them. Their neighbours are nodes of the
            # graph as captured (read before any change), or other removed memsets (mapped to their new node).
            back = {k: drv.add_memset(self.graph, params) for params, k, _, _ in self.removed}
            edges: dict[tuple[int, int], tuple[Any, Any]] = {}
            for _, k, deps, after in self.removed:
                for d in deps:
                    edges[(drv.key(d), k)] = (back.get(drv.key(d), d), back[k])
                for a in after:
                    edges[(k, drv.key(a))] = (back[k], back.get(drv.key(a), a))
            if edges:
                src, dst = zip(*edges.values())
                drv.add_edges(self.graph, list(src), list(dst))
            for node in reversed(self.added):
                drv.destroy(node)
        except Exception as undo_exc:  # noqa: BLE001 - reported with the original error
            return GraphDamaged(f"{exc}; undoing the rewrite failed too ({undo_exc}): the graph must not be used")
        self.removed, self.added = [], []
        return RewriteError(str(exc))


@dataclass
class RewriteResult:
    replaced: int = 0
    kept: int = 0  # memsets no fill kernel covers (2-D, unaligned 2-byte)


@dataclass
class _Memset:
    node: Any
    params: Any
    dst: int
    plan: FillPlan
    deps: list = field(default_factory=list)
    after: list = field(default_factory=list)


def rewrite_memsets(graph: int, sm_count: int, driver: Any = None) -> RewriteResult:
    """Replace the memset nodes of the (not yet instantiated) graph ``graph`` (a ``CUgraph`` handle, e.g.
    ``torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph()``) by fill kernels.

    All or nothing: every node, memset, edge and kernel is read first; then the fill kernels are added with the
    memsets' edges, and only then the memsets removed. An error at any point undoes every change (raised as
    :class:`RewriteError`, the graph as captured). ``driver``: a stand-in of the driver layer, for tests."""
    drv = driver if driver is not None else _need("memset rewrite")
    g = drv.graph(graph)
    res = RewriteResult()
    todo: list[_Memset] = []
    try:
        for node in drv.nodes(g):
            if drv.node_type(node) != _MEMSET:
                continue
            params, (dst, value, esize, width, height) = drv.memset(node)
            plan = fill_plan(dst, value, esize, width, height)
            if plan is None:
                res.kept += 1
                continue
            todo.append(_Memset(node, params, dst, plan, drv.dependencies(node), drv.dependents(node)))
        launches = [drv.launch(m.plan.kernel, (ctypes.c_uint64(m.dst), ctypes.c_uint32(m.plan.pattern),
                                                ctypes.c_uint64(m.plan.units)),
                               max(1, min(-(-m.plan.units // _THREADS), 4 * sm_count))) for m in todo]
    except RuntimeError as exc:  # nothing changed yet
        raise RewriteError(str(exc)) from exc
    changes = _Changes(drv, g)
    try:
        kernels = {drv.key(m.node): changes.add_kernel(launch) for m, launch in zip(todo, launches)}
        for m in todo:
            k = kernels[drv.key(m.node)]
            # What the memset waited for (a replaced memset: its kernel), and what waited for it (a replaced
            # memset gets that edge as its own dependency above).
            deps = [kernels.get(drv.key(d), d) for d in m.deps]
            changes.add_edges(deps, [k] * len(deps))
            after = [a for a in m.after if drv.key(a) not in kernels]
            changes.add_edges([k] * len(after), after)
        for m in todo:  # the memset's own edges go with it
            changes.remove_memset(m.node, m.params, m.deps, m.after)
    except Exception as exc:
        raise changes.undo(exc) from exc
    res.replaced = len(todo)
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

    All or nothing: the roots, sinks and kernel are read first; an error while adding the nodes destroys those added
    (raised as :class:`RewriteError`, the graph as captured). The graph must not be instantiated yet; call
    :meth:`instantiated` with its executable graph after, and :meth:`bind` before every launch (until bound, each
    node copies its buffers onto themselves). A launch that is already queued keeps the addresses it was launched
    with (``cuGraphExecKernelNodeSetParams``). ``driver``: a stand-in of the driver layer, for tests.
    """

    def __init__(self, graph: int, inputs: list[tuple[int, int]], outputs: list[tuple[int, int]], sm_count: int,
                 driver: Any = None) -> None:
        drv = driver if driver is not None else _need("graph I/O nodes")
        self._drv = drv
        g = drv.graph(graph)
        k = _COPY_SEGMENTS
        try:
            roots = drv.roots(g)
            sinks = [n for n in drv.nodes(g) if not drv.dependents(n)]
            ins = [self._launch(inputs[i:i + k], sm_count, far_is_src=True) for i in range(0, len(inputs), k)]
            outs = [self._launch(outputs[i:i + k], sm_count, far_is_src=False) for i in range(0, len(outputs), k)]
        except RuntimeError as exc:  # nothing changed yet
            raise RewriteError(str(exc)) from exc
        changes = _Changes(drv, g)
        try:
            self._in = [self._add(changes, launch, far, [], roots) for far, launch in ins]
            self._out = [self._add(changes, launch, far, sinks, []) for far, launch in outs]
        except Exception as exc:
            raise changes.undo(exc) from exc
        self._exec: Any = None
        self._set = drv.exec_kernel_set

    def _launch(self, spans: list[tuple[int, int]], sm_count: int, far_is_src: bool) -> tuple[list, _Launch]:
        args: list[ctypes.c_uint64] = []
        far = []  # the argument bind() sets, per span
        for addr, nbytes in spans + [(0, 0)] * (_COPY_SEGMENTS - len(spans)):  # unused spans copy 0 bytes
            dst, src = ctypes.c_uint64(addr), ctypes.c_uint64(addr)
            args += (dst, src, ctypes.c_uint64(nbytes))
            far.append(src if far_is_src else dst)
        grid = max(1, min(-(-max(n for _, n in spans) // (16 * _THREADS)), 4 * sm_count))
        return far[: len(spans)], self._drv.launch("ncg_copy", tuple(args), grid)

    @staticmethod
    def _add(changes: _Changes, launch: _Launch, far: list, deps: list, before: list) -> tuple:
        node = changes.add_kernel(launch)
        changes.add_edges(deps, [node] * len(deps))
        changes.add_edges([node] * len(before), before)
        # (the arguments bind() sets, the node, the params the driver reads them through, what keeps them alive)
        return (far, node, launch.params, launch)

    def instantiated(self, graph_exec: int) -> None:
        """The executable graph made from this graph (its nodes are updated there)."""
        self._exec = self._drv.graph_exec(graph_exec)

    def bind(self, srcs: list[Any], dsts: list[Any]) -> None:
        """The next launch copies the batch in from the tensors ``srcs`` (one per input, laid out as its buffer)
        and the outputs out into the tensors ``dsts`` (one per output). A driver call per node; no device work, no
        sync. The tensors must stay allocated until that launch has run (stream order on the launch's stream)."""
        set_params, ex = self._set, self._exec
        for nodes, tensors in ((self._in, iter(srcs)), (self._out, iter(dsts))):
            for far, node, ref, _ in nodes:
                for arg, t in zip(far, tensors):  # far first: zip stops there without taking the next node's tensor
                    arg.value = t.data_ptr()
                (rc,) = set_params(ex, node, ref)
                if rc:
                    self._drv.check(rc, "cuGraphExecKernelNodeSetParams")


class ScalarArgs:
    """The kernel nodes of a captured graph that received a sentinel float64 argument (:mod:`.kernel_args`), set to the
    host's current values before each launch after one changed.

    ``sentinels``: a sentinel's bits -> ``(HostScalars, slot)``. Each node's arguments are read (sized by
    ``cuFuncGetParamInfo``) and copied into memory owned here; an 8-byte argument with a sentinel's bits is the slot's.
    Every sentinel must be found, else :class:`RewriteError` (the graph holds sentinels: it must not be launched).
    The graph itself is not changed; call :meth:`instantiated` with its executable graph, then :meth:`bind` before
    every launch (a driver call per node when a value changed, none otherwise; a launch already queued keeps its
    arguments). ``driver``: a stand-in of the driver layer, for tests.
    """

    def __init__(self, graph: int, sentinels: dict[int, tuple[Any, int]], driver: Any = None) -> None:
        drv = driver if driver is not None else _need("kernel arguments set before each replay")
        self._drv = drv
        nodes: list[tuple[Any, Any, list[tuple[Any, Any, int]], tuple]] = []
        found: set[int] = set()
        try:
            for node in drv.nodes(drv.graph(graph)):
                if drv.node_type(node) != _KERNEL:
                    continue
                params, args = drv.kernel_args(node)
                hits = [(k, b) for k, a in enumerate(args) if len(a) == 8 and (b := int.from_bytes(a, "little")) in sentinels]
                if not hits:
                    continue
                bufs = [ctypes.create_string_buffer(a, len(a)) for a in args]
                arr = (ctypes.c_void_p * len(bufs))(*(ctypes.addressof(b) for b in bufs))
                params.kernelParams = ctypes.addressof(arr)
                slots = [(ctypes.c_double.from_buffer(bufs[k]), *sentinels[b]) for k, b in hits]
                found.update(b for _, b in hits)
                nodes.append((node, params, slots, (bufs, arr)))
        except RuntimeError as exc:
            raise RewriteError(str(exc)) from exc
        if len(found) != len(sentinels):
            raise RewriteError(f"{len(sentinels) - len(found)} of {len(sentinels)} host scalar(s) passed to kernels "
                               "in the capture were found in no kernel node's arguments")
        self._nodes = nodes
        self._owners = list({id(o): o for o, _ in sentinels.values()}.values())
        self._bound: Any = None
        self._exec: Any = None
        self._set = drv.exec_kernel_set

    @property
    def nodes(self) -> int:
        """Kernel nodes whose arguments are set before launches."""
        return len(self._nodes)

    def instantiated(self, graph_exec: int) -> None:
        """The executable graph made from this graph (its nodes are set there)."""
        self._exec = self._drv.graph_exec(graph_exec)
        self._bound = None

    def bind(self) -> None:
        """Before a launch: the nodes get the current values where one changed since the last bind (hot path)."""
        owners = self._owners
        version = owners[0].version if len(owners) == 1 else tuple(o.version for o in owners)
        if version == self._bound:
            return
        set_params, ex = self._set, self._exec
        for node, params, slots, _ in self._nodes:
            for arg, owner, slot in slots:
                arg.value = owner.values[slot]
            (rc,) = set_params(ex, node, params)
            if rc:
                self._drv.check(rc, "cuGraphExecKernelNodeSetParams")
        self._bound = version


def scalar_args_unavailable() -> Optional[str]:
    """Why captured kernels' float arguments cannot be set before replays here (``None``: they can)."""
    drv = _get()
    if drv is None:
        return _driver_error
    if drv.param_info is None and drv.kernel_param_info is None:
        return "the CUDA bindings lack cuFuncGetParamInfo (CUDA 12.4+)"
    if drv.version < 12040:
        return f"CUDA driver {drv.version} is older than 12.4 (cuFuncGetParamInfo)"
    return None


def node_types(graph: int, driver: Any = None) -> dict[str, int]:
    """Node count by kind ("kernel", "memset", "other") of a graph: for tests and evidence."""
    drv = driver if driver is not None else _need("graph inspection")
    out = {"kernel": 0, "memset": 0, "other": 0}
    for node in drv.nodes(drv.graph(graph)):
        t = drv.node_type(node)
        out["kernel" if t == _KERNEL else "memset" if t == _MEMSET else "other"] += 1
    return out


def graph_shape(graph: int, driver: Any = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A graph's nodes and edges, comparable across a rewrite that was undone: a memset node is named by its
    parameters (an undo adds it back as a new node), any other node by its handle. For tests."""
    drv = driver if driver is not None else _need("graph inspection")
    g = drv.graph(graph)
    names = {}
    for node in drv.nodes(g):
        names[drv.key(node)] = ("memset", drv.memset(node)[1]) if drv.node_type(node) == _MEMSET else drv.key(node)
    edges = [(names[drv.key(n)], names[drv.key(a)]) for n in drv.nodes(g) for a in drv.dependents(n)]
    return tuple(sorted(map(repr, names.values()))), tuple(sorted(map(repr, edges)))
