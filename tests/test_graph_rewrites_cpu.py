"""The graph rewrites of ``core/_cuda_nodes.py`` (memsets as fill kernels, batch/output copy nodes) are all or
nothing: run on a stand-in of the driver layer that fails at any chosen call, the graph after a failed rewrite is the
graph as captured. (The kernels themselves, and the real driver, are tested on a GPU: tests/gpu/test_graph_nodes_gpu.py.)"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch

from nemo_cudagraph_plugin.core import _cuda_nodes as cn
from nemo_cudagraph_plugin.core import backend as backend_mod
from nemo_cudagraph_plugin.core import warn as warn_mod

KERNEL, MEMSET, OTHER = cn._KERNEL, cn._MEMSET, 9
MUTATIONS = ("add_kernel", "add_memset", "add_edges", "destroy")


class Injected(RuntimeError):
    pass


class FakeDriver:
    """The methods of ``_cuda_nodes._Driver`` over a graph in Python: nodes are ints, memsets carry their
    ``(dst, value, elementSize, width, height)``. ``fail_at``: the call (counted over ``fail_on``) that raises."""

    def __init__(self, fail_at: int | None = None, fail_on: tuple[str, ...] = MUTATIONS, sticky: bool = False) -> None:
        self.types: dict[int, int] = {}
        self.payload: dict[int, Any] = {}
        self.edges: set[tuple[int, int]] = set()
        self.ids = itertools.count(1)
        self.fail_at, self.fail_on, self.calls, self.sticky = fail_at, fail_on, 0, sticky
        self.version = 13000
        self.set_calls: list = []

    def _tick(self, what: str) -> None:
        if what in self.fail_on:
            self.calls += 1
            if self.fail_at is not None and (self.calls == self.fail_at or self.sticky and self.calls > self.fail_at):
                raise RuntimeError(f"{what} failed: injected")

    # building the captured graph (not counted)
    def node(self, t: int, payload: Any = None, deps: tuple = ()) -> int:
        n = next(self.ids)
        self.types[n], self.payload[n] = t, payload
        self.edges |= {(d, n) for d in deps}
        return n

    # the driver layer
    @staticmethod
    def key(node: int) -> int:
        return node

    def graph(self, raw: int) -> int:
        return raw

    def graph_exec(self, raw: int) -> int:
        return raw

    def check(self, err: Any, what: str) -> None:
        if err:
            raise RuntimeError(f"{what} failed: {err}")

    def nodes(self, graph: int) -> list[int]:
        self._tick("nodes")
        return sorted(self.types)

    def roots(self, graph: int) -> list[int]:
        self._tick("roots")
        return [n for n in sorted(self.types) if not self.dependencies(n)]

    def node_type(self, node: int) -> int:
        return self.types[node]

    def memset(self, node: int) -> tuple[Any, tuple]:
        self._tick("memset")
        return self.payload[node], self.payload[node]

    def dependencies(self, node: int) -> list[int]:
        self._tick("dependencies")
        return sorted(a for a, b in self.edges if b == node)

    def dependents(self, node: int) -> list[int]:
        self._tick("dependents")
        return sorted(b for a, b in self.edges if a == node)

    def launch(self, kernel: str, args: tuple, grid: int) -> cn._Launch:
        self._tick("launch")
        return cn._Launch((kernel, tuple(a.value for a in args), grid), (args,))

    def add_kernel(self, graph: int, launch: cn._Launch) -> int:
        self._tick("add_kernel")
        return self.node(KERNEL, launch.params)

    def add_memset(self, graph: int, params: Any) -> int:
        self._tick("add_memset")
        return self.node(MEMSET, params)

    def add_edges(self, graph: int, src: list, dst: list) -> None:
        self._tick("add_edges")
        assert len(src) == len(dst) and all(s in self.types and d in self.types for s, d in zip(src, dst))
        self.edges |= set(zip(src, dst))

    def destroy(self, node: int) -> None:
        self._tick("destroy")
        del self.types[node], self.payload[node]
        self.edges = {(a, b) for a, b in self.edges if node not in (a, b)}

    def exec_kernel_set(self, ex: int, node: int, params: Any) -> tuple[int]:
        self.set_calls.append((node, params))
        return (0,)


def captured(drv: FakeDriver) -> dict[str, int]:
    """k1 -> m1 -> m2 -> k2, k1 -> m3 (2-D: stays) -> k2, m4 (root) -> k2, k2 -> other."""
    n = {}
    n["k1"] = drv.node(KERNEL, "k1")
    n["m1"] = drv.node(MEMSET, (4096, 0, 1, 64, 1), (n["k1"],))
    n["m2"] = drv.node(MEMSET, (8192, 0xBEEF, 2, 8, 1), (n["m1"],))
    n["m3"] = drv.node(MEMSET, (1024, 7, 1, 16, 4), (n["k1"],))
    n["m4"] = drv.node(MEMSET, (2048, 1, 4, 3, 1))
    n["k2"] = drv.node(KERNEL, "k2", (n["m2"], n["m3"], n["m4"]))
    n["x"] = drv.node(OTHER, "x", (n["k2"],))
    return n


def mutations_of(run) -> int:
    counter = FakeDriver(fail_at=None)
    captured(counter)
    run(counter)
    return counter.calls


def test_memset_rewrite_replaces_each_memset_by_a_kernel_with_its_edges():
    drv = FakeDriver()
    n = captured(drv)
    res = cn.rewrite_memsets(0, 4, driver=drv)
    assert (res.replaced, res.kept) == (3, 1)
    assert sorted(drv.payload[m] for m in drv.types if drv.types[m] == MEMSET) == [(1024, 7, 1, 16, 4)]
    fill = {drv.payload[k][1][0]: k for k in drv.types if drv.types[k] == KERNEL and isinstance(drv.payload[k], tuple)}
    assert drv.payload[fill[4096]][0] == "ncg_fill_v4" and drv.payload[fill[8192]][0] == "ncg_fill_v4"
    assert drv.payload[fill[2048]][0] == "ncg_fill_u32"
    assert drv.edges == {(n["k1"], fill[4096]), (fill[4096], fill[8192]), (fill[8192], n["k2"]), (n["k1"], n["m3"]),
                         (n["m3"], n["k2"]), (fill[2048], n["k2"]), (n["k2"], n["x"])}


@pytest.mark.parametrize("fail_at", range(1, 1 + mutations_of(lambda d: cn.rewrite_memsets(0, 4, driver=d))))
def test_memset_rewrite_failing_at_any_change_leaves_the_graph_as_captured(fail_at):
    drv = FakeDriver(fail_at=fail_at)
    captured(drv)
    before = cn.graph_shape(0, driver=drv)
    with pytest.raises(cn.RewriteError, match="injected"):
        cn.rewrite_memsets(0, 4, driver=drv)
    assert cn.graph_shape(0, driver=drv) == before


@pytest.mark.parametrize("read", ["nodes", "memset", "dependencies", "dependents", "launch"])
def test_memset_rewrite_failing_while_reading_changes_nothing(read):
    drv = FakeDriver(fail_at=2 if read in ("memset", "dependencies", "dependents") else 1, fail_on=(read,))
    captured(drv)
    edges, types = set(drv.edges), dict(drv.types)
    with pytest.raises(cn.RewriteError, match="injected"):
        cn.rewrite_memsets(0, 4, driver=drv)
    assert drv.edges == edges and drv.types == types


def test_a_failed_undo_says_the_graph_is_damaged():
    drv = FakeDriver(fail_at=5, sticky=True)  # 3 kernels and 1 edge added, then every change fails
    captured(drv)
    with pytest.raises(cn.GraphDamaged, match="must not be used"):
        cn.rewrite_memsets(0, 4, driver=drv)


def _io(drv: FakeDriver, n_in: int = 9, n_out: int = 2) -> cn.GraphIO:
    ins = [(0x1000 * (i + 1), 64 + i) for i in range(n_in)]
    outs = [(0x100000 * (i + 1), 4) for i in range(n_out)]
    return cn.GraphIO(0, ins, outs, 4, driver=drv)


def test_graph_io_adds_copy_nodes_before_the_roots_and_after_the_sinks_and_binds_them():
    drv = FakeDriver()
    n = captured(drv)
    roots, sinks = drv.roots(0), [x for x in drv.nodes(0) if not drv.dependents(x)]
    io = _io(drv)
    copies = [k for k in drv.types if drv.types[k] == KERNEL and isinstance(drv.payload[k], tuple)]
    assert len(copies) == 3  # 9 inputs: two nodes (8 + 1), 2 outputs: one
    ins, out = copies[:2], copies[2]
    assert {(c, r) for c in ins for r in roots} | {(s, out) for s in sinks} <= drv.edges
    assert sinks == [n["x"]] and set(roots) == {n["k1"], n["m4"]}
    io.instantiated(77)
    src = [torch.empty(1) for _ in range(9)]
    dst = [torch.empty(1) for _ in range(2)]
    io.bind(src, dst)
    assert [node for node, _ in drv.set_calls] == copies
    far_in = [a.value for far, *_ in io._in for a in far]
    assert far_in == [t.data_ptr() for t in src]
    assert [a.value for far, *_ in io._out for a in far] == [t.data_ptr() for t in dst]


@pytest.mark.parametrize("fail_at", range(1, 1 + mutations_of(_io)))
def test_graph_io_failing_at_any_change_leaves_the_graph_as_captured(fail_at):
    drv = FakeDriver(fail_at=fail_at)
    captured(drv)
    before = cn.graph_shape(0, driver=drv)
    with pytest.raises(cn.RewriteError, match="injected"):
        _io(drv)
    assert cn.graph_shape(0, driver=drv) == before


def test_the_backend_keeps_the_graph_as_captured_after_a_failed_rewrite_and_fails_the_capture_on_a_damaged_one(
        monkeypatch):
    class Graph:
        instantiated = 0

        def raw_cuda_graph(self) -> int:
            return 0

        def instantiate(self) -> None:
            self.instantiated += 1

    drv = FakeDriver(fail_at=2)
    captured(drv)
    before = cn.graph_shape(0, driver=drv)
    monkeypatch.setattr(cn, "_get", lambda: drv)
    monkeypatch.setattr(backend_mod, "_keep_graph_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"multi_processor_count": 4}))
    monkeypatch.setattr(warn_mod, "_WARNED", set())
    be = backend_mod.CudaBackend()
    assert be.memsets_kept is None and be.io_kept is None
    g = Graph()
    with pytest.warns(UserWarning, match="memset nodes of a captured graph stay memsets: .*injected"):
        assert be.finish(g, None) is None
    assert g.instantiated == 1 and be.memsets_rewritten == 0 and cn.graph_shape(0, driver=drv) == before
    drv.fail_at, drv.calls, drv.sticky = 5, 0, True
    with pytest.raises(cn.GraphDamaged):
        be.finish(Graph(), None)


def test_without_the_driver_bindings_graphs_stay_as_captured_with_one_warning(monkeypatch):
    why = "cuda-bindings is not importable (No module named 'cuda')"
    monkeypatch.setattr(cn, "unavailable", lambda: why)
    monkeypatch.setattr(backend_mod, "_keep_graph_supported", lambda: True)
    monkeypatch.setattr(warn_mod, "_WARNED", set())
    with pytest.warns(UserWarning, match="captured graphs stay as captured .*cuda-bindings is not importable"):
        be = backend_mod.CudaBackend()
    assert be.memsets_kept == why and be.io_kept == why
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend_mod.CudaBackend()  # once
        backend_mod.CudaBackend(memsets_as_kernels=False, io_in_graph=False)
