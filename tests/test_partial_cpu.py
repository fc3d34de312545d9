"""The partial tier on CPU (``scope="modules"``/``"auto"``), with ``tests/_tape.py``'s stand-in for CUDA graphs.

Discovery (the largest modules that capture around a module or a loss that reads the host), the autograd wiring
(forward and backward graphs behind one ``autograd.Function``: losses, gradients and parameters equal to eager bit
for bit over several steps, ``.grad`` accumulated as eager does, by the backward graphs themselves where a parameter
gets one gradient per backward, by autograd where it gets more: tied, read by the loss too, a module called twice,
``autograd.grad``), the guards (a new input shape, train/eval, a moved parameter, ``max_graphs``), the coverage and
the islands' reasons in ``stats``, ``verify_steps`` (the tier's steps whose graphs all replay run once more with every
graph set aside, undone, and compared), and the option's errors. The tape re-runs the operators it recorded, so a
graphed step computes exactly what the eager one does: bitwise is expected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
import warnings

import _tape
import pytest
import torch
from _tape import CompiledCalls, TapeBackend
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nemo_cudagraph_plugin
from nemo_cudagraph_plugin import CaptureConfig, CaptureError, CudaGraphCallback, ParityError
from nemo_cudagraph_plugin.core import _torch_compat
from nemo_cudagraph_plugin.core.partial import PartialGraphs

cpu = torch.device("cpu")


def _line(fn, text: str) -> str:
    """``file:line`` of the line of ``fn``'s source that contains ``text``."""
    lines, start = inspect.getsourcelines(fn)
    return f"{inspect.getsourcefile(fn)}:{start + next(i for i, s in enumerate(lines) if text in s)}"


class Guard(nn.Module):
    """Reads the host: no graph can hold this module."""

    def forward(self, x):
        if x.abs().max() > 100:  # HOST-READ
            x = x.clamp(-100, 100)
        return x


class Block(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.Tanh()
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.act(self.fc(x)))


class Net(nn.Module):
    def __init__(self, guard=True, dropout=0.1):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.b0 = Block(dropout)
        self.guard = Guard() if guard else nn.Identity()
        self.b1 = Block(dropout)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.b1(self.guard(self.b0(self.inp(x)))))


class Glue(nn.Module):
    """Its own code reads the host between two children that capture."""

    def __init__(self):
        super().__init__()
        self.a = Block()
        self.b = Block()

    def forward(self, x):
        x = self.a(x)
        if bool((x > 50).any()):  # GLUE-READ
            x = x * 0.5
        return self.b(x)


class ItemLoss(nn.Module):
    """A loss that logs its value with ``.item()``."""

    def __init__(self):
        super().__init__()
        self.seen: list[float] = []

    def forward(self, pred, y):
        loss = (pred - y).pow(2).mean()
        self.seen.append(loss.item())  # ITEM-READ
        return loss


class WithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Net(guard=False)
        self.loss = ItemLoss()

    def forward(self, x, y):
        return self.loss(self.model(x), y)


class Scaled(nn.Module):
    """A float, a ``None``, and a tensor that needs no gradient among the arguments."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask, scale: float = 1.0, bias=None):
        y = self.fc(x) * scale * mask
        return y if bias is None else y + bias


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.mid = Scaled()
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        mask = (x[:, :1] > 0).to(x.dtype)  # no gradient
        return self.out(self.mid(self.inp(x), mask, scale=0.5))


def batches(n, rows=(5,), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows[i % len(rows)], 4, generator=g), torch.randn(rows[i % len(rows)], 1, generator=g))
            for i in range(n)]


def train(make, data, graphed, between=None, zero_every=1, loss_in_model=False, set_to_none=True, extra=None,
          input_grad=False, **cfg):
    """Per-step losses, gradients and the final parameters of an AdamW training loop; the tier when graphed.
    ``set_to_none=False`` zeroes the gradients in place (as the tier's owner does); ``extra(i, model)`` is added to
    the loss; ``input_grad``: each step also takes the gradient of the loss with respect to the batch
    (``torch.autograd.grad``, a pass that must leave ``.grad`` alone) before its backward."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=2.0**-6)
    cfg.setdefault("warmup_steps", 2)
    tier = PartialGraphs(model, CaptureConfig(**cfg), cpu, backend=TapeBackend()) if graphed else None
    losses, grads = [], []
    for i, (x, y) in enumerate(data):
        if between is not None:
            between(i, model)
        with tier.step() if tier is not None else contextlib.nullcontext():
            if i % zero_every == 0:
                opt.zero_grad(set_to_none=set_to_none)
            if input_grad:
                x = x.clone().requires_grad_()
            loss = model(x, y) if loss_in_model else (model(x) - y).pow(2).mean()
            if extra is not None:
                loss = loss + extra(i, model)
            if input_grad:
                torch.autograd.grad(loss, x, retain_graph=True)
            loss.backward()
            if (i + 1) % zero_every == 0:
                opt.step()
        losses.append(loss.detach())
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
    return losses, grads, [p.detach().clone() for p in model.parameters()], tier, model


def assert_bitwise(g, e):
    lg, gg, pg = g[:3]
    le, ge, pe = e[:3]
    assert [float(a) for a in lg] == [float(b) for b in le], "losses differ from eager"
    for step, (a, b) in enumerate(zip(gg, ge)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert (x is None) == (y is None), f"step {step}: parameter {i} has a gradient in one run only"
            assert x is None or torch.equal(x, y), f"step {step}: gradient of parameter {i} differs from eager"
    assert all(torch.equal(a, b) for a, b in zip(pg, pe)), "parameters differ from eager"


def both(make, data, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train(make, data, True, **kw), train(make, data, False, **{k: v for k, v in kw.items()
                                                                          if k in ("between", "zero_every",
                                                                                   "loss_in_model", "set_to_none",
                                                                                   "extra", "input_grad")})


def test_runs_this_checkout():
    assert nemo_cudagraph_plugin.__file__.startswith(str(__import__("pathlib").Path(__file__).resolve().parents[1]))


# ----------------------------------------------------------------------------------------------------------------------
# discovery
# ----------------------------------------------------------------------------------------------------------------------
def test_discovery_graphs_the_largest_modules_around_a_module_that_reads_the_host():
    g, e = both(Net, batches(8))
    tier = g[3]
    rep = tier.report
    assert rep.graphed == ["inp", "b0", "b1", "out"]  # the root failed; every child but the guard captured whole
    assert list(rep.islands) == ["guard"]
    assert rep.islands["guard"].startswith(_line(Guard.forward, "HOST-READ") + ": a host synchronisation")
    assert_bitwise(g, e)


def test_the_first_step_after_the_warm_up_finds_every_graph():
    # warm-up steps 0 and 1; in step 2 the root's capture fails and its eager call tries (and captures) its children
    g = train(Net, batches(3), True)
    assert g[3].report.graphed == ["inp", "b0", "b1", "out"] and list(g[3].report.islands) == ["guard"]
    assert g[3].report.captures == 4


def test_a_module_whose_own_code_reads_the_host_keeps_its_children_graphed():
    g, e = both(lambda: nn.Sequential(nn.Linear(4, 8), Glue(), nn.Linear(8, 1)), batches(6))
    rep = g[3].report
    assert rep.graphed == ["0", "1.a", "1.b", "2"]
    assert list(rep.islands) == ["1"]
    assert rep.islands["1"] == ("its own code (not its submodules): " + _line(Glue.forward, "GLUE-READ")
                                + rep.islands["1"].split(_line(Glue.forward, "GLUE-READ"))[1])
    assert "host synchronisation" in rep.islands["1"]
    assert_bitwise(g, e)


def test_a_loss_module_calling_item_is_an_island_and_the_model_is_one_graph():
    g, e = both(WithLoss, batches(6), loss_in_model=True)
    rep = g[3].report
    assert rep.graphed == ["model"]
    assert list(rep.islands) == ["loss"]
    assert rep.islands["loss"].startswith(_line(ItemLoss.forward, "ITEM-READ") + ":")
    assert g[4].loss.seen == e[4].loss.seen  # the island runs every step, its .item() included
    assert_bitwise(g, e)


def test_a_loss_function_calling_item_outside_modules_leaves_the_whole_model_graphed():
    seen = []

    def make():
        return Net(guard=False)

    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=2.0**-6)
    tier = PartialGraphs(model, CaptureConfig(warmup_steps=1), cpu, backend=TapeBackend())
    losses = []
    for x, y in batches(5):
        with tier.step():
            opt.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            seen.append(loss.item())
            loss.backward()
            opt.step()
        losses.append(float(loss.detach()))
    assert tier.report.graphed == [""] and tier.report.islands == {}
    assert tier.report.modules_graphed == tier.report.modules_called
    e = train(make, batches(5), False)
    assert losses == [float(v) for v in e[0]] == seen


class PosScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, pos):
        return self.lin(x * pos)


class Expanding(nn.Module):
    """Hands its child a broadcast view (``expand``: stride 0), as HF models do with position ids and masks; or, with
    ``dense_view``, a view that is not broadcast (``unsqueeze``, ``view``: GPT-2's position ids)."""

    def __init__(self, dense_view=False):
        super().__init__()
        self.inner = PosScale()
        self.dense_view = dense_view

    def forward(self, x):
        if self.dense_view:
            pos = torch.arange(4.0 * x.shape[0]).view(x.shape[0], 4)
        else:
            pos = torch.arange(4.0).expand(x.shape[0], 4)
        if x.abs().max() > 100:  # a host read: the root is not a graph, its child is tried
            x = x.clamp(-100, 100)
        return self.inner(x, pos)


def test_a_broadcast_input_is_copied_into_dense_static_memory():
    g, e = both(Expanding, batches(6))
    assert g[3].report.graphed == ["inner"] and list(g[3].report.islands) == [""]
    assert_bitwise(g, e)


# ----------------------------------------------------------------------------------------------------------------------
# the optimizer side as one graph
# ----------------------------------------------------------------------------------------------------------------------
def train_sgd(graphed, steps=8, between=None, make_opt=None, clip=0.5, no_update=(), aside=()):
    """An SGD (momentum, weight decay) loop with clipping by norm before each update; with the tier and its optimizer
    graph when graphed (the clipping handed to it as a framework's clipping would be; in the steps ``aside``, inside
    the optimizer graph's ``eager()``)."""
    torch.manual_seed(0)
    model = Net(guard=True, dropout=0.0)
    opt = (make_opt or (lambda ps: torch.optim.SGD(ps, lr=2.0**-5, momentum=0.9, weight_decay=0.01)))(
        model.parameters())
    tier = og = None
    if graphed:
        tier = PartialGraphs(model, CaptureConfig(warmup_steps=2), cpu, backend=TapeBackend())
        named = list(model.named_parameters())
        og = tier.graph_optimizer(opt, named, lambda: [
            *named, *((f"{n}.grad", p.grad) for n, p in named if p.grad is not None),
            *((f"state {k} of {i}", v) for i, st in enumerate(opt.state.values()) for k, v in st.items()
              if isinstance(v, torch.Tensor))])
    losses, params = [], []
    for i, (x, y) in enumerate(batches(steps)):
        if between is not None:
            between(i, model, opt, tier)
        with tier.step() if tier is not None else contextlib.nullcontext():
            opt.zero_grad(set_to_none=False)
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            with og.eager() if og is not None and i in aside else contextlib.nullcontext():
                if clip is not None and not (og is not None and og.defer(torch.nn.utils.clip_grad_norm_,
                                                                         list(model.parameters()), clip)):
                    torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
                if i not in no_update:  # a step skipped after the clipping (a GradScaler that found an inf)
                    opt.step()
        losses.append(float(loss.detach()))
        params.append([p.detach().clone() for p in model.parameters()])
    return losses, params, tier, opt


def assert_same_training(g, e):
    assert g[0] == e[0], "losses differ from eager"
    for step, (a, b) in enumerate(zip(g[1], e[1])):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}: parameters differ from eager"


def test_the_optimizer_side_is_one_graph_equal_to_eager():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = train_sgd(True)
    assert_same_training(g, train_sgd(False))
    rep = g[2].report
    # warm-up steps 0-1 eager; step 2 the key's first eager step; step 3 captures (and is the step); 4-7 replay
    assert (rep.optimizer_captures, rep.optimizer_replays) == (1, 4)
    assert rep.optimizer.startswith("graphed") and "optimizer side graphed" in rep.summary()


def test_the_optimizer_graph_shares_the_pool_of_the_module_graphs_before_it(monkeypatch):
    # captured a step after the modules' graphs, it replays after all of them: their temporaries are its to reuse
    pools = []
    monkeypatch.setattr(TapeBackend, "pool", lambda self: pools.append(_tape._Pool()) or pools[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = train_sgd(True)
    tier = g[2]
    (entry,) = tier.optimizer.graphs.values()
    (pool,) = [p for p in pools if entry.graph in p.graphs]
    modules = [n.cache.peek(k).fwd for n in tier.nodes for k in n.cache.keys()]
    assert modules and any(f in pool.graphs for f in modules), "the optimizer graph took a pool of its own"


def test_the_clipping_handed_to_the_optimizer_graph_runs_in_it():
    calls = []
    orig = torch.nn.utils.clip_grad_norm_

    def counting(*args, **kwargs):
        calls.append(1)
        return orig(*args, **kwargs)

    torch.nn.utils.clip_grad_norm_ = counting
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = train_sgd(True)
    finally:
        torch.nn.utils.clip_grad_norm_ = orig
    # Python runs the clipping in the 3 eager steps and the capture; the 4 replays run its kernels without Python
    assert len(calls) == 4
    assert_same_training(g, train_sgd(False))
    assert g[0] != train_sgd(False, clip=None)[0][: len(g[0])]  # the clipping matters in this loop


def test_a_step_without_update_leaves_nothing_deferred_for_the_next():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = train_sgd(True, steps=10, no_update=(5,))
    assert_same_training(g, train_sgd(False, steps=10, no_update=(5,)))
    assert g[2].report.optimizer_captures == 1


def test_the_optimizer_graph_set_aside_runs_the_update_eagerly_and_keeps_its_graph():
    """``OptimizerGraph.eager`` (the eager half of ``verify_steps``): in steps past the capture, the clipping is not
    deferred and the update runs eagerly (no replay, no capture, no event, the instance's step still the graph's);
    the graph replays in the steps after, and training equals eager."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = train_sgd(True, steps=10, aside=(5, 6))
    assert_same_training(g, train_sgd(False, steps=10))
    rep, og, opt = g[2].report, g[2].optimizer, g[3]
    # warm-up 0-1, the key's eager first step 2, the capture 3; 5 and 6 set aside; 4 and 7-9 replay
    assert (rep.optimizer_captures, rep.optimizer_replays, og.events) == (1, 4, 2)
    assert opt.__dict__["step"] is og._step


def test_only_a_step_whose_graphs_all_replay_is_one_to_verify():
    """What ``verify_steps`` asks of the tier: before a step, whether it may replay graphs only (past the warm-up, no
    module left to try, a graph to replay); after it, whether it did. A step that captures any graph is not one: here
    the forward (step 1, whose loss is not back-propagated), the backward (step 2), the gradient additions (step 3)."""
    torch.manual_seed(0)
    model = Net(guard=False, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=2.0**-5, momentum=0.9)
    tier = PartialGraphs(model, CaptureConfig(warmup_steps=1), cpu, backend=TapeBackend())
    named = list(model.named_parameters())
    tier.graph_optimizer(opt, named, lambda: [
        *named, *((f"{n}.grad", p.grad) for n, p in named if p.grad is not None),
        *((f"state {k} of {i}", v) for i, st in enumerate(opt.state.values()) for k, v in st.items()
          if isinstance(v, torch.Tensor))])
    before, after = [], []
    for i, (x, y) in enumerate(batches(8)):
        with tier.step():
            before.append(tier.may_replay_only())
            opt.zero_grad(set_to_none=False)
            loss = (model(x) - y).pow(2).mean()
            if i != 1:
                loss.backward()
            if i >= 4:
                opt.step()
            after.append(tier.replayed_only())
    assert before == [False, False, True, True, True, True, True, True]
    # ... and the optimizer side's first step of its key (4, eager) and its capture (5)
    assert after == [False, False, False, False, False, False, True, True]
    rep = tier.report
    assert rep.graphed == [""] and rep.grads_in_graphs == len(named) and rep.optimizer_replays == 2


def test_a_gradient_set_to_none_recaptures_the_optimizer_graph():
    def drop(i, model, opt, tier):
        if i == 5:
            opt.zero_grad(set_to_none=True)  # the next backward makes new gradients

    with pytest.warns(UserWarning, match="optimizer step re-captured: the gradient of 'inp.weight' was replaced"):
        g = train_sgd(True, steps=9, between=drop)
    assert_same_training(g, train_sgd(False, steps=9, between=drop))
    assert g[2].report.optimizer_recaptures == 1 and g[2].report.optimizer_captures == 2


def test_a_moved_parameter_recaptures_the_optimizer_graph():
    def move(i, model, opt, tier):
        if i == 5:  # no hook says so: the graph would keep updating the old memory
            model.b0.fc.weight.data = model.b0.fc.weight.data.clone()

    with pytest.warns(UserWarning, match="optimizer step re-captured: 'b0.fc.weight' was re-allocated"):
        g = train_sgd(True, steps=9, between=move)
    assert_same_training(g, train_sgd(False, steps=9, between=move))
    assert g[2].report.optimizer_recaptures == 1 and g[2].report.optimizer_captures == 2


def test_a_moved_optimizer_state_is_found_when_marked_dirty():
    def move(i, model, opt, tier):
        if i == 5:
            for st in opt.state.values():
                st["momentum_buffer"] = st["momentum_buffer"].clone()  # as a loaded state would be
            if tier is not None:
                tier.optimizer.dirty = True  # what the owner's load_state_dict hooks say

    with pytest.warns(UserWarning, match="optimizer step re-captured: 'state momentum_buffer of 0' was re-allocated"):
        g = train_sgd(True, steps=9, between=move)
    assert_same_training(g, train_sgd(False, steps=9, between=move))
    assert g[2].report.optimizer_captures == 2


def test_an_optimizer_that_reads_the_host_is_eager_with_its_reason():
    def move(i, model, opt, tier):  # after the failed optimizer capture (step 3): module 'b1' captures again
        if i == 5:
            model.b1.fc.weight.data = model.b1.fc.weight.data.clone()

    # torch's non-capturable Adam reads its step counter on the host (bias corrections as Python floats)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = train_sgd(True, steps=9, between=move, make_opt=lambda ps: torch.optim.Adam(ps, lr=2.0**-6, foreach=False))
    rep = g[2].report
    assert rep.optimizer.startswith("eager: ") and "torch/optim/" in rep.optimizer, rep.optimizer
    assert "optimizer side eager" in rep.summary()
    assert rep.optimizer_replays == 0
    # the modules stay graphed, 'b1' re-captured after the failure (into a new pool: the failed capture's is unusable)
    assert rep.graphed == ["inp", "b0", "b1", "out"] and rep.islands == {"guard": rep.islands["guard"]}, rep.islands


def test_close_gives_the_optimizer_its_step_back():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tier = PartialGraphs(model, CaptureConfig(), cpu, backend=TapeBackend())
    tier.graph_optimizer(opt, list(model.named_parameters()), lambda: [])
    assert "step" in opt.__dict__
    tier.close()
    tier.close()
    assert "step" not in opt.__dict__ and opt.step.__func__ is torch.optim.SGD.step


# ----------------------------------------------------------------------------------------------------------------------
# the autograd wiring
# ----------------------------------------------------------------------------------------------------------------------
def test_gradients_accumulate_into_grad_as_in_eager_training():
    # zero_grad every other step: the second backward adds into .grad (graph memory must never become a .grad)
    g, e = both(Net, batches(8), zero_every=2)
    assert g[3].report.replays > 0
    assert_bitwise(g, e)


def test_inputs_without_gradient_and_non_tensor_arguments():
    g, e = both(Masked, batches(6))
    assert g[3].report.graphed == [""]
    assert_bitwise(g, e)


def test_outputs_are_copies_that_later_replays_do_not_overwrite():
    torch.manual_seed(0)
    model = Net(guard=False, dropout=0.0)
    tier = PartialGraphs(model, CaptureConfig(warmup_steps=1), cpu, backend=TapeBackend())
    kept = []
    for x, _ in batches(5):
        with tier.step():
            kept.append(model(x))
    assert tier.report.graphed == [""] and tier.report.replays > 0
    with torch.no_grad():
        expected = [model(x) for x, _ in batches(5)]  # outside a step: the module's own forward
    assert all(torch.equal(a, e) for a, e in zip(kept, expected))


# ----------------------------------------------------------------------------------------------------------------------
# parameter gradients added into .grad inside the backward graphs
# ----------------------------------------------------------------------------------------------------------------------
def _recording(fn, *args, **kwargs):
    """``fn``'s result and the warnings it raised about gradients that came from outside a module too."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    return out, [str(w.message) for w in seen if "from outside it in one backward" in str(w.message)]


def _both_seen(make, data, **kw):
    """:func:`both` with the graphed run's warnings about gradients that came from outside a module too."""
    g, seen = _recording(train, make, data, True, **kw)
    return (g, train(make, data, False, **kw)), seen


def _no_probe_left(model):
    return all(p._backward_hooks is None and not p._post_accumulate_grad_hooks for p in model.parameters())


@pytest.mark.parametrize("zero_every", [1, 2], ids=["every-step", "accumulating-two-backwards"])
def test_parameter_gradients_are_added_inside_the_backward_graphs_bitwise_as_autograd(zero_every):
    """Gradients zeroed in place (as the tier's owner zeroes them): every parameter of the graphed modules has its
    gradient added into ``.grad`` by its module's graph, the same in-place add autograd makes; with two backwards per
    window the second adds into a non-zero gradient. Losses, gradients and parameters equal eager training bit for
    bit, and the probe leaves no hook behind."""
    (g, e), seen = _both_seen(Net, batches(9), set_to_none=False, zero_every=zero_every)
    rep = g[3].report
    assert rep.graphed == ["inp", "b0", "b1", "out"]
    assert rep.grads_in_graphs == 8 and rep.grads_outside == {} and not seen
    assert "8 parameters' gradients accumulated inside graphs" in rep.summary()
    assert _no_probe_left(g[4])
    assert_bitwise(g, e)


class _AddsOutside(TorchDispatchMode):
    """Counts the in-place adds dispatched outside graph replays."""

    def __init__(self, tally):
        super().__init__()
        self.tally, self.adds = tally, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.add_.Tensor and not self.tally.inside:
            self.adds += 1
        return func(*args, **(kwargs or {}))


def test_the_backward_launches_no_add_per_parameter_outside_the_graphs():
    """The step whose graphs all replay: autograd's accumulation launched one add per parameter outside the graphs;
    with the adds inside the backward graphs none is left, and the tier's operator coverage counts 8 fewer outside."""

    def run(accumulate):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=2.0**-6)
        tier = PartialGraphs(model, CaptureConfig(warmup_steps=2), cpu, backend=TapeBackend())
        if not accumulate:
            tier.grads.full_pass = lambda: False  # every backward hands the gradients to autograd
        counter = _AddsOutside(tier.tally)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, (x, y) in enumerate(batches(7)):
                with tier.step():
                    opt.zero_grad(set_to_none=False)
                    loss = (model(x) - y).pow(2).mean()
                    with counter if i == 6 else contextlib.nullcontext():
                        loss.backward()
                    opt.step()
        return counter.adds, tier.report

    on, rep = run(True)
    off, base = run(False)
    assert (on, off) == (0, 8)
    assert base.grads_in_graphs == 0 and rep.grads_in_graphs == 8
    assert base.ops_outside - rep.ops_outside == 8 and rep.op_coverage > base.op_coverage


class TiedLM(nn.Module):
    """An embedding and an LM head sharing one weight, a host read between them: embedding and head are two graphed
    modules, each giving the shared weight a gradient in the same backward."""

    def __init__(self, vocab=11):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.mid = Block(dropout=0.0)
        self.guard = Guard()
        self.head = nn.Linear(8, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.guard(self.mid(self.emb(ids))))


def _train_lm(graphed, steps=8, zero_every=2):
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=2.0**-6)
    tier = PartialGraphs(model, CaptureConfig(warmup_steps=2), cpu, backend=TapeBackend()) if graphed else None
    gen = torch.Generator().manual_seed(3)
    losses, grads = [], []
    for i in range(steps):
        ids = torch.randint(0, 11, (4, 6), generator=gen)
        with tier.step() if tier is not None else contextlib.nullcontext():
            if i % zero_every == 0:
                opt.zero_grad(set_to_none=False)
            loss = nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, 11), ids[:, 1:].reshape(-1))
            loss.backward()
            if (i + 1) % zero_every == 0:
                opt.step()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    return losses, grads, [p.detach().clone() for p in model.parameters()], tier, model


def test_a_tied_weight_keeps_autograds_accumulation():
    """The weight the embedding and the head share gets two gradients in one backward, which autograd sums before it
    adds them: it stays with autograd (said in stats), the head's and the block's other parameters are added inside
    the graphs, and training equals eager bit for bit while gradients accumulate over two backwards."""
    g, seen = _recording(_train_lm, True)
    e = _train_lm(False)
    rep = g[3].report
    assert rep.graphed == ["emb", "mid", "head"] and list(rep.islands) == ["guard"]
    assert list(rep.grads_outside) == ["emb.weight"] and rep.grads_outside["emb.weight"].startswith("tied")
    assert rep.grads_in_graphs == 2 and not seen  # the block's weight and bias
    assert_bitwise(g, e)


@pytest.mark.parametrize("late", [False, True], ids=["every-step", "from-step-5"])
def test_a_parameter_the_loss_also_reads_stays_correct(late):
    """The loss reads a graphed module's weight too: a second contribution to its gradient. Read from the start, the
    probe at the first backward finds it before any graph adds: autograd keeps that parameter, nothing differs and
    nothing is said (gradients accumulated over two backwards, where the order of the sum shows). Read from step 5
    on, after the graph added it for steps: found at the end of that backward, said once, autograd's from then on."""

    def extra(i, model):
        return model.b0.fc.weight.pow(2).sum() * 1e-2 if not late or i >= 5 else 0.0

    (g, e), seen = _both_seen(Net, batches(9), set_to_none=False, zero_every=1 if late else 2, extra=extra)
    rep = g[3].report
    assert list(rep.grads_outside) == ["b0.fc.weight"] and rep.grads_in_graphs == 7
    if late:
        assert len(seen) == 1 and "'b0.fc.weight' came from the graph of module 'b0'" in seen[0]
    else:
        assert not seen
    assert_bitwise(g, e)


@pytest.mark.parametrize("how", ["none", "replaced"])
def test_a_gradient_set_to_none_or_replaced_by_user_code_stays_correct(how):
    """User code sets every ``.grad`` to None (as Lightning does before validation) or replaces it between steps:
    the graph never adds into the old tensor; that call's gradients go to autograd and the accumulation graph is
    built again with the gradients then present."""

    def drop(i, model):
        if i == 5:
            for p in model.parameters():
                p.grad = None if how == "none" else torch.zeros_like(p)

    (g, e), seen = _both_seen(Net, batches(9), set_to_none=False, zero_every=2, between=drop)
    rep = g[3].report
    assert rep.grads_in_graphs == 8 and not seen
    assert all(p.grad is grad for n in g[3].nodes for k in n.cache.keys()
               for _, p, grad in n.cache.peek(k).accumulated)
    assert_bitwise(g, e)


def test_a_backward_that_takes_input_gradients_only_leaves_grad_alone():
    """``torch.autograd.grad`` with respect to the batch runs the backward graphs too: it must not add anything into
    ``.grad`` (eager training does not); the ``backward()`` after it does."""
    (g, e), seen = _both_seen(Net, batches(8), set_to_none=False, zero_every=2, input_grad=True)
    assert g[3].report.grads_in_graphs == 8 and not seen
    assert_bitwise(g, e)


class TwoShapes(Net):
    """Calls its block ``b0`` a second time, on another shape, once ``_twice`` is set: two graphs of one module give
    its parameters two gradients in one backward."""

    def __init__(self):
        super().__init__(guard=True, dropout=0.0)
        self._twice = False  # private: the module-state guard does not drop the graphs when it changes

    def forward(self, x):
        h = self.b0(self.inp(x))
        if self._twice:
            h = h + self.b0(h[:3]).sum(0)
        return self.out(self.b1(self.guard(h)))


def test_a_module_called_twice_in_a_step_hands_its_gradients_to_autograd():
    """From step 5 on ``b0`` is called twice per step (a second signature, captured too): autograd must sum its two
    gradients before adding them, so neither graph adds them itself; the other modules' graphs still do."""

    def twice(i, model):
        model._twice = i >= 5

    (g, e), seen = _both_seen(TwoShapes, batches(10), set_to_none=False, zero_every=2, between=twice)
    rep = g[3].report
    assert rep.captures == 5 and not seen  # b0's second signature is a graph of its own
    assert rep.grads_in_graphs == 8  # b0's first graph keeps its accumulation graph for steps with one call
    assert_bitwise(g, e)


class Reuse(nn.Module):
    """Its own code reads the host; ``b`` is called once per step, and from batches of 7 rows on a second time with
    the same signature (a layer reused a data-dependent number of times)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.b = Block(dropout=0.0)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        if x.abs().max() > 100:  # REUSE-READ
            x = x.clamp(-100, 100)
        h = self.b(self.inp(x))
        if x.shape[0] > 5:
            h = self.b(h)
        return self.out(h)


def test_a_second_call_with_the_same_signature_in_a_step_runs_eagerly():
    """One graph per signature: a replay for the second call would overwrite the activations the first call's
    backward reads (its graph's static memory). The second call runs eagerly; training equals eager."""
    g, e = both(Reuse, batches(8, rows=(5, 5, 5, 7, 5, 7, 7, 5)))
    rep = g[3].report
    assert "b" in rep.graphed and rep.replays > 0
    # the first 7-row step runs the new signature eagerly, then captures it at the second call; the two after
    # replay the first call and run the second eagerly
    assert rep.eager_calls.get("called again in the step", 0) == 2
    assert_bitwise(g, e)


class _ClipGrad(torch.autograd.Function):
    """Identity forward; a backward that asks the host whether to clip."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if g.abs().max() > 1e6:  # BACKWARD-READ
            g = g.clamp(-1e6, 1e6)
        return g


class ClipBlock(Block):
    def forward(self, x):
        return _ClipGrad.apply(super().forward(x))


def test_a_backward_that_reads_the_host_makes_an_island_after_its_eager_gradients():
    def make():
        net = Net(guard=False)
        net.b1 = ClipBlock()
        return net

    g, e = both(make, batches(8))
    rep = g[3].report
    # The whole model's forward captured; its backward did not: that step's gradients came eagerly from the
    # capture's autograd graph, then the children were tried; the block's own backward is the island.
    assert rep.graphed == ["inp", "b0", "guard", "b1.fc", "b1.act", "b1.drop", "out"]
    assert list(rep.islands) == ["b1"]
    assert _line(_ClipGrad.backward, "BACKWARD-READ") + ": a host synchronisation" in rep.islands["b1"]
    assert_bitwise(g, e)


def test_close_gives_every_module_its_forward_back():
    model = Net()
    tier = PartialGraphs(model, CaptureConfig(warmup_steps=1), cpu, backend=TapeBackend())
    assert "forward" in model.b0.__dict__
    tier.close()
    assert not any("forward" in m.__dict__ for m in model.modules())


# ----------------------------------------------------------------------------------------------------------------------
# guards
# ----------------------------------------------------------------------------------------------------------------------
def test_a_new_input_shape_is_a_new_capture():
    g, e = both(Net, batches(9, rows=(5, 7)))
    rep = g[3].report
    assert rep.captures == 2 * len(rep.graphed)  # one per shape and module
    assert_bitwise(g, e)


def test_train_eval_change_recaptures():
    def flip(i, model):
        if i == 5:
            model.b0.eval()  # its dropout stops dropping: the graph baked in training=True
        if i == 7:
            model.b0.train()

    with pytest.warns(UserWarning, match="re-captured: b0.training changed"):
        g = train(Net, batches(10), True, between=flip)
    e = train(Net, batches(10), False, between=flip)
    assert_bitwise(g, e)


@pytest.mark.parametrize("name", ["b1", "b0"])
def test_a_moved_parameter_recaptures(name):
    # b0: captured again later than b1 and out, whose graphs replay between its forward and its backward: the memory
    # of their temporaries must not hold what its capture keeps (the tape's pools reuse it)
    def move(i, model):
        if i == 5:
            fc = getattr(model, name).fc
            fc.weight.data = fc.weight.data.clone()

    with pytest.warns(UserWarning, match=f"module '{name}' re-captured .*'fc.weight' was re-allocated"):
        g = train(Net, batches(9), True, between=move)
    e = train(Net, batches(9), False, between=move)
    assert_bitwise(g, e)


def test_max_graphs_bounds_the_graphs_per_module():
    g, e = both(Net, batches(9, rows=(5, 7)), max_graphs=1)
    rep = g[3].report
    assert rep.captures == len(rep.graphed) and rep.eager_calls["graph cache full"] > 0
    assert_bitwise(g, e)


# ----------------------------------------------------------------------------------------------------------------------
# coverage and options
# ----------------------------------------------------------------------------------------------------------------------
def test_coverage_in_stats():
    g, _ = both(Net, batches(6))
    rep = g[3].report
    assert g[3].stats.partial is rep
    assert rep.modules_called == 12 and rep.modules_graphed == 10  # all but the root and the guard
    assert rep.ops_step > rep.ops_outside > 0 and 0 < rep.op_coverage < 1
    text = g[3].stats.summary()
    assert "partial graphs: 4 graphed modules (inp, b0, b1, out)" in text and "islands: guard (" in text
    assert set(rep.island_host_ms) == {"guard"} and rep.island_host_ms["guard"] > 0


def test_scope_errors_name_the_class_and_argument():
    with pytest.raises(ValueError, match=r"CudaGraphCallback\(scope='partial'\) is invalid: use 'step'"):
        CudaGraphCallback(scope="partial")
    with pytest.raises(ValueError, match=r"CaptureConfig\(scope=None\) is invalid"):
        CaptureConfig(scope=None)
    with pytest.raises(ValueError, match=r"CudaGraphCallback\(nan_action='skip'\) is invalid: scope='modules' graphs"):
        CudaGraphCallback(scope="modules", nan_action="skip")
    assert CaptureConfig().scope == "auto"


# ----------------------------------------------------------------------------------------------------------------------
# Lightning
# ----------------------------------------------------------------------------------------------------------------------
def _lightning():
    pytest.importorskip("lightning")
    import test_lightning_cpu as lt

    return lt


class _GuardedGPT:
    """recipes.gpt's module with a host-reading module applied to its logits."""

    @staticmethod
    def make(lt):
        class GuardedGPT(lt.TinyGPT):
            def __init__(self, **kw):
                super().__init__(**kw)
                self.guard = Guard()

            def forward(self, ids):
                return self.guard(self.model(ids))

        return GuardedGPT


def _fit(lt, module_cls, graphed, cb_kw=None, steps=10, callbacks=(), val_every=None, ckpt_path=None, lengths=(32,),
         **trainer_kw):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    pl.seed_everything(0, verbose=False)
    module = module_cls()
    cb = None
    cbs = list(callbacks)
    if graphed:
        cb = CudaGraphCallback(**(cb_kw or {}))
        cb.step_runner.backend = TapeBackend()
        cbs.append(cb)
    rec = lt.Rec()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[*cbs, rec], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, max_epochs=2, val_check_interval=val_every, **trainer_kw)
    val = DataLoader(lt.Windows(2, seed=1), batch_size=2) if val_every else None
    trainer.fit(module, train_dataloaders=DataLoader(lt.Windows(steps, lengths), batch_size=2), val_dataloaders=val,
                ckpt_path=ckpt_path)
    return lt.Run(trainer, rec, cb, module)


@pytest.mark.lightning_adapter
@pytest.mark.parametrize("scope", ["modules", "auto"])
def test_lightning_partial_graphs_equal_eager(scope):
    import lightning.pytorch as pl

    lt = _lightning()
    cls = _GuardedGPT.make(lt)
    groups = []

    class Groups(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            g = trainer.optimizers[0].param_groups[0]
            groups.append((isinstance(g["lr"], float), g.get("capturable", False)))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = _fit(lt, cls, True, {"scope": scope, "nan_guard": False}, callbacks=[Groups()])
    e = _fit(lt, cls, False)
    lt.assert_same(g, e)
    # the optimizer side is a graph of the user's own fused AdamW step: their float lr, their flags, every step
    assert set(groups) == {(True, False)}
    rep = g.stats.partial
    assert rep is not None and rep.graphed == ["model"] and list(rep.islands) == ["guard"]
    assert rep.replays > 0 and g.cb.eager_reason is None and rep.optimizer_eager_untouched == 0
    # every gradient but the tied embedding/head weight's is added into .grad inside the model's backward graphs
    assert rep.grads_in_graphs == sum(1 for _ in g.module.parameters()) - 1
    assert list(rep.grads_outside) == ["model.emb.tok.weight"]
    assert g.stats.eager_reasons.get("partial graphs", 0) > 0 and g.stats.replays == 0
    assert "partial graphs:" in g.stats.summary()


class _Branches:
    """recipes.gpt's module with two heads on its logits, one or both chosen per batch on the host: a head not
    chosen gets no gradient in that step (eager ``zero_grad(set_to_none=True)`` leaves it ``None``: the optimizer
    skips it)."""

    @staticmethod
    def make(lt, **kw):
        class Branches(lt.TinyGPT):
            def __init__(self):
                super().__init__(**kw)
                v = lt.CFG.vocab_size
                self.heads = nn.ModuleList([nn.Linear(v, v), nn.Linear(v, v)])

            def training_step(self, batch, batch_idx):
                ids = batch["input_ids"]
                logits = self.model(ids)
                pick = int(ids[0, 0]) % 3  # a host read: the choice is the island
                for i, head in enumerate(self.heads):
                    if pick in (i, 2):  # one head, or both
                        logits = logits + head(logits)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
                self.log("train_loss", loss)
                return loss

        return Branches


@pytest.mark.lightning_adapter
@pytest.mark.parametrize("optimizer,accumulate,clip", [("fused_adamw", 1, None), ("fused_adamw", 2, None),
                                                       ("fused_adamw", 1, 0.5), ("sgd", 1, None), ("sgd", 2, 0.5)])
def test_lightning_partial_graphs_leave_a_module_not_called_in_a_step_without_gradient_as_eager_does(optimizer,
                                                                                                    accumulate, clip):
    """A head called in some steps only: in a step that does not call it, eager training leaves its parameters
    without a gradient (``zero_grad(set_to_none=True)``) and the optimizer skips them (no momentum, no weight decay
    applied). The partial tier zeroes gradients in place; it must not step those parameters with zeros."""
    lt = _lightning()
    cls = _Branches.make(lt, sgd=optimizer == "sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = _fit(lt, cls, True, {"scope": "modules", "nan_guard": False}, steps=12, accumulate_grad_batches=accumulate,
                 gradient_clip_val=clip)
    e = _fit(lt, cls, False, steps=12, accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    chosen = [int(b["input_ids"][0, 0]) % 3 for b in torch.utils.data.DataLoader(lt.Windows(12), batch_size=2)]
    assert {0, 1, 2} <= set(chosen[4:])  # after the warm-up: either head skipped in some steps, none in others
    rep = g.stats.partial
    assert "model" in rep.graphed and any(f"heads.{i}" in rep.graphed for i in (0, 1)) and rep.replays > 0
    assert rep.optimizer_eager_untouched > 0 and "steps eager: parameters without a gradient" in rep.summary()
    # the optimizer's graph replays in the steps that call both heads: the gradients set aside for a step are the
    # parameters' again after it
    assert rep.optimizer_replays > 0 and rep.optimizer_recaptures == 0
    lt.assert_same(g, e)


@pytest.mark.lightning_adapter
def test_lightning_partial_graphs_clip_without_the_gradients_a_step_did_not_give(monkeypatch):
    """The clipping's norm is taken over the gradients eager training has: a head not called in the step has none
    (its zeros would be more terms in the norm's sum), in the warm-up's eager steps too."""
    lt = _lightning()
    cls = _Branches.make(lt)
    seen = []
    clip = torch.nn.utils.clip_grad_norm_

    def spy(parameters, *args, **kwargs):
        params = list(parameters)
        seen.append(tuple(p.grad is None for p in params))
        return clip(params, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = _fit(lt, cls, True, {"scope": "modules", "nan_guard": False, "warmup_steps": 4}, steps=12,
                 gradient_clip_val=0.5)
    graphed, seen[:] = list(seen), []
    e = _fit(lt, cls, False, steps=12, gradient_clip_val=0.5)
    # a replay of the optimizer's graph clips without calling torch's function: those are steps calling both heads
    assert len(seen) == 12 and len(graphed) == 12 - g.stats.partial.optimizer_replays
    assert [s for s in graphed if any(s)] == [s for s in seen if any(s)]
    assert sum(any(step) for step in graphed[:4]) >= 2  # warm-up steps that leave a head without a gradient
    lt.assert_same(g, e)


@pytest.mark.lightning_adapter
@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("optimizer", ["sgd", "fused_adamw"])
def test_lightning_partial_graphs_clip_and_follow_the_schedule_inside_the_optimizer_graph(algorithm, optimizer,
                                                                                         monkeypatch):
    """Lightning's clipping (by norm, by value) and a per-step LR schedule with the optimizer side as one graph: the
    clipping runs in the graph (Python clips in the eager steps and the capture only), the learning rate the graph
    reads follows the schedule (SGD: a device lr; the fused AdamW: its kernel argument, set before each replay), and
    training equals eager."""
    lt = _lightning()
    cls = _GuardedGPT.make(lt)

    def make():
        return cls(sgd=optimizer == "sgd",
                   sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 6)))

    calls = []
    name = "clip_grad_norm_" if algorithm == "norm" else "clip_grad_value_"
    orig = getattr(torch.nn.utils, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return orig(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, name, counting)
    clip = {"gradient_clip_val": 0.05 if algorithm == "norm" else 1e-4, "gradient_clip_algorithm": algorithm}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = _fit(lt, make, True, {"scope": "modules", "nan_guard": False}, steps=12, **clip)
    graphed_calls = len(calls)
    e = _fit(lt, make, False, steps=12, **clip)
    lt.assert_same(g, e)
    assert g.rec.lrs == e.rec.lrs and len(set(g.rec.lrs)) > 3
    rep = g.stats.partial
    assert rep.optimizer.startswith("graphed") and rep.optimizer_captures == 1 and rep.optimizer_replays >= 6
    assert graphed_calls == 12 - rep.optimizer_replays and len(calls) - graphed_calls == 12
    unclipped = _fit(lt, make, False, steps=12)
    assert unclipped.rec.losses != e.rec.losses  # the clipping changes this training


@pytest.mark.lightning_adapter
def test_lightning_partial_graphs_recapture_the_optimizer_graph_when_a_baked_hyperparameter_changes():
    """SGD's momentum is a Python float the optimizer graph bakes in: changed by the user between steps, the graph is
    dropped and captured again with the new value, and training equals eager."""
    import lightning.pytorch as pl

    lt = _lightning()
    cls = _GuardedGPT.make(lt)

    class Momentum(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 7:
                for g in trainer.optimizers[0].param_groups:
                    g["momentum"] = 0.5

    def make():
        return cls(sgd=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = _fit(lt, make, True, {"scope": "modules", "nan_guard": False}, steps=12, callbacks=[Momentum()])
    e = _fit(lt, make, False, steps=12, callbacks=[Momentum()])
    lt.assert_same(g, e)
    assert g.stats.partial.optimizer_captures == 2


@pytest.mark.lightning_adapter
def test_lightning_partial_graphs_resume_from_a_checkpoint_as_eager_training_does(tmp_path):
    """A checkpoint of an eager run, resumed with partial graphs and a schedule: the resumed optimizer state and
    learning rate reach the module graphs and the optimizer graph, and training equals the eager resume."""
    lt = _lightning()
    cls = _GuardedGPT.make(lt)

    def make():
        return cls(sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9 ** s))

    first = _fit(lt, make, False, steps=5)
    path = tmp_path / "five.ckpt"
    first.trainer.save_checkpoint(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = _fit(lt, make, True, {"scope": "modules", "nan_guard": False}, steps=14, ckpt_path=str(path))
    e = _fit(lt, make, False, steps=14, ckpt_path=str(path))
    lt.assert_same(g, e)
    assert g.rec.lrs == e.rec.lrs and len(g.rec.losses) == 9
    rep = g.stats.partial
    assert rep.replays > 0 and rep.optimizer_replays > 0


@pytest.mark.lightning_adapter
def test_lightning_partial_graphs_keep_the_optimizer_graph_across_validation():
    """Lightning sets the gradients to None before validation; the optimizer graph's gradients are given back, so it
    replays after validation without a re-capture."""
    lt = _lightning()
    cls = _GuardedGPT.make(lt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = _fit(lt, cls, True, {"scope": "modules", "nan_guard": False}, steps=12, val_every=4)
    e = _fit(lt, cls, False, steps=12, val_every=4)
    lt.assert_same(g, e)
    assert g.rec.val == e.rec.val and len(g.rec.val) >= 2
    rep = g.stats.partial
    assert rep.optimizer_captures == 1 and rep.optimizer_recaptures == 0 and rep.optimizer_replays >= 6


@pytest.mark.lightning_adapter
def test_lightning_partial_graphs_accumulate_gradients_inside_the_graphs_across_batches_and_validation():
    """``accumulate_grad_batches=2`` (the second backward of a window adds into a non-zero gradient) and a
    validation every 4 steps (Lightning sets the gradients to None before it, the callback gives the same tensors
    back after it): the backward graphs add the gradients into ``.grad`` themselves, and training equals eager bit
    for bit."""
    lt = _lightning()
    cls = _GuardedGPT.make(lt)
    kw = {"steps": 12, "val_every": 4, "accumulate_grad_batches": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = _fit(lt, cls, True, {"scope": "modules", "nan_guard": False}, **kw)
    e = _fit(lt, cls, False, **kw)
    lt.assert_same(g, e)
    assert g.rec.val == e.rec.val and len(g.rec.val) >= 2
    rep = g.stats.partial
    assert rep.grads_in_graphs == sum(1 for _ in g.module.parameters()) - 1 and rep.replays > 0
    assert "accumulated inside graphs (1 by autograd: model.emb.tok.weight)" in g.stats.summary()


@pytest.mark.lightning_adapter
def test_lightning_partial_graphs_follow_module_state_changes_every_step():
    """A submodule put in eval() and back every other step: each change re-captures the modules' graphs (the
    whole-step tier refuses a state changed this often, counting its own replays; the partial tier follows it)."""
    import lightning.pytorch as pl

    lt = _lightning()
    cls = _GuardedGPT.make(lt)

    class Flip(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx >= 4 and batch_idx % 2 == 0:
                pl_module.model.blocks[0].train(batch_idx % 4 == 2)

    kw = {"dropout": 0.1}

    def make():
        return cls(**kw)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = _fit(lt, make, True, {"scope": "modules", "nan_guard": False}, steps=14, callbacks=[Flip()])
    e = _fit(lt, make, False, steps=14, callbacks=[Flip()])
    lt.assert_same(g, e)
    assert g.stats.recaptures > 0 and g.stats.partial.graphed == ["model"]


# ----------------------------------------------------------------------------------------------------------------------
# verify_steps in the partial tier
# ----------------------------------------------------------------------------------------------------------------------
def _tier_record(run):
    """What the tier found and counted (the islands' host times aside: they are timings)."""
    rec = dataclasses.asdict(run.stats.partial)
    rec.pop("island_host_ms")
    return rec, dict(run.stats.eager_reasons), run.stats.replays


class _OwnSteps:
    """A Lightning callback counting the optimizer steps that run torch's own ``step`` (the instance's attribute given
    back: no step of the plugin's in front of it)."""

    @staticmethod
    def make():
        import lightning.pytorch as pl

        class OwnSteps(pl.Callback):
            def __init__(self):
                self.count = 0

            def on_train_start(self, trainer, pl_module):
                def hook(opt, args, kwargs):
                    self.count += "step" not in opt.__dict__

                trainer.optimizers[0].register_step_pre_hook(hook)

        return OwnSteps()


@pytest.mark.lightning_adapter
def test_lightning_partial_graphs_verify_steps_leave_training_as_an_unverified_run_and_eager():
    """``verify_steps=3`` with partial graphs around an island (a host read): three steps whose graphs all replay are
    also run eagerly (the modules' own forwards, torch's own AdamW step: the user's step, as for whole steps) from the
    same state, undone, and compared; training, Lightning's counters and everything the tier found and counted are
    those of the unverified run, and training equals eager bit for bit."""
    lt = _lightning()
    cls = _GuardedGPT.make(lt)
    own_v, own_g = _OwnSteps.make(), _OwnSteps.make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v = _fit(lt, cls, True, {"scope": "modules", "verify_steps": 3}, steps=12, callbacks=[own_v])
        g = _fit(lt, cls, True, {"scope": "modules"}, steps=12, callbacks=[own_g])
    e = _fit(lt, cls, False, steps=12)
    assert v.stats.verified_steps == 3 and g.stats.verified_steps == 0
    lt.assert_same(v, g)
    lt.assert_same(v, e)
    assert v.progress == e.progress and v.metrics == e.metrics
    assert _tier_record(v) == _tier_record(g)
    rep = v.stats.partial
    assert rep.graphed == ["model"] and list(rep.islands) == ["guard"] and rep.replays > 0
    assert rep.optimizer_captures == 1 and rep.ops_outside is not None
    # the eager halves ran torch's own step (the user's, not the captured update): the 3 verified steps' and that of
    # the step before them, which then captured (the optimizer's graph) and is not counted
    assert (own_v.count, own_g.count) == (4, 0)


@pytest.mark.lightning_adapter
@pytest.mark.parametrize("where", ["module", "optimizer"])
def test_lightning_partial_graphs_verify_steps_raise_parity_error_when_a_graph_differs_from_eager(where):
    """A Python value a graph froze at capture: a counter read in a graphed module's forward (the loss differs), or
    in an optimizer step post-hook captured in the optimizer's graph (only one parameter differs). The eager half of
    the first verified step runs the live value, and ``ParityError`` names the step and what differs."""
    import lightning.pytorch as pl

    lt = _lightning()
    base = _GuardedGPT.make(lt)

    class Drift(nn.Module):
        """Scales by a counter its forward advances: a graph keeps the capture's value."""

        def __init__(self):
            super().__init__()
            self._calls = 0

        def forward(self, x):
            self._calls += 1
            return x * (1 + self._calls * 2.0**-8)

    class Drifting(base):
        def __init__(self):
            super().__init__()
            self.drift = Drift() if where == "module" else nn.Identity()

        def forward(self, ids):
            return self.guard(self.drift(self.model(ids)))

    class BiasHook(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            bias, calls = pl_module.model.ln_f.bias, [0]

            def hook(opt, args, kwargs):
                calls[0] += 1
                with torch.no_grad():
                    bias.add_(calls[0] * 2.0**-12)

            trainer.optimizers[0].register_step_post_hook(hook)

    callbacks = [BiasHook()] if where == "optimizer" else []
    # the module: the loss, the gradients, then the first parameter; the optimizer's hook: that parameter only
    problem = (r":\n  loss: graph (.|\n)*\n  parameter 'model\.emb\.tok\.weight' after the step" if where == "module"
               else r":\n  parameter 'model\.ln_f\.bias' after the step: max \|graph - eager\| = ")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(lt, Drifting, True, {"scope": "modules", "nan_guard": False}, steps=12, callbacks=callbacks)  # trains
        with pytest.raises(ParityError, match=r"the step with partial graphs \(batch \d+ since fit start\) differs "
                                              r"from the same step run eagerly \(verified step 1, rtol=0\.0\)"
                                              + problem):
            _fit(lt, Drifting, True, {"scope": "modules", "nan_guard": False, "verify_steps": 2}, steps=12,
                 callbacks=callbacks)


@pytest.mark.lightning_adapter
def test_lightning_auto_verifies_the_partial_tier_after_the_hand_over():
    """``scope="auto"`` on a step that does not capture whole: the whole step's capture fails, the partial tier takes
    over, and its first steps whose graphs all replay are the verified ones; training equals eager."""
    lt = _lightning()
    cls = _GuardedGPT.make(lt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v = _fit(lt, cls, True, {"scope": "auto", "verify_steps": 3}, steps=12)
        g = _fit(lt, cls, True, {"scope": "auto"}, steps=12)
    e = _fit(lt, cls, False, steps=12)
    assert v.stats.verified_steps == 3 and v.stats.replays == 0 and v.stats.captures == 0
    assert v.stats.partial is not None and v.stats.partial.replays > 0 and v.cb.eager_reason is None
    lt.assert_same(v, g)
    lt.assert_same(v, e)
    assert _tier_record(v) == _tier_record(g)


@pytest.mark.lightning_adapter
def test_lightning_auto_verifies_the_partial_tier_anew_after_verified_whole_steps():
    """A late hand-over: whole steps capture, replay and are verified (``verify_steps=2``) until shorter sequences,
    for which the model reads the host, do not capture; the partial tier's graphs are new, and its first two steps
    whose graphs all replay are verified too. Training equals eager."""
    lt = _lightning()
    guarded = _GuardedGPT.make(lt)

    class ShortGuarded(guarded):
        def forward(self, ids):
            logits = self.model(ids)
            return logits if ids.shape[1] == 32 else self.guard(logits)

    kw = {"steps": 16, "lengths": (32,) * 6 + (16,) * 10}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v = _fit(lt, ShortGuarded, True, {"scope": "auto", "verify_steps": 2}, **kw)
    e = _fit(lt, ShortGuarded, False, **kw)
    lt.assert_same(v, e)
    # whole steps: warm-up 0-2, capture 3, replays 4-5 (verified); the partial tier from step 7 on
    assert (v.stats.captures, v.stats.replays, v.stats.verified_steps) == (1, 2, 4)
    assert v.stats.partial.graphed == ["model"] and v.stats.partial.replays > 0


@pytest.mark.lightning_adapter
def test_lightning_partial_graphs_verify_steps_with_gradient_accumulation():
    """``accumulate_grad_batches=2``: verified micro-batches that only accumulate (the eager half adds into the
    window's gradients, which are put back: the same tensors, their values) and ones that step; training equals the
    unverified run and eager."""
    lt = _lightning()
    cls = _GuardedGPT.make(lt)
    kw = {"steps": 8, "accumulate_grad_batches": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v = _fit(lt, cls, True, {"scope": "modules", "nan_guard": False, "verify_steps": 4}, **kw)
        g = _fit(lt, cls, True, {"scope": "modules", "nan_guard": False}, **kw)
    e = _fit(lt, cls, False, **kw)
    assert v.stats.verified_steps == 4
    lt.assert_same(v, g)
    lt.assert_same(v, e)
    assert _tier_record(v) == _tier_record(g)
    assert v.stats.partial.grads_in_graphs == g.stats.partial.grads_in_graphs > 0


@pytest.mark.lightning_adapter
def test_lightning_scope_step_still_refuses_the_host_read():
    lt = _lightning()
    with pytest.raises(CaptureError, match="HOST-READ|host synchronisation"):
        _fit(lt, _GuardedGPT.make(lt), True, {"nan_guard": False, "scope": "step"})


@pytest.mark.lightning_adapter
def test_lightning_auto_keeps_whole_step_graphs_where_the_step_captures():
    lt = _lightning()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = _fit(lt, lt.TinyGPT, True, {"scope": "auto", "nan_guard": False})
    assert g.stats.partial is None and g.stats.replays > 0


class HostCheck(nn.Module):
    """A user's module around a decoder layer that asks the host about the hidden states."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, *args, **kwargs):
        if hidden_states.abs().max() > 100:  # LLAMA-READ
            hidden_states = hidden_states.clamp(-100, 100)
        return self.inner(hidden_states, *args, **kwargs)


def guard_layer(model):
    """Put a :class:`HostCheck` around decoder layer 1 of an HF causal LM."""
    model.model.layers[1] = HostCheck(model.model.layers[1])


def guard_mlp(model):
    """Put a :class:`HostCheck` around the MLP of decoder layer 1: the island splits the layer's residual stream."""
    layer = model.model.layers[1]
    layer.mlp = HostCheck(layer.mlp)


@pytest.mark.lightning_adapter
def test_hf_llama_with_a_host_reading_module_graphs_everything_else():
    hf = pytest.importorskip("test_hf_cpu")
    eager_module, eager, _ = hf.fit(hf.llama(), graphed=False, prepare=guard_layer)
    module, graphed, cb = hf.fit(hf.llama(), graphed=True, cb_kw={"scope": "modules"}, prepare=guard_layer)
    assert graphed == eager
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), eager_module.parameters()))
    rep = cb.stats.partial
    # the model failed (the check is inside it): its embedding, layer 0, the layer inside the check, the final norm,
    # the rotary embedding and the head are graphs; the check is the one island (the model's failure is its line)
    assert rep.graphed == ["model.model.embed_tokens", "model.model.layers.0", "model.model.layers.1.inner",
                           "model.model.norm", "model.model.rotary_emb", "model.lm_head"]
    assert list(rep.islands) == ["model.model.layers.1"]
    assert rep.islands["model.model.layers.1"].startswith(
        "its own code (not its submodules): " + _line(HostCheck.forward, "LLAMA-READ") + ": a host synchronisation")
    assert rep.replays > 0 and rep.modules_graphed == rep.modules_called - 3  # the CausalLM, its model, the check
    assert rep.grads_in_graphs == sum(1 for _ in module.parameters()) and not rep.grads_outside  # no tied weight


def _guard_graph_safe(model):  # the eager reference: the attention the callback switches to (its code compiles too)
    guard_layer(model)
    pytest.importorskip("test_hf_cpu").graph_safe_attention(model)


def _fresh_dynamo() -> int:
    """Dynamo's caches and counters emptied; returns how many graphs it had compiled."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return graphs


def _compiled_runs(module, backend) -> int:
    """How many times one more call of the user's compiled model ran its compiled code (0: dynamo runs it eagerly)."""
    before = backend.runs
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        module.model(input_ids=ids, use_cache=False)
    return backend.runs - before


def _compiled_both(make, data):
    """The tier's run and the eager reference of the model ``make(backend)`` compiles with a stand-in backend of its
    own (dynamo's caches emptied before each): ``(graphed, eager, backend, eager_backend, warnings' texts)``."""
    eager_backend, backend = CompiledCalls(), CompiledCalls()
    _fresh_dynamo()
    e = train(lambda: make(eager_backend), data, False)
    _fresh_dynamo()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        g = train(lambda: make(backend), data, True)
    return g, e, backend, eager_backend, [str(w.message) for w in seen]


@pytest.mark.lightning_adapter
@pytest.mark.parametrize("host_read", [False, True])
def test_a_compiled_model_is_one_graphed_module_and_its_host_read_splits_it_open(host_read):
    """``torch.compile(model)``: the compiled call is one module of the tier (its compiled code runs inside the graph,
    its submodules are not visited). A host read in the compiled code splits it open: its submodules are compiled one
    by one and graphed as in an uncompiled model, down to the module whose own code reads the host, the island at the
    user's line. The compiled code runs in every step the tier counts (the operator counter does not make dynamo fall
    back to eager), nothing compiles inside a capture, and after fit the user's compiled call is given back and runs
    compiled."""
    hf = pytest.importorskip("test_hf_cpu")
    eager_backend, backend = CompiledCalls(), CompiledCalls()
    _fresh_dynamo()  # a frame dynamo skipped earlier in this process would stay uncompiled
    eager_module, eager, _ = hf.fit(hf.llama(), graphed=False, compile_kw={"backend": eager_backend},
                                    prepare=_guard_graph_safe if host_read else hf.graph_safe_attention)
    eager_graphs = _fresh_dynamo()  # the second model's own compiles (dynamo's recompile limit counts per code object)
    module, graphed, cb = hf.fit(hf.llama(), graphed=True, cb_kw={"scope": "modules"},
                                 compile_kw={"backend": backend}, prepare=guard_layer if host_read else None)
    assert graphed == eager
    # the warm-up calls compiled for the state the captures run in: nothing was compiled inside a capture
    assert backend.in_capture == 0
    compiled_graphs = _fresh_dynamo()
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), eager_module.parameters()))
    rep = cb.stats.partial
    if host_read:
        # as without torch.compile (test_hf_llama_with_a_host_reading_module_graphs_everything_else), each compiled
        assert rep.graphed == ["model.model.embed_tokens", "model.model.layers.0", "model.model.layers.1.inner",
                               "model.model.norm", "model.model.rotary_emb", "model.lm_head"]
        assert list(rep.islands) == ["model.model.layers.1"]
        assert rep.islands["model.model.layers.1"].startswith(
            "its own code (not its submodules): " + _line(HostCheck.forward, "LLAMA-READ") + ": a host synchronisation")
        assert rep.compiled_apart == ["model", "model.model", "model.model.layers.1"]
        assert rep.replays > 0 and rep.grads_in_graphs == sum(1 for _ in module.parameters())
        # the submodules ran their own compiles: more graphs than the user's run, which compiles the model whole
        assert backend.compiles > eager_backend.compiles and compiled_graphs > eager_graphs
        assert not [n for n, m in module.model._orig_mod.named_modules() if "forward" in m.__dict__]
    else:
        assert compiled_graphs == eager_graphs
        assert rep.graphed == ["model"] and rep.islands == {} and rep.replays > 0
        assert rep.grads_in_graphs == sum(1 for _ in module.parameters())
        # the warm-up steps (the counted one among them) and the capture ran the compiled code; replays are the tape's
        assert backend.runs == 3 + 1, backend.runs
    assert _compiled_runs(module, backend) >= 1
    _fresh_dynamo()
    forward = module.model.__dict__["forward"]  # torch.compile's own, not the tier's wrapper
    assert "PartialGraphs" not in forward.__qualname__ and not hasattr(forward, "__self__")


def test_compiled_code_reading_the_host_is_split_open_once_with_one_warning_and_given_back():
    """A compiled model whose compiled code reads the host: its submodules are compiled alone and graphed, bitwise as
    the user's compiled model trains (dropout's draws included); one warning names the module and the line; close()
    gives the user's compiled call back, and every submodule its own forward."""
    g, e, backend, eager_backend, seen = _compiled_both(lambda b: torch.compile(Net(), backend=b), batches(8))
    assert_bitwise(g, e)
    tier, model = g[3], g[4]
    rep = tier.report
    assert rep.graphed == ["inp", "b0", "b1", "out"] and list(rep.islands) == ["guard"]
    assert rep.islands["guard"].startswith(_line(Guard.forward, "HOST-READ") + ": a host synchronisation")
    assert rep.compiled_apart == [""]  # the guard has no submodule: it stays compiled, an island
    assert "compiled apart (their compiled code not one graph): <root>;" in rep.summary()
    said = [w for w in seen if "its compiled code cannot be one graph" in w]
    assert len(said) == 1 and said[0].startswith(
        "module '<root>' is compiled with torch.compile and its compiled code cannot be one graph ("
        + _line(Guard.forward, "HOST-READ")), said
    assert backend.in_capture == 0 and backend.compiles > eager_backend.compiles
    own = model.__dict__["forward"]
    tier.close()
    assert model.__dict__["forward"] is own.__wrapped__.__wrapped__  # torch.compile's own call
    assert not any("forward" in m.__dict__ for m in model._orig_mod.modules())
    before = backend.runs
    model(torch.randn(5, 4))
    assert backend.runs > before  # the user's compiled model runs its compiled code again
    _fresh_dynamo()


@pytest.mark.parametrize("dense_view", [False, True])
@pytest.mark.parametrize("compiled", ["model", "child"])
def test_a_compiled_module_given_a_view_compiles_before_its_capture(compiled, dense_view):
    """A compiled module's capture reads its own copy of an input that is a view (position ids, masks: dense where
    the view is broadcast, and no view; dynamo guards on both): its eager calls before the capture get the same, so
    dynamo compiles for what the capture runs, outside the capture (on CUDA, Inductor's first run of new kernels
    inside a capture fails it)."""
    def make(backend):
        if compiled == "model":  # split open: the child is compiled alone
            return torch.compile(Expanding(dense_view), backend=backend)
        net = Expanding(dense_view)
        net.inner = torch.compile(net.inner, backend=backend)
        return net

    # a new row count: dynamo recompiles with dynamic shapes, guarding the views' bases
    g, e, backend, _, _ = _compiled_both(make, batches(10, rows=(5, 5, 5, 5, 7)))
    assert_bitwise(g, e)
    assert g[3].report.graphed == ["inner"] and list(g[3].report.islands) == [""]
    assert backend.in_capture == 0
    _fresh_dynamo()


@pytest.mark.lightning_adapter
def test_a_compiled_gpt2_reading_the_host_is_split_open_without_compiling_inside_a_capture():
    """HF GPT-2 compiled whole, a host check around block 1: split open as Llama is. Its position embedding gets a
    view of the position ids, which dynamo guards once it compiles the two embeddings with dynamic shapes: compiled
    before the capture, for the capture's copy."""
    hf = pytest.importorskip("test_hf_cpu")
    from hf_models import gpt2

    def guard_block(model):
        model.transformer.h[1] = HostCheck(model.transformer.h[1])

    def guard_block_graph_safe(model):
        guard_block(model)
        hf.graph_safe_attention(model)

    eager_backend, backend = CompiledCalls(), CompiledCalls()
    _fresh_dynamo()
    eager_module, eager, _ = hf.fit(gpt2(), graphed=False, compile_kw={"backend": eager_backend},
                                    prepare=guard_block_graph_safe)
    _fresh_dynamo()
    module, graphed, cb = hf.fit(gpt2(), graphed=True, cb_kw={"scope": "modules"}, compile_kw={"backend": backend},
                                 prepare=guard_block)
    assert graphed == eager
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), eager_module.parameters()))
    rep = cb.stats.partial
    assert rep.graphed == ["model.transformer.wte", "model.transformer.wpe", "model.transformer.drop",
                           "model.transformer.h.0", "model.transformer.h.1.inner", "model.transformer.ln_f",
                           "model.lm_head"], rep.graphed
    assert list(rep.islands) == ["model.transformer.h.1"]
    assert rep.compiled_apart == ["model", "model.transformer", "model.transformer.h.1"]
    assert backend.in_capture == 0
    _fresh_dynamo()


@pytest.mark.lightning_adapter
def test_a_compiled_submodule_reading_the_host_is_split_open_inside_an_uncompiled_model():
    """The user compiles only the check around decoder layer 1: the rest of the model is graphed as written, the
    check is split open and the layer inside it compiled alone and graphed."""
    hf = pytest.importorskip("test_hf_cpu")
    eager_backend, backend = CompiledCalls(), CompiledCalls()

    def compiled_check(b):
        def prepare(model):
            guard_layer(model)
            model.model.layers[1] = torch.compile(model.model.layers[1], backend=b)
        return prepare

    _fresh_dynamo()
    eager_module, eager, _ = hf.fit(hf.llama(), graphed=False, prepare=compiled_check(eager_backend))
    _fresh_dynamo()
    module, graphed, cb = hf.fit(hf.llama(), graphed=True, cb_kw={"scope": "modules"},
                                 prepare=compiled_check(backend))
    assert graphed == eager
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), eager_module.parameters()))
    rep = cb.stats.partial
    assert rep.graphed == ["model.model.embed_tokens", "model.model.layers.0", "model.model.layers.1.inner",
                           "model.model.norm", "model.model.rotary_emb", "model.lm_head"]
    assert list(rep.islands) == ["model.model.layers.1"] and rep.compiled_apart == ["model.model.layers.1"]
    assert backend.in_capture == 0 and backend.compiles > eager_backend.compiles
    _fresh_dynamo()


def test_compiled_code_reading_the_host_stays_one_island_where_nothing_can_compile_its_submodules(monkeypatch):
    """A torch whose compiled wrapper keeps no dynamo context to compile with: the compiled module is one island at
    the user's line, run compiled as the user's code every step, nothing split open and nothing warned."""
    import nemo_cudagraph_plugin.core.partial as partial

    monkeypatch.setattr(partial, "compiler_of", lambda module: None)
    g, e, backend, eager_backend, seen = _compiled_both(lambda b: torch.compile(Net(), backend=b), batches(6))
    assert_bitwise(g, e)
    rep = g[3].report
    assert rep.graphed == [] and list(rep.islands) == [""] and rep.compiled_apart == []
    assert rep.islands[""].startswith(_line(Guard.forward, "HOST-READ") + ": a host synchronisation")
    assert not [w for w in seen if "its compiled code cannot be one graph" in w]
    assert backend.runs >= eager_backend.runs > 0  # every step's call ran compiled (the failed capture's too)
    assert not any("forward" in m.__dict__ for m in g[4]._orig_mod.modules())
    _fresh_dynamo()


def test_compiled_code_whose_backward_reads_the_host_is_split_open_after_its_eager_gradients():
    """The compiled model's forward captures, its backward does not (a host read in a custom backward that dynamo
    leaves eager): that step's gradients come eagerly, and the model is split open, then the block whose backward
    reads the host. Submodules opened in a backward are counted over the next step, once: nothing is split twice."""
    def make(backend):
        net = Net(guard=False)
        net.b1 = ClipBlock()
        return torch.compile(net, backend=backend)

    g, e, backend, _, seen = _compiled_both(make, batches(8))
    assert_bitwise(g, e)
    rep = g[3].report
    assert rep.graphed == ["inp", "b0", "guard", "b1.fc", "b1.act", "b1.drop", "out"]  # as without torch.compile
    assert list(rep.islands) == ["b1"]
    assert _line(_ClipGrad.backward, "BACKWARD-READ") + ": a host synchronisation" in rep.islands["b1"]
    assert rep.compiled_apart == ["", "b1"]
    assert sum("its compiled code cannot be one graph" in w for w in seen) == 1
    assert backend.in_capture == 0
    _fresh_dynamo()


@pytest.mark.lightning_adapter
def test_a_compiled_model_stays_compiled_through_the_verified_steps():
    """``verify_steps`` runs each verified step once more eagerly under a recorder of its writes: the user's compiled
    model runs its compiled code there too (the step it checks against the graph), and after fit."""
    hf = pytest.importorskip("test_hf_cpu")
    _fresh_dynamo()
    backend = CompiledCalls()
    module, graphed, cb = hf.fit(hf.llama(), graphed=True, cb_kw={"verify_steps": 2}, compile_kw={"backend": backend})
    assert cb.stats.replays > 0 and cb.stats.verified_steps == 2, cb.stats.summary()
    # 3 warm-up steps, the capture, and the two verified steps' eager runs
    assert backend.runs == 3 + 1 + 2, backend.runs
    assert _compiled_runs(module, backend) == 1
    _fresh_dynamo()


@pytest.mark.lightning_adapter
def test_a_compiled_model_split_open_is_verified_and_trains_as_the_users_compiled_model(monkeypatch):
    """``verify_steps`` on a compiled model whose compiled code reads the host (the default ``scope="auto"``: the
    whole step refused, the partial tier takes over and splits the model open): the verified steps replay the
    submodules' graphs and their eager half runs the same compiled submodules; losses equal the user's run."""
    hf = pytest.importorskip("test_hf_cpu")
    monkeypatch.setattr(hf, "STEPS", 14)  # discovery goes one level of the model per step
    _fresh_dynamo()
    eager_module, eager, _ = hf.fit(hf.llama(), graphed=False, compile_kw={"backend": CompiledCalls()},
                                    prepare=_guard_graph_safe)
    _fresh_dynamo()
    backend = CompiledCalls()
    module, graphed, cb = hf.fit(hf.llama(), graphed=True, cb_kw={"verify_steps": 2}, compile_kw={"backend": backend},
                                 prepare=guard_layer)
    assert cb.stats.verified_steps == 2 and cb.stats.partial.replays > 0, cb.stats.summary()
    assert cb.stats.partial.compiled_apart == ["model", "model.model", "model.model.layers.1"]
    assert backend.in_capture == 0
    assert graphed == eager
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), eager_module.parameters()))
    _fresh_dynamo()


@pytest.mark.lightning_adapter
def test_before_torch_2_9_a_step_with_a_compiled_module_is_not_counted(monkeypatch):
    """torch before 2.9 runs compiled code uncompiled under any dispatch mode: the tier leaves the operator count out
    (coverage unmeasured) rather than run the user's compiled model uncompiled from the counted step on."""
    monkeypatch.setattr(_torch_compat, "_COMPILED_RUNS_UNDER_MODES", False)
    hf = pytest.importorskip("test_hf_cpu")
    _fresh_dynamo()
    module, graphed, cb = hf.fit(hf.llama(), graphed=True, cb_kw={"scope": "modules"},
                                 compile_kw={"backend": CompiledCalls()})
    rep = cb.stats.partial
    assert rep.graphed == ["model"] and rep.ops_step == 0 and rep.op_coverage is None, rep
    _fresh_dynamo()
    module, graphed, cb = hf.fit(hf.llama(), graphed=True, cb_kw={"scope": "modules"})  # nothing compiled: counted
    assert cb.stats.partial.op_coverage is not None


@pytest.mark.lightning_adapter
def test_before_torch_2_9_verify_steps_with_a_compiled_model_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(_torch_compat, "_COMPILED_RUNS_UNDER_MODES", False)
    hf = pytest.importorskip("test_hf_cpu")
    _fresh_dynamo()
    with pytest.raises(CaptureError, match=r"CudaGraphCallback\(verify_steps=2\) runs each verified step once more .*"
                                           r"runs HFCausalLM\.model, compiled with torch\.compile, uncompiled under it "
                                           r"and from then on\. Use verify_steps=0, or torch >= 2\.9"):
        hf.fit(hf.llama(), graphed=True, cb_kw={"verify_steps": 2}, compile_kw={"backend": CompiledCalls()})
    _fresh_dynamo()


@pytest.mark.lightning_adapter
def test_an_island_inside_a_residual_block_changes_only_the_order_of_one_gradient_sum():
    """The MLP's check splits layer 1: the residual stream's gradient there is a sum of the skip connection's part
    and the graphed norm's two parts, which the norm's backward graph adds first. The same numbers added in another
    order: the last bits may differ (no ulp-exact claim where an island splits a tensor's uses)."""
    hf = pytest.importorskip("test_hf_cpu")
    _, eager, _ = hf.fit(hf.llama(), graphed=False, prepare=guard_mlp)
    _, graphed, cb = hf.fit(hf.llama(), graphed=True, cb_kw={"scope": "modules"}, prepare=guard_mlp)
    assert list(cb.stats.partial.islands) == ["model.model.layers.1.mlp"]
    assert "model.model.layers.1.mlp.inner" in cb.stats.partial.graphed
    assert graphed == pytest.approx(eager, rel=1e-6)


@pytest.mark.lightning_adapter
def test_packed_sequences_train_with_partial_graphs_around_hfs_packing_question():
    """Two documents per row, ``position_ids`` restarting at each (packed sequences, no mask): transformers 5 asks
    the host where the documents start while it builds the mask, in the model's own code. That code is the island; the
    embedding, every decoder layer, the norm, the rotary embedding and the head are graphs, and training equals eager."""
    hf = pytest.importorskip("test_hf_cpu")
    if not hf.TF5:
        pytest.skip("transformers 5's mask code")
    from hf_models import HFCausalLM

    class Packed(HFCausalLM):
        def training_step(self, batch, batch_idx):
            ids = batch["input_ids"]
            half = ids.shape[1] // 2
            pos = torch.cat([torch.arange(half), torch.arange(ids.shape[1] - half)]).expand_as(ids)
            return self.model(input_ids=ids, labels=batch["labels"], position_ids=pos, use_cache=False).loss

    def fit(graphed, cb_kw=None):
        import lightning.pytorch as pl
        from torch.utils.data import DataLoader

        pl.seed_everything(0, verbose=False)
        module = Packed(hf.llama())
        rec = hf.Losses()
        cbs = [rec]
        cb = None
        if graphed:
            cb = CudaGraphCallback(**cb_kw)
            cb.step_runner.backend = TapeBackend()
            cbs.insert(0, cb)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=hf.STEPS, callbacks=cbs, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(hf.TokenBatches(hf.STEPS), batch_size=None))
        return module, rec.losses, cb

    eager_module, eager, _ = fit(False)
    module, graphed, cb = fit(True, {"scope": "modules"})
    assert graphed == eager
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), eager_module.parameters()))
    rep = cb.stats.partial
    assert "model.model.embed_tokens" in rep.graphed and "model.lm_head" in rep.graphed
    assert all(f"model.model.layers.{i}" in rep.graphed for i in range(len(module.model.model.layers)))
    assert list(rep.islands) == ["model.model"]
    assert "masking_utils.py:" in rep.islands["model.model"].replace("\\", "/")
    assert rep.optimizer.startswith("graphed")


@pytest.mark.lightning_adapter
def test_mixtral_on_transformers_4_graphs_everything_but_its_routing():
    """transformers 4.57's Mixtral routes tokens with a host read per expert (no experts interface to switch): each
    sparse-MoE block is an island at that line, attention, norms, embedding, head and the experts are graphs, and the
    fused AdamW's own update is graphed. The island sits inside the decoder layer's residual stream, so the gradient
    of the hidden states there is the same numbers summed in another order (as in
    ``test_an_island_inside_a_residual_block_changes_only_the_order_of_one_gradient_sum``): losses and parameters
    agree to their last bits, not bit for bit."""
    hf = pytest.importorskip("test_hf_cpu")
    if hf.TF5:
        pytest.skip("transformers 4.x's Mixtral")
    eager_module, eager, _ = hf.fit(hf.mixtral(), graphed=False)
    module, graphed, cb = hf.fit(hf.mixtral(), graphed=True, cb_kw={"scope": "modules"})
    assert graphed == pytest.approx(eager, rel=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(module.parameters(), eager_module.parameters()))
    assert cb.stats.optimizer_math == ""
    rep = cb.stats.partial
    n = len(module.model.model.layers)
    islands = [f"model.model.layers.{i}.block_sparse_moe" for i in range(n)]
    assert sorted(rep.islands) == islands, rep.islands
    assert all("modeling_mixtral.py:" in rep.islands[k].replace("\\", "/") for k in islands)
    assert all(f"model.model.layers.{i}.self_attn" in rep.graphed for i in range(n))
    assert rep.optimizer.startswith("graphed")


@pytest.mark.lightning_adapter
def test_under_ddp_auto_keeps_whole_steps_and_refuses_as_scope_step_does(tmp_path):
    """Partial graphs are not proven under DDP: with CudaGraphStrategy('ddp') a step that does not capture whole is
    refused at its line, as with scope='step', not trained with partial graphs."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    from nemo_cudagraph_plugin import CudaGraphStrategy

    lt = _lightning()
    cls = _GuardedGPT.make(lt)
    pl.seed_everything(0, verbose=False)
    strategy = CudaGraphStrategy(DDPStrategy(process_group_backend="gloo"), scope="auto")  # >= 11 warm-up steps
    strategy.step_runner.backend = TapeBackend()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=16, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, default_root_dir=tmp_path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CaptureError, match="HOST-READ|host"):
                trainer.fit(cls(), train_dataloaders=DataLoader(lt.Windows(16), batch_size=2))
    finally:  # the fit's process group would stay for the tests after this one
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert strategy.step_runner.adapter is None or strategy.step_runner.adapter.partial is None


def test_zeroing_in_place_is_torchs_zero_grad_with_one_kernel_per_dtype(monkeypatch):
    from nemo_cudagraph_plugin.core._torch_compat import zero_grads_in_place

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    a, b = model(), model()
    for m in (a, b):
        m(torch.randn(3, 4)).sum().backward()
        m[0].bias.grad = m[0].bias.grad * torch.ones((), requires_grad=True)  # a gradient with a grad_fn
        m[2].bias.grad = None  # a parameter without one
    ref, opt = torch.optim.AdamW(a.parameters()), torch.optim.AdamW(b.parameters())
    calls = []
    real = torch._foreach_zero_
    monkeypatch.setattr(torch, "_foreach_zero_", lambda grads: (calls.append(len(grads)), real(grads)))
    ref.zero_grad(set_to_none=False)  # torch's own: a kernel per gradient for this optimizer (foreach unset)
    assert calls == []
    assert zero_grads_in_place(opt)
    assert calls == [3]  # one multi-tensor zero for the three float32 gradients
    for p, q in zip(a.parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad) and q.grad.grad_fn is None and not q.grad.requires_grad

    class Own(torch.optim.SGD):
        def zero_grad(self, set_to_none=True):
            pass

    assert not zero_grads_in_place(Own(b.parameters(), lr=0.1))  # a class's own zero_grad is left to it


@pytest.mark.lightning_adapter
def test_lightning_partial_graphs_zero_the_gradients_with_one_kernel(monkeypatch):
    """The partial tier zeroes the gradients in place every step (the optimizer graph reads them where it left them):
    one multi-tensor zero per step, not a kernel per parameter outside the graphs."""
    lt = _lightning()
    cls = _GuardedGPT.make(lt)
    calls = []
    real = torch._foreach_zero_
    monkeypatch.setattr(torch, "_foreach_zero_", lambda grads: (calls.append(len(grads)), real(grads)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # SGD with foreach unset: torch's own zero_grad(set_to_none=False) would launch a kernel per gradient
        g = _fit(lt, lambda: cls(sgd=True), True, {"scope": "modules", "nan_guard": False}, steps=10)
    n = sum(1 for p in g.module.parameters() if p.requires_grad)
    assert g.stats.partial.replays > 0 and calls.count(n) >= 8


class _Sleeper(nn.Module):
    """Reads the host and takes 30 ms of host time of its own."""

    def forward(self, x):
        if x.abs().max() > 1e6:  # SLEEPER-READ
            x = x * 0.5
        time.sleep(0.03)
        return x


class _SlowGlue(nn.Module):
    """Its own code reads the host and takes 5 ms; a child island takes 30 ms; two children capture."""

    def __init__(self):
        super().__init__()
        self.a, self.sleeper, self.b = Block(), _Sleeper(), Block()

    def forward(self, x):
        x = self.a(x)
        if bool((x > 50).any()):  # SLOW-GLUE-READ
            x = x * 0.5
        time.sleep(0.005)
        return self.b(self.sleeper(x))


def test_islands_report_the_host_time_of_their_own_code():
    g, e = both(lambda: nn.Sequential(nn.Linear(4, 8), _SlowGlue(), nn.Linear(8, 1)), batches(6))
    assert_bitwise(g, e)
    rep = g[3].report
    assert set(rep.islands) == {"1", "1.sleeper"}, rep.islands
    host = rep.island_host_ms
    assert 30 <= host["1.sleeper"] < 60, host
    assert 5 <= host["1"] < 20, host  # its own code: the child island's 30 ms are not counted here
    assert "1.sleeper (3" in g[3].stats.summary() and "ms/step on the host" in g[3].stats.summary()


@pytest.mark.lightning_adapter
@pytest.mark.parametrize("scope", ["modules", "auto"])
@pytest.mark.parametrize("optimizer", ["fused_adamw", "sgd", "capturable_math"])
def test_lightning_partial_graphs_use_the_lr_optimizer_step_assigns_in_that_step(scope, optimizer):
    """A learning rate the user's `optimizer_step` assigns before calling the optimizer (a hand-written schedule,
    a new value every step): the partial tier runs that hook eagerly, so its update, eager or replayed, reads the
    value assigned just before it, as eager training does. ``"auto"``: the whole step is refused for the host read
    and for this assignment alike, and the partial tier takes over."""
    lt = _lightning()
    cls = _GuardedGPT.make(lt)

    def make():
        return cls(sgd=optimizer == "sgd", lr_in_optimizer_step="cycle")

    cb_kw = {"scope": scope, "nan_guard": False}
    if optimizer == "capturable_math":
        cb_kw["optimizer_math"] = "capturable"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = _fit(lt, make, True, cb_kw, steps=12)
    e = _fit(lt, make, False, steps=12)
    lt.assert_same(g, e)
    rep = g.stats.partial
    assert rep is not None and rep.optimizer.startswith("graphed") and rep.optimizer_replays >= 5, g.stats.summary()


@pytest.mark.lightning_adapter
def test_lightning_auto_trains_an_lr_assigned_in_optimizer_step_with_partial_graphs():
    """No host read: only the assignment keeps the whole step from a graph. ``scope="auto"`` hands over to the
    partial tier (one warning naming the line), whose steps equal eager training."""
    lt = _lightning()

    def make():
        return lt.TinyGPT(lr_in_optimizer_step="cycle")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        g = _fit(lt, make, True, {"scope": "auto", "nan_guard": False}, steps=12)
    e = _fit(lt, make, False, steps=12)
    lt.assert_same(g, e)
    said = [str(w.message) for w in seen if "scope='auto'" in str(w.message)]
    assert len(said) == 1 and "LR-IN-STEP" not in said[0] and "param_groups[0]['lr']" in said[0], said
    rep = g.stats.partial  # nothing reads the host: the whole module's forward and backward is one graph
    assert rep is not None and rep.graphed == [""] and rep.optimizer_replays >= 5, g.stats.summary()


class _TEGuardedGPT:
    """_GuardedGPT with a TransformerEngine module (a stand-in: its class lives under ``transformer_engine``)."""

    @staticmethod
    def make(lt):
        te_linear = type("Linear", (nn.Linear,), {"__module__": "transformer_engine.pytorch.module.linear"})

        class TEGuardedGPT(_GuardedGPT.make(lt)):
            def __init__(self, **kw):
                super().__init__(**kw)
                self.te = te_linear(lt.CFG.vocab_size, lt.CFG.vocab_size)

            def forward(self, ids):
                return self.te(super().forward(ids))

        return TEGuardedGPT


@pytest.mark.lightning_adapter
def test_lightning_partial_graphs_are_refused_for_transformer_engine_models_and_auto_keeps_whole_steps():
    """TE's hazard checks (``is_first_microbatch``, delayed scaling) run on whole-step captures only: a model with TE
    modules gets no partial graphs. ``scope="modules"`` is refused naming the module; ``"auto"`` is ``"step"``, so a host
    read is refused at its line, as with ``"step"``."""
    lt = _lightning()
    cls = _TEGuardedGPT.make(lt)
    with pytest.raises(CaptureError, match=r"CudaGraphCallback\(scope='modules'\) is not supported with "
                                           r"TransformerEngine modules \(te: Linear\).*scope='step'"):
        _fit(lt, cls, True, {"scope": "modules", "nan_guard": False})
    with pytest.raises(CaptureError, match="HOST-READ|host synchronisation"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(lt, cls, True, {"nan_guard": False})  # the default, "auto"
