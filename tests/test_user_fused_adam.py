"""The user's own fused Adam/AdamW (``fused=True``) captured with its float learning rate set before each replay
(``core/user_fused_adam.py``, ``core/kernel_args.py``), on CPU.

torch's fused kernel takes ``lr`` as a float64 kernel argument. A graph captures a sentinel there, and the kernel
nodes that received it get the host's current value before each replay after it changed. On the tape
(``tests/_tape.py``) the recorded op's float argument plays the kernel node's; torch's CPU fused kernel does the math,
so a graphed fit must give the user's eager fit bit for bit. The CUDA node scan is the GPU tier's part
(``tests/gpu/test_user_optimizer_gpu.py``); here it runs against a stand-in of the driver layer.
"""

from __future__ import annotations

import ctypes
import math

import lightning.pytorch as pl
import pytest
import torch
from _tape import TapeBackend
from test_user_adam import LR, _fit, _same
from torch import nn

from nemo_cudagraph_plugin.core import _cuda_nodes, kernel_args
from nemo_cudagraph_plugin.core.kernel_args import HostScalars, capture_scope
from nemo_cudagraph_plugin.core.optim import OptimizerPrep
from nemo_cudagraph_plugin.core.user_fused_adam import UserMathFusedAdam


# ----------------------------------------------------------------------------------------------------------
# host scalars
# ----------------------------------------------------------------------------------------------------------
def test_sentinels_are_distinct_nans_and_only_a_capture_sees_them():
    a, b = HostScalars([1e-3, 2e-3]), HostScalars([1e-3])
    bits = {kernel_args.float_bits(x) for x in a.sentinels + b.sentinels}
    assert len(bits) == 3 and all(math.isnan(x) for x in a.sentinels + b.sentinels)
    assert a.argument(0) == 1e-3  # no capture open: the value
    with capture_scope() as used:
        assert kernel_args.float_bits(a.argument(1)) == kernel_args.float_bits(a.sentinels[1])
        assert kernel_args.live_slot(a.sentinels[1]) == (a, 1)
        assert kernel_args.live_slot(b.sentinels[0]) is None  # not passed in this capture
        assert kernel_args.live_slot(float("nan")) is None and kernel_args.live_slot(1e-3) is None
    assert list(used.values()) == [(a, 1)]
    assert a.argument(1) == 2e-3


def test_a_changed_value_counts_as_a_change_and_the_same_value_does_not():
    s = HostScalars([1e-3])
    s.set(0, 1e-3)
    assert s.version == 0
    s.set(0, 1e-3 * 0.5)
    s.set(0, 5e-4)
    assert s.version == 1 and s.values == [5e-4]
    s.set(0, 0.0)
    s.set(0, -0.0)  # equal as floats, another argument for the kernel
    assert s.version == 3


# ----------------------------------------------------------------------------------------------------------
# the update, against torch's own fused step
# ----------------------------------------------------------------------------------------------------------
def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


@pytest.mark.parametrize("cls,amsgrad,maximize,wd", [(torch.optim.AdamW, False, False, 0.1),
                                                     (torch.optim.Adam, True, True, 0.01),
                                                     (torch.optim.AdamW, True, False, 0.0)])
def test_a_tape_graph_of_the_fused_update_replays_the_users_step_with_each_new_lr(cls, amsgrad, maximize, wd):
    a, b = _model(), _model()
    kw = dict(lr=LR, betas=(0.9, 0.95), weight_decay=wd, amsgrad=amsgrad, maximize=maximize, fused=True)
    ref, opt = cls(a.parameters(), **kw), cls(b.parameters(), **kw)
    user = UserMathFusedAdam(opt, torch.device("cpu"))
    user.install()
    x = torch.randn(8, 16)
    be, graph = TapeBackend(), None
    for i in range(12):
        for m, o in ((a, ref), (b, opt)):
            o.zero_grad(set_to_none=False)
            m(x * (1 + i % 3)).square().mean().backward()
            for g in o.param_groups:
                g["lr"] = LR * 0.9 ** i  # a schedule assigning floats
        ref.step()
        user.sync()
        if i < 2:
            opt.step()  # eager warm-up: the float itself
        elif graph is None:
            graph = be.new_graph()
            with be.capture(graph, be.pool(), None):
                opt.step()
            be.finish(graph, None)
            graph.replay()  # the capture ran the step (with the value, not the sentinel)
        else:
            graph.replay()
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q), f"step {i}"
    assert graph.args is not None and graph.args.binds == 10  # once per new lr, none in between
    user.remove()
    assert "step" not in opt.__dict__


def test_a_graph_whose_lr_was_not_passed_to_any_op_is_refused():
    s = HostScalars([1e-3])
    be = TapeBackend()
    graph = be.new_graph()
    t = torch.zeros(3)
    with be.capture(graph, be.pool(), None):
        s.argument(0)  # taken, never handed to an op
        t.add_(1.0)
    with pytest.raises(RuntimeError, match="found in no recorded op"):
        be.finish(graph, None)


# ----------------------------------------------------------------------------------------------------------
# Lightning fits on the tape
# ----------------------------------------------------------------------------------------------------------
CASES = {
    "adamw-fused": ({"fused": True}, {}),
    "adamw-fused-clip-accumulate": ({"fused": True}, {"gradient_clip_val": 0.5, "accumulate_grad_batches": 2}),
    "adam-fused-amsgrad-bf16-true": ({"cls": torch.optim.Adam, "fused": True, "amsgrad": True},
                                     {"precision": "bf16-true"}),
    # the kernel reads a tensor lr from the device: the graph reads the group's current tensor's value
    "adamw-fused-tensor-lr": ({"fused": True, "lr": lambda: torch.tensor(LR)}, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_graphed_fit_with_the_users_fused_adamw_equals_their_eager_fit_bitwise(case):
    opt_kw, trainer_kw = CASES[case]
    e = _fit(False, opt_kw, trainer_kw=trainer_kw)
    g = _fit(True, opt_kw, cb_kw={"verify_steps": 2}, trainer_kw=trainer_kw)
    stats = g[2].stats
    assert stats.replays > 0 and stats.optimizer_math == ""
    assert _same(g, e), "the graphed fit differs from the user's eager fit"


class _SetLr(pl.Callback):
    """Assigns a new ``lr`` (a value, or a factory of one) to every group before the given batches."""

    def __init__(self, at):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx in self.at:
            new = self.at[batch_idx]
            for g in trainer.optimizers[0].param_groups:
                g["lr"] = new() if callable(new) else new


@pytest.mark.parametrize("case,at", [
    ("tensor-replaced", {5: lambda: torch.tensor(1e-4)}),
    ("tensor-to-float", {5: 2e-4}),
    ("float-to-tensor", {5: lambda: torch.tensor(2e-4, dtype=torch.float64)}),
])
def test_a_group_lr_replaced_between_steps_is_what_the_graph_reads(case, at):
    opt_kw = {"fused": True, "lr": (lambda: torch.tensor(LR)) if case.startswith("tensor") else LR}
    kw = {"opt_kw": opt_kw, "steps": 10}
    e = _fit(False, callbacks=[_SetLr(at)], **kw)
    g = _fit(True, callbacks=[_SetLr(at)], **kw)
    stats = g[2].stats
    assert stats.replays > 0 and stats.optimizer_math == ""
    assert _same(g, e), "the graphed fit differs from the user's eager fit"
    if case != "tensor-replaced":  # another kernel: captured again
        assert stats.captures == 2, stats.summary()


def test_nan_action_skip_keeps_the_users_fused_update_and_gives_its_kernel_the_flag():
    # the fused kernel reads found_inf on the device: with no non-finite gradient the user's update, bit for bit
    # (the poisoned step it skips: test_lightning_cpu's skip test, on the same path)
    flags = []

    class Flag(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            flags.append(getattr(trainer.optimizers[0], "found_inf", None))

    e = _fit(False, {"fused": True})
    g = _fit(True, {"fused": True}, cb_kw={"nan_action": "skip"}, callbacks=[Flag()])
    stats = g[2].stats
    assert stats.replays > 0 and stats.optimizer_math == "" and stats.skipped_steps == 0
    assert _same(g, e), "the graphed fit differs from the user's eager fit"
    assert flags and all(f is flags[0] and isinstance(f, torch.Tensor) for f in flags)
    assert not hasattr(g[3].optimizers[0], "found_inf")  # given back as the user built it


def test_the_prep_captures_the_fused_update_and_gives_the_optimizer_back_as_it_was():
    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=LR, fused=True)
    p.grad = torch.ones(4)
    opt.step()
    prep = OptimizerPrep(opt, torch.device("cpu"), math="eager")
    prep.apply()
    assert isinstance(prep.user, UserMathFusedAdam) and prep.math_differs == ""
    assert opt.param_groups[0]["lr"] == LR and not opt.param_groups[0]["capturable"]
    prep.restore()
    assert "step" not in opt.__dict__ and opt.param_groups[0]["fused"]


# ----------------------------------------------------------------------------------------------------------
# the CUDA node scan, against a stand-in of the driver layer
# ----------------------------------------------------------------------------------------------------------
class _Params:
    kernelParams = 0


class _FakeDriver:
    """Kernel nodes with given argument bytes; records what is set on the executable graph."""

    def __init__(self, nodes):
        self._nodes = nodes  # name -> list of argument bytes
        self.sets = []

    def graph(self, raw):
        return raw

    def graph_exec(self, raw):
        return raw

    def nodes(self, graph):
        return list(self._nodes)

    def node_type(self, node):
        return 0

    def kernel_args(self, node):
        return _Params(), list(self._nodes[node])

    def check(self, rc, what):
        raise RuntimeError(what)

    def exec_kernel_set(self, ex, node, params):
        arr = (ctypes.c_void_p * len(self._nodes[node])).from_address(params.kernelParams)
        self.sets.append((node, [ctypes.string_at(arr[k], len(a)) for k, a in enumerate(self._nodes[node])]))
        return (0,)


def _dbl(x):
    return kernel_args.float_bits(x).to_bytes(8, "little")


def test_the_node_scan_sets_exactly_the_sentinel_arguments_and_only_after_a_change():
    s = HostScalars([1e-3, 2e-3])
    other = (0.9).hex().encode()[:8]
    drv = _FakeDriver({"adam0": [b"\x01" * 64, _dbl(s.sentinels[0]), _dbl(0.9), b"\x00"],
                       "adam1": [b"\x02" * 64, _dbl(s.sentinels[1]), _dbl(0.9), b"\x00"],
                       "gemm": [b"\x03" * 16, other]})
    used = {kernel_args.float_bits(s.sentinels[i]): (s, i) for i in (0, 1)}
    args = _cuda_nodes.ScalarArgs(0, used, driver=drv)
    assert args.nodes == 2
    args.instantiated(0)
    args.bind()
    assert sorted(n for n, _ in drv.sets) == ["adam0", "adam1"]
    by_node = dict(drv.sets)
    assert by_node["adam0"] == [b"\x01" * 64, _dbl(1e-3), _dbl(0.9), b"\x00"]
    assert by_node["adam1"][1] == _dbl(2e-3)
    args.bind()  # nothing changed: no driver call
    assert len(drv.sets) == 2
    s.set(1, 1e-4)
    args.bind()
    assert len(drv.sets) == 4 and dict(drv.sets[2:])["adam1"][1] == _dbl(1e-4)


def test_a_sentinel_found_in_no_node_fails_the_scan():
    s = HostScalars([1e-3, 2e-3])
    drv = _FakeDriver({"adam0": [_dbl(s.sentinels[0])]})
    used = {kernel_args.float_bits(s.sentinels[i]): (s, i) for i in (0, 1)}
    with pytest.raises(_cuda_nodes.RewriteError, match="1 of 2 host scalar"):
        _cuda_nodes.ScalarArgs(0, used, driver=drv)


def test_an_optimizer_state_loaded_mid_fit_keeps_the_graphs_learning_rate_current():
    # load_state_dict prepares the optimizer again (a new captured update): graphs captured before it must keep
    # receiving the schedule's learning rate, as the eager fit's steps do
    import lightning.pytorch as pl

    class Reload(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 6:
                opt = trainer.optimizers[0]
                opt.load_state_dict(opt.state_dict())

    e = _fit(False, {"fused": True}, steps=14, callbacks=[Reload()])
    g = _fit(True, {"fused": True}, steps=14, callbacks=[Reload()])
    assert g[2].stats.replays > 0
    assert _same(g, e)
