"""CPU tests of the framework-free core: buffers, cache, config, optimizer prep, errors, NaN guard."""

from __future__ import annotations

import dataclasses
import traceback
from collections import namedtuple

import pytest
import torch

from nemo_cudagraph_plugin.core import (
    CaptureConfig,
    CaptureEngine,
    CaptureStats,
    GraphCache,
    NanGuard,
    NanPolicy,
    NonFiniteError,
    OptimizerPrep,
    StaticInputs,
    check_optimizer_supported,
    flatten,
    portable_optimizer_state,
    signature_of,
    unflatten,
)
from nemo_cudagraph_plugin.core.errors import capture_error_from, classify_capture_error, user_location

Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    meta: dict
    mode: str = "train"


def _batch(t=8, mode="train"):
    return {
        "x": torch.arange(2 * t).reshape(2, t),
        "nested": [Pair(torch.ones(3), 5), (torch.zeros(2, dtype=torch.bfloat16), None)],
        "dc": Batch(torch.arange(4), {"k": torch.full((1,), 2.0)}, mode),
        "name": "s",
    }


# -- buffers -----------------------------------------------------------------------------------
def test_flatten_unflatten_round_trip_nested_containers():
    b = _batch()
    leaves, spec = flatten(b)
    assert len(leaves) == 5
    rebuilt = unflatten(spec, leaves)
    assert rebuilt["name"] == "s" and isinstance(rebuilt["nested"][0], Pair) and isinstance(rebuilt["dc"], Batch)
    assert rebuilt["nested"][0].b == 5 and rebuilt["nested"][1][1] is None and rebuilt["dc"].mode == "train"
    for a, c in zip(flatten(rebuilt)[0], leaves):
        assert a is c


@pytest.mark.parametrize("obj", [
    _batch(),
    ({"loss": torch.ones(())}, [torch.zeros(()), torch.ones(2)], 3),  # the Lightning runner's step output
    {"loss": torch.ones(()), "n": torch.zeros(2)},
    torch.ones(2),
    [Pair(torch.ones(1), Batch(torch.zeros(1), {}, "m")), ()],
])
def test_unflattener_rebuilds_what_unflatten_rebuilds(obj):
    """The per-spec builder (used after every replay) equals the spec walk: same containers, leaves in order."""
    from nemo_cudagraph_plugin.core.buffers import unflattener

    leaves, spec = flatten(obj)
    fresh = [t.clone() for t in leaves]
    a, b = unflatten(spec, fresh), unflattener(spec)(fresh)
    assert flatten(a)[1] == flatten(b)[1] == spec
    assert all(x is y for x, y in zip(flatten(a)[0], flatten(b)[0]))
    assert all(x is y for x, y in zip(flatten(b)[0], fresh))


def test_signature_tracks_shape_dtype_and_non_tensor_leaves():
    sig = lambda b: signature_of(*flatten(b))  # noqa: E731
    assert sig(_batch()) == sig(_batch())
    assert sig(_batch(t=8)) != sig(_batch(t=9))  # short last batch / other seq len
    assert sig(_batch(mode="train")) != sig(_batch(mode="eval"))  # non-tensor leaf compared, never copied
    b = _batch()
    b["x"] = b["x"].float()
    assert sig(b) != sig(_batch())
    b = _batch()
    b["x"] = b["x"].t().contiguous().t()  # same shape, other strides
    assert sig(b) != sig(_batch())


def test_static_inputs_copy_in_place_and_keep_addresses():
    leaves, spec = flatten(_batch())
    st = StaticInputs(leaves, spec)
    ptrs = [t.data_ptr() for t in st.leaves]
    new, _ = flatten({**_batch(), "x": torch.full((2, 8), 7)})
    st.copy_from(new)
    assert [t.data_ptr() for t in st.leaves] == ptrs
    assert torch.equal(st.batch["x"], torch.full((2, 8), 7))
    assert st.batch["name"] == "s"


def test_static_inputs_refuse_wrong_device_and_grad_tensors():
    with pytest.raises(ValueError, match="is on cpu, but the step is captured on"):
        StaticInputs([torch.ones(2)], flatten(torch.ones(2))[1], device=torch.device("meta"))
    with pytest.raises(ValueError, match="requires grad"):
        StaticInputs([torch.ones(2, requires_grad=True)], flatten(torch.ones(2))[1])


def test_engine_needs_cuda_device():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        CaptureEngine(CaptureConfig(), torch.device("cpu"), [])


# -- graph cache -------------------------------------------------------------------------------
def test_graph_cache_lru_order_and_capacity():
    c: GraphCache[str] = GraphCache(2)
    c.put("a", "A")
    c.put("b", "B")
    assert c.full()
    assert c.get("a") == "A"  # a is now most recent
    with pytest.raises(RuntimeError):
        c.put("c", "C")
    assert c.evict_lru() == ("b", "B")
    c.put("c", "C")
    assert list(c.keys()) == ["a", "c"] and "b" not in c


# -- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,match",
    [
        ({"warmup_steps": 0}, r"CaptureConfig\(warmup_steps=0\) is invalid"),
        ({"max_graphs": 0}, "max_graphs"),
        ({"on_capture_error": "ignore"}, "'raise' or 'eager'"),
        ({"nan_guard": "grad"}, "nan_guard"),
        ({"nan_action": "zero"}, "nan_action"),
        ({"verify_steps": -1}, "verify_steps"),
        ({"fp8_refresh": "yes"}, "fp8_refresh"),
    ],
)
def test_config_rejects_bad_values_with_what_to_use(kw, match):
    with pytest.raises(ValueError, match=match):
        CaptureConfig(**kw)


def test_config_nan_modes():
    assert CaptureConfig().nan_mode == "full"
    assert CaptureConfig(nan_guard="loss").nan_mode == "loss"
    assert CaptureConfig(nan_guard=False).nan_mode == "off"
    assert CaptureConfig(nan_action="skip").nan_skips and not CaptureConfig().nan_skips


def test_skipping_bad_updates_needs_the_nan_guard():
    with pytest.raises(ValueError, match=r"nan_guard=False\) is invalid: nan_action='skip' needs the NaN guard"):
        CaptureConfig(nan_guard=False, nan_action="skip")


@pytest.mark.parametrize(("options", "one_process", "want"), [
    ({"nan_guard": False}, True, None),
    ({}, True, ("full", True, True)),
    ({}, False, ("full", True, False)),
    ({"nan_guard": "loss"}, True, ("loss", True, False)),
    ({"nan_action": "skip"}, True, ("full", False, False)),
    ({"nan_guard": "loss", "nan_action": "skip"}, True, ("loss", False, False)),
])
def test_nan_policy_is_built_from_the_config_alone(options, one_process, want):
    """One reading of nan_guard/nan_action: the guard's mode, whether a bad read raises, whether the loss may be
    watched instead of the gradients."""
    p = torch.nn.Parameter(torch.ones(2))
    policy = NanPolicy.from_config(CaptureConfig(**options), [("p", p)], torch.device("cpu"), CaptureStats(),
                                   one_process=one_process, step=lambda: 0)
    got = None if policy is None else (policy.guard.mode, policy.raise_on_bad, policy.may_watch)
    assert got == want
    if policy is not None:
        assert policy.can_read_clipping_norms == (want[0] == "full" and want[1])


# -- optimizer prep ----------------------------------------------------------------------------
def _adamw(**kw):
    ps = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    return torch.optim.AdamW([{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0}], lr=1e-3, **kw)


def test_prep_makes_lr_a_tensor_that_schedulers_update_in_place():
    opt = _adamw()
    prep = OptimizerPrep(opt, torch.device("cpu"), tensor_hparams=(True, False))
    prep.apply()
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and opt.param_groups[0]["capturable"] is True
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 ** i)
    sched.step()
    assert opt.param_groups[0]["lr"] is lr, "scheduler replaced the tensor instead of filling it"
    assert prep.sync_hyperparams() is None
    assert float(lr) == pytest.approx(5e-4)


def test_prep_copies_a_replaced_float_lr_back_into_the_tensor():
    opt = _adamw()
    prep = OptimizerPrep(opt, torch.device("cpu"), tensor_hparams=(True, False))
    prep.apply()
    lr = opt.param_groups[1]["lr"]
    opt.param_groups[1]["lr"] = 0.123  # an old-style scheduler assigning a float
    assert prep.sync_hyperparams() is None
    assert opt.param_groups[1]["lr"] is lr and float(lr) == pytest.approx(0.123)


def test_prep_reports_a_changed_frozen_scalar():
    opt = _adamw()
    prep = OptimizerPrep(opt, torch.device("cpu"), tensor_hparams=(True, False))
    prep.apply()
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10).step()  # cycles beta1
    changed = prep.sync_hyperparams()
    assert changed is not None and "betas" in changed
    opt.param_groups[0]["weight_decay"] = 0.5
    prep.freeze_scalars()
    assert prep.sync_hyperparams() is None


def test_prep_restore_and_reapply_keep_user_settings():
    opt = _adamw()
    prep = OptimizerPrep(opt, torch.device("cpu"), tensor_hparams=(True, False))
    prep.apply()
    prep.apply()  # e.g. after load_state_dict
    prep.restore()
    g = opt.param_groups[0]
    assert g["capturable"] is False and isinstance(g["lr"], float) and g["lr"] == pytest.approx(1e-3)


def test_prep_sgd_uses_fused_kernel_and_skip_mode_needs_fused_family():
    ps = [torch.nn.Parameter(torch.ones(3))]
    sgd = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    OptimizerPrep(sgd, torch.device("cpu"), tensor_hparams=(True, False)).apply()
    assert sgd.param_groups[0]["fused"] is True and isinstance(sgd.param_groups[0]["lr"], torch.Tensor)
    rms = torch.optim.RMSprop(ps, lr=0.1)
    with pytest.raises(TypeError, match="nan_action='skip' needs"):
        OptimizerPrep(rms, torch.device("cpu"), skip_nonfinite=True, tensor_hparams=(True, False)).apply()
    skip = _adamw()
    p = OptimizerPrep(skip, torch.device("cpu"), skip_nonfinite=True, tensor_hparams=(True, False))
    p.apply()
    assert skip.found_inf is p.found_inf and skip.found_inf.shape == () and skip.param_groups[0]["fused"] is True


def test_unsupported_optimizers_are_named_with_an_alternative():
    ps = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(TypeError, match="LBFGS cannot run inside a CUDA graph.*AdamW"):
        check_optimizer_supported(torch.optim.LBFGS(ps))

    class Custom(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    with pytest.raises(TypeError, match="Custom has no `capturable` option"):
        check_optimizer_supported(Custom(ps))
    # differentiable=True (the update stays in autograd's graph) and sparse parameters are refused by group
    with pytest.raises(TypeError, match="AdamW param group 1 has differentiable=True"):
        check_optimizer_supported(torch.optim.AdamW([{"params": ps}, {"params": [torch.nn.Parameter(torch.ones(2))],
                                                                      "differentiable": True}]))
    sparse = torch.nn.Parameter(torch.eye(2).to_sparse())
    with pytest.raises(TypeError, match="SGD param group 0 holds a sparse parameter"):
        check_optimizer_supported(torch.optim.SGD([sparse], lr=0.1))
    check_optimizer_supported(torch.optim.AdamW(ps))  # the supported case passes


def test_portable_checkpoint_state_has_floats_and_original_flags():
    opt = _adamw()
    prep = OptimizerPrep(opt, torch.device("cpu"), tensor_hparams=(True, False))
    prep.apply()
    sd = portable_optimizer_state(opt.state_dict(), prep._saved)
    assert isinstance(sd["param_groups"][0]["lr"], float) and sd["param_groups"][0]["capturable"] is False
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor), "live optimizer must keep its tensor lr"
    fresh = _adamw()
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["capturable"] is False


# -- errors ------------------------------------------------------------------------------------
# A stand-in for a CUDA tensor under set_sync_debug_mode("error"): its syncing methods raise the way
# torch does, from a frame that is not user code (compiled with a "<...>" file name, as torch's C++
# frames are invisible), so the classifier must read the *calling* line, as it does on a GPU.
_NS: dict = {}
exec(  # noqa: S102 - builds the raising frame outside the test file on purpose
    compile(
        "def sync_error(*a, **k):\n    raise RuntimeError('called a synchronizing CUDA operation')\n"
        "def capture_error(*a, **k):\n    raise RuntimeError('CUDA error: operation not permitted when stream is capturing')\n",
        "<torch-internals>",
        "exec",
    ),
    _NS,
)


class _CudaLike:
    item = to = __getitem__ = __bool__ = _NS["sync_error"]
    __str__ = __repr__ = _NS["capture_error"]

    def __gt__(self, other):
        return self


def _raise_sync_item():
    loss = _CudaLike()
    return loss.item()


def _raise_sync_to():
    return _CudaLike().to("cuda")


def _raise_sync_mask():
    x = _CudaLike()
    return x[x > 0]


def _raise_other():
    loss = _CudaLike()
    print(loss)


def _raise_item_with_misleading_comment():
    loss = _CudaLike()
    return loss.item()  # not x[x > 0], nor torch.tensor(1.0).to(device)


@pytest.mark.parametrize(
    "fn,rule",
    [(_raise_sync_item, "host-sync"), (_raise_sync_to, "cpu-tensor"), (_raise_sync_mask, "dynamic-shape"),
     (_raise_other, "host-sync"), (_raise_item_with_misleading_comment, "host-sync")],
)
def test_capture_errors_are_classified_from_the_user_line(fn, rule):
    try:
        fn()
    except RuntimeError as exc:
        assert classify_capture_error(exc) == rule
        loc = user_location(exc.__traceback__)
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == __file__]
        assert loc is not None and loc.endswith(f"test_core.py:{frames[-1].lineno}")
    else:
        raise AssertionError("the stand-in did not raise")


def test_location_in_library_code_is_named_and_marked(tmp_path, monkeypatch):
    """An offending line inside an installed package (an HF model, Lightning's demo module) is still
    named with path:line and marked as library code; user frames are preferred when present."""
    site = tmp_path / "site-packages" / "somelib"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / "model.py").write_text("def forward(x):\n    return x.item()\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    import importlib

    model = importlib.import_module("somelib.model")
    with pytest.raises(RuntimeError) as raised:
        model.forward(_CudaLike())
    exc = raised.value
    loc = user_location(exc.__traceback__)
    # The test file called it, so the user frame (this file) wins ...
    assert loc is not None and loc.startswith(__file__) and "library" not in loc
    # ... and without a user frame the library line is named and marked.
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    lib = user_location(tb)
    assert lib == f"{site / 'model.py'}:2 (library code)", lib
    err = capture_error_from(exc.with_traceback(tb), "capture")
    assert err.location == f"{site / 'model.py'}:2" and "installed library code" in str(err)
    assert err.rule == "host-sync"


def test_user_location_skips_library_frames():
    with pytest.raises(RuntimeError) as raised:
        torch.ones(2).view(3)
    loc = user_location(raised.value.__traceback__)
    assert loc is not None and "test_core.py" in loc and "torch" not in loc.split(":")[0].split("/")[-1]


# -- NaN guard ---------------------------------------------------------------------------------
def test_nan_guard_names_first_bad_parameter_and_resets():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    g = NanGuard([("a", a), ("b", b)], torch.device("cpu"), "full")
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    g.observe_loss(torch.tensor(1.0))
    g.observe_grads()
    assert g.check() is None
    b.grad = torch.tensor([1.0, float("inf")])
    g.observe_loss(torch.tensor(2.0))
    g.observe_grads()
    with pytest.raises(NonFiniteError) as ei:
        g.check(window="in steps 1..2")
    assert ei.value.parameter == "b" and "in steps 1..2" in str(ei.value)


def test_nan_guard_loss_mode_and_skip_flag():
    a = torch.nn.Parameter(torch.ones(2))
    g = NanGuard([("a", a)], torch.device("cpu"), "loss")
    g.observe_loss(torch.tensor(float("nan")))
    with pytest.raises(NonFiniteError, match="non-finite loss") as ei:
        g.check()
    assert ei.value.parameter is None
    found = torch.zeros(())
    a.grad = torch.tensor([float("nan"), 0.0])
    g.reset()
    g.observe_grads(found_inf=found)  # skip mode observes even in "loss" mode
    assert float(found) == 1.0 and g.skipped_steps() == 1
    report = g.check(raise_on_bad=False)
    assert report is not None and "'a'" in report
    assert g.check(raise_on_bad=False) is None  # cleared


class _LateCopy:
    """A snapshot's host copy the GPU has not written yet (``query`` False) until ``ready`` or a wait."""

    def __init__(self) -> None:
        self.ready = False
        self.waited = 0

    def query(self) -> bool:
        return self.ready

    def synchronize(self) -> None:
        self.waited += 1
        self.ready = True


def test_nan_guard_snapshot_reads_without_waiting(monkeypatch):
    import nemo_cudagraph_plugin.core.nan_guard as ng

    copies = []
    monkeypatch.setattr(ng, "_copied", lambda device: copies.append(_LateCopy()) or copies[-1])
    a = torch.nn.Parameter(torch.ones(2))
    g = NanGuard([("a", a)], torch.device("cpu"), "full")
    a.grad = torch.tensor([float("inf"), 0.0])
    g.observe_grads()
    g.snapshot("in window 1")
    assert g.read_pending and float(g.grad_bad.sum()) == 0.0  # cleared in stream order: the next window starts at 0
    assert g.poll() is None and g.read_pending  # not written yet: no wait, no report
    copies[-1].ready = True
    with pytest.raises(NonFiniteError, match="'a' in window 1") as ei:
        g.poll()
    assert ei.value.parameter == "a" and not g.read_pending and copies[-1].waited == 0
    # A snapshot still unread when the next one is due is waited for and reported first.
    g.observe_loss(torch.tensor(float("nan")))
    g.snapshot("in window 2")
    a.grad = torch.tensor([1.0, 2.0])
    g.observe_grads()
    with pytest.raises(NonFiniteError, match="non-finite loss in window 2"):
        g.snapshot("in window 3")
    assert copies[1].waited == 1
    # check() reads synchronously, after any queued snapshot
    g.snapshot("in window 3")
    assert g.check(raise_on_bad=False) is None and not g.read_pending
    # ... and in skip mode (no raise) it reports what the queued snapshot saw, with that snapshot's window
    a.grad = torch.tensor([float("nan"), 0.0])
    g.observe_grads()
    g.snapshot("in window 4")
    assert g.check(raise_on_bad=False, window="in window 5") == "NaN guard: non-finite gradient in parameter 'a' in window 4."


def test_nan_guard_loss_watch_reads_the_parameters_at_the_first_non_finite_loss_only():
    """watch_loss: a finite loss reads nothing; the window's first non-finite loss counts the parameters that are bad
    then (the one a bad gradient spoiled), later ones do not (by then the NaN has spread); a read in a window without
    a non-finite loss scans the parameters (a bad value that never reached a loss); each read arms the watch again."""
    nan = float("nan")
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    g = NanGuard([("a", a), ("b", b)], torch.device("cpu"), "full")
    g.scan_params = True
    g.watch_loss(torch.tensor(2.0))
    assert g.check(raise_on_bad=False) is None and float(g.loss_sum) == 0.0
    with torch.no_grad():
        b[1] = nan  # a bad value no loss has seen yet: found by the read
    g.watch_loss(torch.tensor(1.0))
    assert g.check(raise_on_bad=False, window="w1") == "NaN guard: non-finite gradient or update of parameter 'b' w1."
    with torch.no_grad():
        b.fill_(1.0)
        a[0] = nan  # the parameter a bad gradient spoiled; the next loss is NaN
    g.watch_loss(torch.tensor(nan))
    with torch.no_grad():
        b.fill_(nan)  # spread by the NaN loss's update: not counted (the watch is disarmed, the read does not scan)
    g.watch_loss(torch.tensor(nan))
    with pytest.raises(NonFiniteError) as ei:
        g.check(window="w2")
    assert ei.value.parameter == "a" and " more)" not in str(ei.value) and "non-finite loss" in str(ei.value)
    g.watch_loss(torch.tensor(nan))  # armed again after the read: every parameter is bad now
    assert "'a' (and 1 more)" in g.check(raise_on_bad=False)
    # The loss goes bad first (every parameter finite then): the next call counts what that step's update spoiled,
    # whatever its loss, and nothing after that.
    with torch.no_grad():
        a.fill_(1.0)
        b.fill_(1.0)
    g.watch_loss(torch.tensor(nan))
    with torch.no_grad():
        b[0] = nan  # the update of the NaN-loss step spoiled b only
    g.watch_loss(torch.tensor(3.0))
    with torch.no_grad():
        a[0] = nan
    g.watch_loss(torch.tensor(nan))
    with pytest.raises(NonFiniteError) as ei:
        g.check(window="w3")
    assert ei.value.parameter == "b" and " more)" not in str(ei.value), str(ei.value)


def test_nan_guard_read_keeps_the_watch_of_a_float64_loss():
    """A loss the Triton launch cannot read (float64) is watched by the torch ops; the read must use that same watch
    (its stage says it fired), not build another, armed one that counts the parameters the NaN spread to since."""
    nan = float("nan")
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    g = NanGuard([("a", a), ("b", b)], torch.device("cpu"), "full")
    g.scan_params = True
    with torch.no_grad():
        a[0] = nan
    g.watch_loss(torch.tensor(nan, dtype=torch.float64))
    with torch.no_grad():
        b.fill_(nan)
    with pytest.raises(NonFiniteError) as ei:
        g.check(window="w")
    assert ei.value.parameter == "a" and " more)" not in str(ei.value), str(ei.value)


def test_nan_guard_partial_gradients_use_index_plan():
    a, b, c = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    g = NanGuard([("a", a), ("b", b), ("c", c)], torch.device("cpu"), "full")
    c.grad = torch.tensor([float("nan"), 1.0])  # a and b unused this step
    g.observe_grads()
    with pytest.raises(NonFiniteError) as ei:
        g.check()
    assert ei.value.parameter == "c"


def test_align_pp_transposes_requires_the_fp8_refresh():
    assert CaptureConfig(align_pp_transposes=True).fp8_refresh is True
    with pytest.raises(ValueError, match="align_pp_transposes=True needs the FP8 refresh"):
        CaptureConfig(align_pp_transposes=True, fp8_refresh=False)


def test_finite_check_counts_non_finite_elements_per_slot_on_the_fallback_path():
    from nemo_cudagraph_plugin.core.finite import FiniteCheck

    a = torch.tensor([1.0, float("nan"), float("inf")])
    b = torch.tensor([[0.0, float("-inf")], [3.0, 4.0]]).t()  # non-contiguous
    c = torch.tensor([torch.finfo(torch.float32).max, -0.0])
    check = FiniteCheck([a, b, c], [2, 0, 1])
    assert not check.uses_triton  # CPU
    acc, step = torch.zeros(3), torch.zeros(())
    check.run(acc, step)
    # the fallback counts tensors with a non-finite element (the kernel counts elements): both are != 0 iff bad
    assert acc.tolist() == [1.0, 0.0, 1.0] and float(step) == 2.0
    with pytest.raises(ValueError, match="one slot per tensor"):
        FiniteCheck([a], [0, 1])
    with pytest.raises(ValueError, match=r"FiniteCheck\(block=100"):
        FiniteCheck([a], [0], block=100)


# ----------------------------------------------------------------------------------------------------------
# ModuleStateWatch: module values a graph bakes in
# ----------------------------------------------------------------------------------------------------------
def test_module_state_watch_names_what_changed_and_ignores_what_no_graph_read():
    from nemo_cudagraph_plugin.core.module_state import ModuleStateWatch

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1), torch.nn.LayerNorm(4))
    net[2]._calls = 0  # private: frameworks keep per-call bookkeeping there
    watch = ModuleStateWatch(net)
    assert watch.changed() is None
    net[1].p = 0.5
    assert watch.changed() == "1.p changed from 0.1 to 0.5 after the graph was captured"
    assert watch.changed() is None  # reported once
    net[2].eval()
    assert watch.changed().startswith("2.training changed from True to False")
    net[0].weight.requires_grad_(False)
    assert watch.changed().startswith("0.weight.requires_grad changed from True to False")
    assert [n for n, _ in watch.trainable] == ["0.bias", "2.weight", "2.bias"]
    # an equal value in a new object, a new attribute, a private one: nothing a graph read changed
    net[1].p = float("0.5")
    net[1].new_flag = True
    net[2]._calls = 3
    assert watch.changed() is None
    # a value that cannot be compared with the recorded one (a tensor where a float was) is a change, not an error
    net[1].p = torch.tensor([0.5, 0.5])
    assert watch.changed().startswith("1.p changed from 0.5 to tensor(")
    del net[1].new_flag
    assert watch.changed() == "1.new_flag changed from True to '<deleted>' after the graph was captured"


def test_module_state_watch_takes_a_compiled_submodule_and_names_it_as_the_user_does():
    """``torch.compile(module)`` wraps it in an ``OptimizedModule`` with no plain value of its own (``training``
    is a property there): the watch skips it, watches the wrapped module, and names it without ``_orig_mod``."""
    from nemo_cudagraph_plugin.core.module_state import ModuleStateWatch

    body = torch.nn.Module()
    body.proj, body.drop = torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)
    root = torch.nn.Module()
    root.body = torch.compile(body, backend="eager")
    watch = ModuleStateWatch(root)
    assert watch.changed() is None
    root.body.drop.p = 0.5  # the wrapper forwards attribute reads to the module it wraps
    assert watch.changed() == "body.drop.p changed from 0.1 to 0.5 after the graph was captured"
    root.body.eval()
    assert watch.changed().startswith("body.training changed from True to False")
    root.body.proj.weight.requires_grad_(False)
    assert watch.changed().startswith("body.proj.weight.requires_grad changed from True to False")
    assert [n for n, _ in watch.trainable] == ["body.proj.bias"]


def _memset_bytes(base: int, dst: int, value: int, element_size: int, width: int, size: int) -> bytes:
    out = bytearray(b"\x11" * size)
    out[dst - base:dst - base + width * element_size] = (value & ((1 << 8 * element_size) - 1)).to_bytes(
        element_size, "little") * width
    return bytes(out)


def _fill_bytes(base: int, dst: int, plan, size: int) -> bytes:
    """What the fill kernel of ``plan`` writes (ncg_fill_v4/u32/u8: 16/4/1-byte stores of the pattern)."""
    unit = {"ncg_fill_v4": 16, "ncg_fill_u32": 4, "ncg_fill_u8": 1}[plan.kernel]
    word = plan.pattern.to_bytes(4, "little")
    store = word * 4 if unit == 16 else word if unit == 4 else word[:1]
    out = bytearray(b"\x11" * size)
    out[dst - base:dst - base + plan.units * unit] = store * plan.units
    return bytes(out)


def test_memset_fill_plans_write_exactly_the_bytes_of_the_memset_and_say_which_they_cannot():
    from nemo_cudagraph_plugin.core._cuda_nodes import fill_plan

    base, size = 1 << 20, 512
    kernels = set()
    for element_size, values in ((1, (0, 0xA7, 0x1FF)), (2, (0, 0xBEEF, 0x1_2345)), (4, (0, 0xDEADBEEF, 0x3F800000))):
        for offset in (0, 1, 2, 3, 4, 8, 16, 18):
            for width in (1, 2, 3, 4, 5, 8, 12, 16, 33, 64):
                if offset + width * element_size > size:
                    continue
                for value in values:
                    plan = fill_plan(base + offset, value, element_size, width, 1)
                    if plan is None:  # only a 16/32-bit memset not 4-byte aligned (address or size) stays a memset
                        assert element_size > 1 and ((base + offset) % 4 or (width * element_size) % 4), (offset, width)
                        continue
                    kernels.add(plan.kernel)
                    assert _fill_bytes(base, base + offset, plan, size) == _memset_bytes(
                        base, base + offset, value, element_size, width, size), (element_size, offset, width, value)
    assert kernels == {"ncg_fill_v4", "ncg_fill_u32", "ncg_fill_u8"}
    from nemo_cudagraph_plugin.core._cuda_nodes import _KERNELS, _PTX

    assert all(f".entry {k}(" in _PTX for k in kernels)  # each plan's kernel is one the module defines
    # every kernel (fills and the batch/output copy) starts its grid-stride loop from the shared PTX; none is left a
    # template placeholder (which only the driver would refuse, on a GPU)
    assert "{grid}" not in _PTX and _PTX.count("mul.wide.u32") == 2 * len(_KERNELS) == 2 * _PTX.count(".entry ")
    # the copy kernel's spans: each has its own parameters, loops and labels, none left a template placeholder
    from nemo_cudagraph_plugin.core._cuda_nodes import _COPY_SEGMENTS

    assert "{i}" not in _PTX and _COPY_SEGMENTS >= 2
    for i in range(_COPY_SEGMENTS):
        assert all(_PTX.count(x) == 1 for x in (f"[dst{i}]", f"[src{i}]", f"[nbytes{i}]", f"VEC{i}:", f"BYTES{i}:",
                                                 f"DONE{i}:", f".param .u64 nbytes{i}")), i
    assert fill_plan(base, 0, 1, 64, 2) is None  # 2-D memsets stay
    assert fill_plan(base, 0, 8, 4, 1) is None


def test_memsets_as_kernels_is_an_option_and_graphs_keep_their_memsets_without_the_driver():
    from nemo_cudagraph_plugin.core import _cuda_nodes
    from nemo_cudagraph_plugin.core.backend import CudaBackend, default_backend

    assert CaptureConfig().memsets_as_kernels is True
    with pytest.raises(ValueError, match=r"CaptureConfig\(memsets_as_kernels='no'\) is invalid"):
        CaptureConfig(memsets_as_kernels="no")
    assert CudaBackend(memsets_as_kernels=False).memsets_kept == "memsets_as_kernels=False"
    # the graph's own batch/output copy nodes: the same machinery, their own option
    assert CaptureConfig().io_in_graph is True
    with pytest.raises(ValueError, match=r"CaptureConfig\(io_in_graph=1\) is invalid: use True or False"):
        CaptureConfig(io_in_graph=1)
    assert CudaBackend(io_in_graph=False).io_kept == "io_in_graph=False"
    assert CudaBackend(memsets_as_kernels=False).io_kept == CudaBackend().memsets_kept
    # the engine's default backend is where the options are read, once
    assert default_backend(None, CaptureConfig(io_in_graph=False)).io_kept == "io_in_graph=False"
    assert default_backend(None, CaptureConfig(memsets_as_kernels=False)).memsets_kept == "memsets_as_kernels=False"
    assert default_backend(None, CaptureConfig()).io_kept == CudaBackend().io_kept
    if _cuda_nodes.unavailable() is not None:  # this machine: no libcuda, or no cuda-bindings to reach it
        why = "libcuda" if "bindings" not in _cuda_nodes.unavailable() else "cuda-bindings is not importable"
        assert why in _cuda_nodes.unavailable()
        assert why in CudaBackend().memsets_kept
        with pytest.raises(RuntimeError, match="memset rewrite unavailable"):
            _cuda_nodes.rewrite_memsets(0, 1)


def test_stats_report_peak_memory_of_graphs_over_the_eager_warm_up():
    stats = CaptureStats(replays=10, captures=1, graphs=1)
    assert stats.peak_over_eager is None and "peak memory" not in stats.summary()
    stats.peak_eager_bytes, stats.peak_bytes = 2 * 2**30, 3 * 2**30
    assert stats.peak_over_eager == 1.5
    assert stats.summary().endswith("; peak memory 3.00 GiB, 1.500x the eager warm-up's 2.00 GiB")
