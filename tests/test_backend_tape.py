"""The CPU stand-in graph itself (tests/_tape.py): it must have the hazards a CUDA graph has, or the CPU tests
of the engine would pass for the wrong reason."""

from __future__ import annotations

import _tape
import pytest
import torch
from _tape import TapeBackend

cpu = torch.device("cpu")


def _captured(fn, backend=None, **kw):
    """Capture ``fn()`` on a tape; return (graph, output of the capture run)."""
    be = backend or TapeBackend(**kw)
    g = be.new_graph()
    with be.capture(g, be.pool(), be.side_stream(cpu)):
        out = fn()
    g.replay()  # the engine's replay right after capture: a no-op here (capture already ran the step)
    return g, out


def test_first_replay_after_capture_is_a_no_op_and_later_ones_rerun():
    x = torch.zeros(3)
    g, _ = _captured(lambda: x.add_(1))
    assert x.tolist() == [1, 1, 1] and g.replays == 0
    g.replay()
    g.replay()
    assert x.tolist() == [3, 3, 3] and g.replays == 2


def test_a_python_float_read_at_capture_stays_baked():
    state = {"lr": 0.5}
    w = torch.ones(2)
    g, _ = _captured(lambda: w.sub_(state["lr"]))
    state["lr"] = 0.25  # a replay runs no Python: still 0.5
    g.replay()
    assert w.tolist() == [0.0, 0.0]


def test_item_inside_capture_raises_like_cuda_or_is_baked():
    x = torch.tensor([2.0])
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        _captured(lambda: x * x.item())
    y = torch.zeros(1)
    g, _ = _captured(lambda: y.add_(x.item()), sync_in_capture="bake")
    x.fill_(5.0)
    g.replay()
    assert y.item() == 4.0, "the host value read at capture (2.0) is what every replay adds"


def test_reassigned_parameter_data_leaves_the_graph_on_the_old_memory():
    p = torch.nn.Parameter(torch.ones(4))
    old = p.data
    g, _ = _captured(lambda: p.data.mul_(2))
    p.data = p.data.clone()  # a new storage; the graph recorded the old one
    g.replay()
    assert p.tolist() == [2.0] * 4 and old.tolist() == [4.0] * 4


def _scale_in_place(p):
    with torch.no_grad():
        p.mul_(2)  # the op's argument is the Parameter object itself


def test_swap_tensors_also_leaves_the_graph_on_the_old_memory():
    p = torch.nn.Parameter(torch.ones(4))
    old = p.data
    g, _ = _captured(lambda: _scale_in_place(p))
    torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().clone()))
    g.replay()
    assert p.tolist() == [2.0] * 4 and old.tolist() == [4.0] * 4


def test_new_tensors_are_recomputed_into_the_recorded_output_memory():
    x = torch.tensor([1.0, 2.0])
    g, out = _captured(lambda: (x * 3).sum())
    ptr = out.data_ptr()
    x.copy_(torch.tensor([10.0, 20.0]))
    g.replay()
    assert out.item() == 90.0 and out.data_ptr() == ptr


def test_backward_and_optimizer_step_replay_without_autograd_python():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=torch.tensor(0.125), fused=True)
    x = torch.randn(4, 3)

    def step():
        opt.zero_grad(set_to_none=False)
        loss = lin(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    step()  # gradients exist before the capture (as after the engine's warm-up)
    ref = torch.nn.Linear(3, 1)
    ref.load_state_dict(lin.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.125)
    g, _ = _captured(step)
    for _ in range(3):
        g.replay()
    for _ in range(4):
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(lin.parameters(), ref.parameters()))


def test_dropout_on_the_default_generator_draws_again_each_replay_and_matches_eager():
    x = torch.ones(64)
    torch.manual_seed(1)
    eager = [torch.nn.functional.dropout(x, 0.5) for _ in range(4)]
    torch.manual_seed(1)
    g, first = _captured(lambda: torch.nn.functional.dropout(x, 0.5))
    seen = [first.clone()]
    for _ in range(3):
        g.replay()
        seen.append(first.clone())
    assert not torch.equal(seen[1], seen[2])
    assert all(torch.equal(a, b) for a, b in zip(seen, eager))


def test_explicit_generator_repeats_unless_registered():
    x = torch.empty(16)
    gen = torch.Generator().manual_seed(7)
    g, out = _captured(lambda: x.uniform_(generator=gen))
    a = out.clone()
    g.replay()
    assert torch.equal(out, a), "an unregistered generator replays the capture's numbers"

    gen2 = torch.Generator().manual_seed(7)
    be = TapeBackend()
    g2 = be.new_graph()
    g2.register_generator_state(gen2)
    with be.capture(g2, None, None):
        y = torch.empty(16).uniform_(generator=gen2)
    g2.replay()
    b = y.clone()
    g2.replay()
    assert not torch.equal(y, b), "a registered generator advances per replay"
    eager = torch.Generator().manual_seed(7)
    for _ in range(2):
        ref = torch.empty(16).uniform_(generator=eager)
    assert torch.equal(y, ref)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.sum().item(),
        lambda x: float(x.sum()),
        lambda x: x[x > 0],
        lambda x: torch.nonzero(x),
        lambda x: torch.unique(x),
        lambda x: torch.tensor([1.0, 2.0], device=x.device),
        lambda x: torch.as_tensor([1.0, 2.0], device="cpu"),
        lambda x: torch.tensor(2.0, device=x.device),
        lambda x: bool(x.sum() > 0),
    ],
)
def test_sync_errors_refuse_host_syncs(fn):
    x = torch.randn(8)
    with pytest.raises(RuntimeError, match="synchronizing CUDA operation"):
        with TapeBackend().sync_errors():
            fn(x)


def test_sync_errors_allow_device_only_work_and_scalars():
    x = torch.randn(8)
    with TapeBackend().sync_errors():
        y = torch.where(x > 0, x, torch.zeros_like(x)) * torch.tensor(2.0)  # a host scalar: allowed on CUDA
        torch.zeros(3).add_(y[:3]).index_add_(0, torch.tensor([0, 2]), y[:2])  # a host tensor, not on the device
    assert torch.tensor.__module__ != "_tape", "torch.tensor left patched"


def test_sync_error_traceback_ends_at_the_callers_line():
    import traceback

    x = torch.randn(2)
    try:
        with TapeBackend().sync_errors():
            x.sum().item()  # the line the error must point at
    except RuntimeError as err:
        exc = err
    frames = traceback.extract_tb(exc.__traceback__)
    assert not [f for f in frames if f.filename == _tape.__file__]
    ours = [f for f in frames if "site-packages" not in f.filename]
    assert ours[-1].filename == __file__ and "x.sum().item()" in ours[-1].line
