"""The capture engine's real decisions on CPU, with the tape stand-in for CUDA graphs (tests/_tape.py).

Every test compares a graphed run with the same steps run eagerly, bit for bit: keys, guards, static input
copies, output clones, generator registration, address checks, re-capture, eviction, verify_steps and the
capture-error reports all run exactly as on a GPU; only the graph object is the tape.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import pytest
import torch
from _tape import CpuGeneratorRegistry, TapeBackend
from torch import Tensor
from torch.overrides import TorchFunctionMode

from nemo_cudagraph_plugin.core import CaptureConfig, CaptureEngine, CaptureError, NanGuard, ParityError
from nemo_cudagraph_plugin.core.adapter import StepAdapter, StepFunctions

cpu = torch.device("cpu")
LR = 2.0**-6  # exact in float32: a float lr and the engine's float32 lr tensor give the same update


class Problem:
    """A small regression model, its fused AdamW (CPU AdamW takes capturable=True on its fused kernel) and a
    whole training step: zero_grad, forward, backward, optimizer step."""

    def __init__(self, seed: int = 0, extra_for_long: bool = False) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        # used only for inputs longer than 4 rows: its first gradient comes with the first long batch
        self.extra = torch.nn.Linear(8, 1) if extra_for_long else None
        params = list(self.model.parameters()) + (list(self.extra.parameters()) if self.extra else [])
        self.opt = torch.optim.AdamW(params, lr=torch.tensor(LR), fused=True, capturable=True)
        self.calls = 0

    def named(self) -> list[tuple[str, Tensor]]:
        out = list(self.model.named_parameters())
        if self.extra is not None:
            out += [("extra." + n, p) for n, p in self.extra.named_parameters()]
        return out

    def step(self, batch: dict) -> dict:
        self.calls += 1
        self.opt.zero_grad(set_to_none=False)
        pred = self.model(batch["x"])
        if self.extra is not None and batch["x"].shape[0] > 4:
            pred = pred + self.extra(batch["x"])
        loss = (pred - batch["y"]).pow(2).mean()
        loss.backward()
        self.opt.step()
        return {"loss": loss.detach()}

    def engine(self, backend: TapeBackend | None = None, generators=None, adapter_kw=None, **cfg) -> CaptureEngine:
        names = {id(p): n for n, p in self.named()}

        def state():
            out = [(f"state '{k}' of {names[id(p)]}", v) for p, s in self.opt.state.items() for k, v in s.items()]
            return out + [("lr tensor", self.opt.param_groups[0]["lr"])]

        cfg.setdefault("nan_guard", False)
        return CaptureEngine(CaptureConfig(**cfg), cpu, self.named(), StepFunctions(state=state, **(adapter_kw or {})),
                             generators=generators, backend=backend or TapeBackend())

    def params(self) -> list[Tensor]:
        return [p.detach().clone() for _, p in self.named()]


def batches(n: int, rows=(4,), seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(rows[i % len(rows)], 8, generator=g), "y": torch.randn(rows[i % len(rows)], 1, generator=g)}
            for i in range(n)]


def eager(bs: list[dict], **kw) -> tuple[list[float], list[Tensor]]:
    p = Problem(**kw)
    return [float(p.step(b)["loss"]) for b in bs], p.params()


def same(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("io", [False, True], ids=["copies-around", "io-in-graph"])
@pytest.mark.parametrize("fresh", [False, True])
def test_graphed_steps_equal_eager_bitwise(fresh, io):
    bs = batches(10)
    ref_losses, ref_params = eager(bs)
    p = Problem()
    be = TapeBackend(io_in_graph=io)
    eng = p.engine(be, warmup_steps=2)
    losses = [float(eng.step(b, "k", p.step, fresh_grads=fresh)["loss"]) for b in bs]
    assert (eng.stats.warmup_steps, eng.stats.captures, eng.stats.replays) == (2, 1, 7)
    assert be.replays == 7 and p.calls == 3, "replays must not run the step's Python"
    assert losses == ref_losses and same(p.params(), ref_params)


@pytest.mark.parametrize("on_error", ["raise", "eager"])
def test_a_step_that_zeroes_its_gradients_is_warmed_and_captured_without_the_previous_ones(on_error):
    """A step that zeroes its gradients (``fresh_grads``) makes the previous step's gradients dead values. The last
    warm-up (its host-sync check) copies none of them and the capture holds no reference to them, so the graphed run
    peaks with one set of gradients alive, as eager training does; training stays bitwise eager's."""
    bs = batches(6)
    ref_losses, ref_params = eager(bs)
    p = Problem()
    previous: list[weakref.ref] = []
    alive_in_capture: list[tuple[int, int]] = []

    @contextlib.contextmanager
    def in_capture():
        alive_in_capture.append((len(previous), sum(r() is not None for r in previous)))
        yield

    class Clones(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.of_grads = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is Tensor.clone and any(args[0] is q.grad for _, q in p.named()):
                self.of_grads += 1
            return func(*args, **(kwargs or {}))

    eng = p.engine(warmup_steps=2, on_capture_error=on_error, sync_check=True,
                   adapter_kw={"capture_contexts": [in_capture]})
    losses, clones = [], []
    for b in bs:
        previous[:] = [weakref.ref(q.grad) for _, q in p.named() if q.grad is not None]
        with Clones() as mode:
            losses.append(float(eng.step(b, "k", p.step, fresh_grads=True)["loss"]))
        clones.append(mode.of_grads)
    assert eng.stats.captures == 1 and alive_in_capture[0][0] == len(ref_params)  # gradients to drop existed
    assert alive_in_capture == [(len(ref_params), 0)], "the capture kept previous gradients alive"
    assert clones == [0] * len(bs), "the sync-check warm-up copied gradients the step zeroes anyway"
    assert losses == ref_losses and same(p.params(), ref_params)


@pytest.mark.parametrize("io", [False, True], ids=["copies-around", "io-in-graph"])
def test_returned_outputs_are_copies_that_later_replays_do_not_overwrite(io):
    bs = batches(8)
    p = Problem()
    eng = p.engine(TapeBackend(io_in_graph=io), warmup_steps=1)
    kept = [eng.step(b, "k", p.step)["loss"] for b in bs]
    ref, _ = eager(bs)
    assert [float(t) for t in kept] == ref and len(set(ref)) == len(ref)
    assert eng.stats.graphs_with_io_nodes == io


def test_a_graph_that_copies_its_own_io_is_bound_to_each_batch_and_fresh_outputs_before_its_replay(monkeypatch):
    """io_in_graph: the engine launches no copy of its own; before every replay it hands the graph this batch and
    memory allocated for this step's outputs. Unbound, the graph would read the captured batch again."""
    from nemo_cudagraph_plugin.core.buffers import StaticInputs

    p = Problem()
    be = TapeBackend(io_in_graph=True)
    eng = p.engine(be, warmup_steps=1)
    bs = batches(6)
    eng.step(bs[0], "k", p.step)  # warm-up
    copies = []
    monkeypatch.setattr(StaticInputs, "copy_from", lambda self, leaves: copies.append(leaves))
    outs = [eng.step(b, "k", p.step) for b in bs[1:]]
    entry = next(iter(eng.cache._entries.values()))
    assert entry.io is not None and entry.io.binds == 5 and copies == []
    assert entry.io.srcs[0] is bs[-1]["x"] and entry.io.srcs[1] is bs[-1]["y"]
    assert entry.io.dsts[0] is outs[-1]["loss"], "the graph writes the returned tensor itself"
    assert len({o["loss"].data_ptr() for o in outs}) == len(outs)
    assert CaptureConfig(io_in_graph=False).io_in_graph is False
    p2 = Problem()
    eng_off = p2.engine(TapeBackend(io_in_graph=False), warmup_steps=1)
    for b in bs[:3]:
        eng_off.step(b, "k", p2.step)
    assert eng_off.stats.graphs_with_io_nodes == 0


def test_each_replay_reads_the_new_batch_through_the_static_inputs():
    p = Problem()
    eng = p.engine(warmup_steps=1)
    bs = batches(4)
    for b in bs[:2]:
        eng.step(b, "k", p.step)  # warm-up, capture
    entry = next(iter(eng.cache._entries.values()))
    before = [t.data_ptr() for t in entry.inputs.leaves]
    eng.step(bs[2], "k", p.step)
    assert torch.equal(entry.inputs.batch["x"], bs[2]["x"])
    assert [t.data_ptr() for t in entry.inputs.leaves] == before


def _noisy_step(gen: torch.Generator, x: Tensor):
    def step(batch):
        return (batch * torch.rand(batch.shape, generator=gen)).sum()

    return step


def test_registered_generator_advances_each_replay_like_eager():
    x = torch.ones(32)
    eager_gen = torch.Generator().manual_seed(5)
    ref = [float(_noisy_step(eager_gen, x)(x)) for _ in range(6)]
    gen = torch.Generator().manual_seed(5)
    reg = CpuGeneratorRegistry()
    reg.register(gen)
    eng = CaptureEngine(CaptureConfig(warmup_steps=1, nan_guard=False), cpu, [], generators=reg, backend=TapeBackend())
    got = [float(eng.step(x, "k", _noisy_step(gen, x))) for _ in range(6)]
    assert eng.stats.replays == 4
    assert got == ref


def test_verify_steps_with_a_registered_generator_leave_its_numbers_as_an_unverified_run():
    """The eager half of a verified step draws from the registered generator too; its state is put back before the
    graph's step, so verified and unverified runs draw the same numbers."""
    x = torch.ones(32)
    runs = []
    for verify in (0, 3):
        gen = torch.Generator().manual_seed(5)
        reg = CpuGeneratorRegistry()
        reg.register(gen)
        eng = CaptureEngine(CaptureConfig(warmup_steps=1, nan_guard=False, verify_steps=verify), cpu, [],
                            generators=reg, backend=TapeBackend())
        runs.append([float(eng.step(x, "k", _noisy_step(gen, x))) for _ in range(7)])
        assert eng.stats.verified_steps == verify
    assert runs[0] == runs[1]


def test_generator_registry_takes_each_generator_once_and_only_of_its_device():
    reg, gen = CpuGeneratorRegistry(), torch.Generator().manual_seed(1)
    reg.register(gen)
    reg.register(gen)  # a second registration would advance it twice per replay
    assert len(reg) == 1
    with pytest.raises(TypeError, match="expects a CPU torch.Generator"):
        reg.register("not a generator")
    from nemo_cudagraph_plugin.core.rng import GeneratorRegistry

    with pytest.raises(TypeError, match="expects a CUDA torch.Generator"):
        GeneratorRegistry().register(torch.Generator())  # a CPU generator for CUDA graphs


def test_unregistered_generator_repeats_its_capture_numbers():
    # The hazard the registration exists for (and what the tape must reproduce for the test above to mean anything).
    x = torch.ones(32)
    gen = torch.Generator().manual_seed(5)
    eng = CaptureEngine(CaptureConfig(warmup_steps=1, nan_guard=False), cpu, [], backend=TapeBackend())
    got = [float(eng.step(x, "k", _noisy_step(gen, x))) for _ in range(5)]
    assert got[1] == got[2] == got[3] == got[4] and got[0] != got[1]


@pytest.mark.parametrize("how", ["data", "swap_tensors", "optimizer_state"])
def test_reallocated_state_after_capture_is_detected_and_recaptured(how):
    bs = batches(12)
    ref_losses, ref_params = eager(bs)
    p = Problem()
    eng = p.engine(warmup_steps=2)
    losses = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i, b in enumerate(bs):
            if i == 6:  # three replays in
                first = next(iter(p.opt.state))
                if how == "data":
                    first.data = first.data.clone()
                elif how == "swap_tensors":
                    torch.utils.swap_tensors(first, torch.nn.Parameter(first.detach().clone()))
                    first.grad = torch.zeros_like(first)
                else:
                    st = p.opt.state[first]
                    st["exp_avg"] = st["exp_avg"].clone()
            losses.append(float(eng.step(b, "k", p.step)["loss"]))
    assert any("re-captured" in str(x.message) for x in w), [str(x.message) for x in w]
    assert eng.stats.captures == 2 and eng.stats.recaptures == 1
    assert losses == ref_losses and same(p.params(), ref_params)


def test_gradient_created_by_a_later_signature_invalidates_the_earlier_graph():
    rows = [4] * 6 + [8] * 3 + [4] * 4
    bs = [batches(1, rows=(r,), seed=i)[0] for i, r in enumerate(rows)]
    ref_losses, ref_params = eager(bs, extra_for_long=True)
    p = Problem(extra_for_long=True)
    eng = p.engine(warmup_steps=2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        # fresh_grads=False: this step zeroes gradients in place, so a parameter without a gradient in a short
        # step is still updated (momentum, weight decay), as in the eager reference. (Lightning's own case, where
        # gradients are set to None, is tests/test_lightning_cpu.py's.)
        losses = [float(eng.step(b, "k", p.step)["loss"]) for b in bs]
    assert any("created after the graph was captured" in str(x.message) for x in w)
    assert eng.stats.replays > 3
    assert losses == ref_losses and same(p.params(), ref_params)


@pytest.mark.parametrize("policy", ["eager", "evict"])
def test_cache_full_policy(policy):
    rows = (4, 5, 6)
    bs = batches(15, rows=rows)
    ref_losses, ref_params = eager(bs)
    p = Problem()
    eng = p.engine(warmup_steps=1, max_graphs=2, on_cache_full=policy)
    losses = [float(eng.step(b, "k", p.step)["loss"]) for b in bs]
    assert len(eng.cache) == 2
    if policy == "eager":
        assert eng.stats.eager_reasons.get("graph cache full", 0) > 0 and eng.stats.captures == 2
    else:
        assert eng.stats.captures > 3 and "graph cache full" not in eng.stats.eager_reasons
    assert losses == ref_losses and same(p.params(), ref_params)


def test_guards_run_before_the_capture_not_only_before_replays():
    p = Problem()
    eng = p.engine(warmup_steps=1)
    calls = []
    eng.guards.append(lambda: calls.append(eng.stats.captures))
    for b in batches(3):
        eng.step(b, "k", p.step)
    assert calls == [0, 0, 1], "the guard must also run right before the step that captures"


# -- verify_steps ------------------------------------------------------------------------------
class _BN:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=torch.tensor(LR), fused=True, capturable=True)

    def step(self, b):
        self.opt.zero_grad(set_to_none=False)
        loss = (self.model(b["x"]) - b["y"]).pow(2).mean()
        loss.backward()
        self.opt.step()
        return loss.detach()

    def run(self, verify: int, mutable: bool = True) -> CaptureEngine:
        eng = CaptureEngine(
            CaptureConfig(warmup_steps=1, verify_steps=verify, nan_guard=False), cpu, list(self.model.named_parameters()),
            StepFunctions(state=lambda: [v for s in self.opt.state.values() for v in s.values()],
                          watched=lambda: list(self.model.named_buffers()),
                          mutable=(lambda: list(self.model.buffers())) if mutable else (lambda: [])),
            backend=TapeBackend())
        for b in batches(8):
            eng.step(b, "k", self.step)
        return eng


def test_verify_steps_leave_parameters_and_optimizer_state_as_an_unverified_run():
    bs = batches(8)
    runs = []
    for verify in (0, 3):
        p = Problem()
        eng = p.engine(warmup_steps=1, verify_steps=verify)
        losses = [float(eng.step(b, "k", p.step)["loss"]) for b in bs]
        runs.append((losses, p.params(), [v.clone() for s in p.opt.state.values() for v in s.values()]))
        assert eng.stats.verified_steps == verify
    (l0, p0, s0), (l1, p1, s1) = runs
    assert l0 == l1 and same(p0, p1) and same(s0, s1)


@pytest.mark.parametrize("mutable", [True, False])
def test_verify_steps_leave_batchnorm_statistics_as_an_unverified_run(mutable):
    # torch's native_batch_norm / cudnn_batch_norm schemas do not mark running_mean/running_var as written
    # (`Tensor? running_mean`, no `(a!)`): the write recorder snapshots those arguments by name, and the
    # Lightning adapter also lists the buffers in mutable_fn; either alone keeps the statistics right.
    plain, checked = _BN(), _BN()
    plain.run(0)
    eng = checked.run(3, mutable=mutable)
    assert eng.stats.verified_steps == 3
    for (n, a), b in zip(plain.model.state_dict().items(), checked.model.state_dict().values()):
        assert torch.equal(a, b), f"{n} differs after verification (BatchNorm statistics advanced twice?)"


@pytest.mark.parametrize("where", ["loss", "parameters"])
def test_verify_steps_raise_parity_error_when_the_graph_differs_from_eager(where):
    p = Problem()
    counter = {"n": 0}
    base = p.step

    def step(b):
        # A Python counter read inside the step: baked into the graph at capture, live in the eager half.
        counter["n"] += 1
        out = base(b)
        if where == "loss":  # the loss differs, the gradients and parameters do not
            return {"loss": out["loss"] + counter["n"]}
        with torch.no_grad():  # the parameters differ, the loss does not
            p.model[0].bias.add_(counter["n"] * 1e-3)
        return out

    eng = p.engine(warmup_steps=1, verify_steps=2)
    with pytest.raises(ParityError, match="loss" if where == "loss" else "parameter '0.bias'"):
        for b in batches(4):
            eng.step(b, "k", step)


def test_verify_steps_pass_on_a_faithful_step():
    p = Problem()
    eng = p.engine(warmup_steps=1, verify_steps=3)
    for b in batches(6):
        eng.step(b, "k", p.step)
    assert eng.stats.verified_steps == 3


# -- capture errors ------------------------------------------------------------------------------
def _loss_item(b):
    return b.sum() * b.sum().item()  # a host read


def _mask(b):
    return b[b > 0].sum()


def _host_data(b):
    return (b * torch.tensor([1.0, 2.0, 3.0, 4.0], device=b.device)).sum()


def _commented(b):
    return b.sum() * b.sum().item()  # torch.tensor([...]) x[x > 0] nonzero(...): comments are not code


@pytest.mark.parametrize(
    "fn,rule",
    [(_loss_item, "host-sync"), (_mask, "dynamic-shape"), (_host_data, "cpu-tensor"), (_commented, "host-sync")],
)
@pytest.mark.parametrize("sync_check", [True, False])
def test_capture_errors_name_the_users_line_and_rule(fn, rule, sync_check):
    eng = CaptureEngine(CaptureConfig(warmup_steps=2, sync_check=sync_check, nan_guard=False), cpu, [],
                        backend=TapeBackend())
    x = torch.ones(4)
    line = fn.__code__.co_firstlineno + 1
    with pytest.raises(CaptureError) as info:
        for _ in range(4):
            eng.step(x, "k", fn)
    err = info.value
    assert err.rule == rule, str(err)
    assert err.location == f"{__file__}:{line}", str(err)
    assert ("host-sync check" if sync_check else "(capture)") in str(err)


def test_on_capture_error_eager_trains_eagerly_with_one_warning():
    eng = CaptureEngine(CaptureConfig(warmup_steps=1, on_capture_error="eager", nan_guard=False), cpu, [],
                        backend=TapeBackend())
    x = torch.ones(4)
    with pytest.warns(UserWarning, match="training eagerly"):
        outs = [float(eng.step(x * i, "k", _loss_item)) for i in range(4)]
    assert outs == [float((x * i).sum() ** 2) for i in range(4)]
    assert eng.stats.captures == 0 and eng.disabled_reason


# -- NaN guard --------------------------------------------------------------------------------
def test_nan_guard_plan_built_inside_the_sync_checked_step_does_not_sync():
    p = Problem(extra_for_long=True)
    guard = NanGuard(p.named(), cpu, "full")
    p.step(batches(1)[0])  # first gradients of a subset of the parameters (`extra` has none)
    with TapeBackend().sync_errors():
        guard.observe_grads()  # builds the plan for that subset here
    assert len(guard._checks) == 1
    assert guard.check(raise_on_bad=False) is None


def test_nan_guard_sees_a_bad_gradient_on_a_replayed_step():
    p = Problem()
    guard = NanGuard(p.named(), cpu, "full")
    base = p.step

    def step(b):
        p.opt.zero_grad(set_to_none=False)
        loss = (p.model(b["x"]) - b["y"]).pow(2).mean()
        loss.backward()
        p.model[2].weight.grad.mul_(b["poison"])  # 1.0, or NaN in one batch: the loss stays finite
        guard.observe_grads()
        return {"loss": loss.detach()}

    eng = p.engine(warmup_steps=1)
    bs = batches(6)
    for i, b in enumerate(bs):
        b["poison"] = torch.tensor(float("nan") if i == 4 else 1.0)
        out = eng.step(b, "k", step)
        assert torch.isfinite(out["loss"])
    assert eng.stats.replays == 4
    report = guard.check(raise_on_bad=False)
    assert report is not None and "'2.weight'" in report, report
    del base



def test_the_engine_binds_its_adapter_once_and_asks_for_the_capture_checks_at_each_capture():
    """One adapter object: its per-step members (guards, after_replay) are bound when the engine is built, not looked
    up per step; the hazard checks around a capture are asked for at each capture."""
    calls: dict[str, int] = {}

    def count(what):
        calls[what] = calls.get(what, 0) + 1

    class Adapter(StepFunctions):
        def guards(self):
            count("guards")
            return [lambda: count("guard ran")]

        def capture_contexts(self):
            count("contexts")
            return []

    p = Problem()
    adapter = Adapter(after_replay=lambda entry: count("after_replay"))
    assert isinstance(adapter, StepAdapter)
    eng = CaptureEngine(CaptureConfig(warmup_steps=1, nan_guard=False), cpu, p.named(), adapter, backend=TapeBackend())
    for b in batches(6):
        eng.step(b, "k", p.step)
    assert (eng.stats.captures, eng.stats.replays) == (1, 4)
    assert calls == {"guards": 1, "guard ran": 6, "contexts": 1, "after_replay": 4}, calls
