"""CPU tests of the FP8 transpose refresh against doubles of each TransformerEngine API generation."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
from fp8_doubles import (
    GENERATIONS,
    TransposeLog,
    WritingOptimizer,
    eager_read,
    expected_transpose,
    graph_read,
    make_fp8_module,
    make_fp8_param,
    transpose_is_current,
    write_fp8_bytes,
)

import nemo_cudagraph_plugin.core.warn as warn_mod
import nemo_cudagraph_plugin.fp8.refresh as refresh_mod
from nemo_cudagraph_plugin.core.errors import CaptureError
from nemo_cudagraph_plugin.fp8 import (
    FirstMicrobatchCheck,
    StaleTransposeError,
    UnsupportedFp8ApiError,
    after_param_sync,
    check_delayed_scaling_registered,
    fp8_refresh_wanted,
    graph_safe_rng_generators,
    install_fp8_refresh,
    iter_fp8_params,
    named_fp8_params,
    refresh_fp8_transposes,
    register_rng_generators,
    verify_fp8_transposes,
)
from nemo_cudagraph_plugin.fp8 import _te_compat as te


@pytest.fixture(autouse=True)
def _fresh_warning_state(monkeypatch):
    # "Said once" warnings are per process; give every test a clean slate and no real TE version.
    monkeypatch.setattr(warn_mod, "_WARNED", set())
    monkeypatch.setattr(te, "te_version", lambda: None)


@pytest.fixture
def capturing(monkeypatch):
    """Pretend a CUDA graph is being captured on the current stream."""
    monkeypatch.setattr(refresh_mod, "_capturing", lambda: True)


# ---------------------------------------------------------------------------------------------
# The doubles themselves behave like TE ("marks invalid" vs "recomputes in place")
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gen", GENERATIONS)
def test_double_reset_only_marks_and_eager_rebuilds_but_graph_does_not(gen):
    p = make_fp8_param(gen, (8, 4), fp8_name="w")
    ptr = p._transpose.data_ptr()
    write_fp8_bytes(p, seed=1, reset=True)
    log = p.fp8_log
    assert log.kinds("w")[-2:] == ["write", "reset"]
    assert p._transpose_invalid is True
    assert p._transpose.data_ptr() == ptr, "_reset_caches must not free or move the buffer"
    assert not torch.equal(graph_read(p), expected_transpose(p)), "a graph reads the stale buffer"
    assert log.count("compute", "w") == 0
    assert torch.equal(eager_read(p), expected_transpose(p)), "eager TE notices the flag and rebuilds"
    assert log.count("compute", "w") == 1 and p._transpose.data_ptr() == ptr


@pytest.mark.parametrize("gen", ["te1.6", "te1.8"])
def test_double_te1_valid_cache_is_returned_without_compute(gen):
    p = make_fp8_param(gen, fp8_name="w")
    write_fp8_bytes(p, seed=3, reset=False)  # raw byte write: TE is not told
    out = p.transpose_2d(cache=True) if gen == "te1.6" else p.transpose_2d(fill_cache=True)
    assert p.fp8_log.kinds("w")[-1] == "cache-hit"
    assert not torch.equal(out, expected_transpose(p)), "TE 1.x trusts a clear flag: stale even in eager"


def test_double_te2_update_usage_drops_and_reallocates():
    p = make_fp8_param("te2", fp8_name="w")
    p._reset_caches()
    p.update_usage(rowwise_usage=True, columnwise_usage=False)
    assert p._transpose is None and p.fp8_log.kinds("w")[-1] == "drop"
    p.update_usage(columnwise_usage=True)
    assert p.fp8_log.kinds("w")[-2:] == ["alloc", "compute"] and transpose_is_current(p)


# ---------------------------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gen", GENERATIONS)
def test_generation_detected_from_methods(gen):
    assert te.api_generation(make_fp8_param(gen)) == gen
    assert te.is_fp8_tensor(make_fp8_param(gen))


def test_plain_tensors_are_not_fp8():
    for t in (torch.zeros(2), torch.nn.Parameter(torch.zeros(2, 2))):
        assert not te.is_fp8_tensor(t) and not te.looks_like_fp8_tensor(t)
    assert refresh_fp8_transposes(torch.nn.Linear(4, 4)) == 0


def test_te_before_1_6_is_refused_not_skipped():
    m = torch.nn.Module()
    m.old = make_fp8_param("te1.5")
    with pytest.raises(UnsupportedFp8ApiError, match=r"old .*>= 1\.6"):
        list(iter_fp8_params(m))
    with pytest.raises(UnsupportedFp8ApiError):
        refresh_fp8_transposes(m)


def test_named_params_of_module_list_and_dedup():
    log = TransposeLog()
    a = make_fp8_param("te2", fp8_name="a", log=log)
    m1, m2 = torch.nn.Module(), torch.nn.Module()
    m1.w = a
    m2.w = a  # shared weight
    m2.b = make_fp8_param("te1.8", fp8_name="b", log=log)
    names = [n for n, _ in named_fp8_params([m1, m2, torch.zeros(3)])]
    assert names == ["[0].w", "[1].b"]
    with pytest.raises(TypeError, match="iterable of tensors/modules"):
        named_fp8_params([1, 2])


# ---------------------------------------------------------------------------------------------
# Refresh: order, address stability, result
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gen", GENERATIONS)
@pytest.mark.parametrize("reset_by_writer", [True, False])
def test_refresh_recomputes_in_place_after_write(gen, reset_by_writer):
    p = make_fp8_param(gen, (16, 8), fp8_name="w")
    ptr = p._transpose.data_ptr()
    write_fp8_bytes(p, seed=5, reset=reset_by_writer)
    assert not torch.equal(graph_read(p), expected_transpose(p))
    write_seq = p.fp8_log.seqs("write", "w")[-1]

    assert refresh_fp8_transposes(p) == 1

    after = [e for e in p.fp8_log.select(tensor="w") if e.seq > write_seq]
    kinds = [e.kind for e in after if e.kind != "reset"] if reset_by_writer else [e.kind for e in after]
    if reset_by_writer:
        assert kinds == ["compute"]
    else:
        assert kinds == ["reset", "compute"], "our own _reset_caches() comes first, then the in-place compute"
    assert all(e.ptr == ptr for e in after if e.ptr is not None)
    assert p.fp8_log.count("alloc", "w") == 0
    assert p._transpose.data_ptr() == ptr and p._transpose_invalid is False
    assert torch.equal(graph_read(p), expected_transpose(p)), "what a graph reads is now current"


@pytest.mark.parametrize("gen", GENERATIONS)
def test_refresh_3d_or_float8_data(gen):
    if gen == "te2":
        p = make_fp8_param(gen, (2, 3, 16), fp8_name="w")  # TE 2.x transposes [*M, N] -> [N, *M]
    else:
        p = make_fp8_param(gen, (4, 16), fp8_name="w", data_dtype=torch.float8_e4m3fn)
    write_fp8_bytes(p, seed=9)
    assert refresh_fp8_transposes(p) == 1
    assert verify_fp8_transposes(p).ok


@pytest.mark.parametrize("gen", ["te1.6", "te1.8"])
def test_te1_non_2d_is_skipped_once(gen):
    p = make_fp8_param(gen, (2, 3, 4), fp8_name="w")
    with pytest.warns(RuntimeWarning, match="only 2-D"):
        assert refresh_fp8_transposes(p) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert refresh_fp8_transposes(p) == 0


def test_refresh_counts_and_mixed_generations_in_one_module():
    m = make_fp8_module()
    for _, p in named_fp8_params(m):
        write_fp8_bytes(p)
    assert refresh_fp8_transposes(m) == 3
    assert verify_fp8_transposes(m).ok


def test_columnwise_only_skipped_and_said_once():
    p = make_fp8_param("te2", fp8_name="c", rowwise=False)
    before = p._transpose.clone()
    with pytest.warns(RuntimeWarning, match="no row-wise data"):
        assert refresh_fp8_transposes(p) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # second time: silent
        assert refresh_fp8_transposes(p) == 0
    assert torch.equal(p._transpose, before) and p._transpose_invalid is False
    assert p.fp8_log.count("compute") == 0 and p.fp8_log.count("reset") == 0


@pytest.mark.parametrize("gen", GENERATIONS)
def test_no_transpose_buffer_is_not_allocated(gen):
    p = make_fp8_param(gen, fp8_name="w", with_transpose=False)
    assert refresh_fp8_transposes(p) == 0
    assert p._transpose is None and p.fp8_log.count("alloc") == 0
    assert p._transpose_invalid is True  # flagged for eager TE, which builds it on demand


@pytest.mark.parametrize("gen", GENERATIONS)
def test_moving_buffer_refused_in_capture(gen, capturing):
    p = make_fp8_param(gen, fp8_name="w", realloc_on_refresh=True)
    write_fp8_bytes(p)
    with pytest.raises(CaptureError, match="allocated a new buffer during CUDA graph capture") as ei:
        refresh_fp8_transposes(p)
    assert ei.value.rule == "fp8-transpose-moved"


def test_moving_buffer_outside_capture_warns_or_raises():
    p = make_fp8_param("te2", fp8_name="w", realloc_on_refresh=True)
    with pytest.warns(RuntimeWarning, match="allocated a new buffer"):
        assert refresh_fp8_transposes(p) == 1
    with pytest.raises(CaptureError, match="while CUDA graphs may be reading it"):
        refresh_fp8_transposes(p, require_stable_address=True)
    with pytest.raises(CaptureError):
        after_param_sync(p)  # strict by default: graphs captured earlier read these buffers


@pytest.mark.parametrize("shape,dtype", [((3, 3), torch.uint8), ((4, 7), torch.uint8), ((4, 8), torch.float16)],
                         ids=["shape", "too-few-bytes", "element-size"])
def test_wrong_size_buffer_is_refused_before_writing(shape, dtype):
    """A cached transpose that does not fit the data (other shape; the right first dimension but fewer elements;
    other element size) is refused before TE's kernel writes numel bytes into it."""
    p = make_fp8_param("te2", (8, 4), fp8_name="w")
    p._transpose = torch.zeros(shape, dtype=dtype)
    with pytest.raises(RuntimeError, match="out of bounds"):
        refresh_fp8_transposes(p)
    assert p.fp8_log.count("compute") == 0 and torch.count_nonzero(p._transpose) == 0


def test_refresh_under_capture_runs_same_python_path(capturing):
    m = make_fp8_module()
    for _, p in named_fp8_params(m):
        write_fp8_bytes(p)
    assert refresh_fp8_transposes(m) == 3
    with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture"):
        verify_fp8_transposes(m)


# ---------------------------------------------------------------------------------------------
# Optimizer hook / after_param_sync
# ---------------------------------------------------------------------------------------------


def test_install_refreshes_after_each_step_in_order():
    log = TransposeLog()
    m = make_fp8_module(log=log)
    opt = WritingOptimizer(m.parameters())
    handle = install_fp8_refresh(opt, m)
    assert len(handle.plan) == 3 and handle.active
    for step in range(3):
        log.mark(f"step{step}")
        opt.step()
        assert verify_fp8_transposes(m).ok
        for name in ("w0", "w1", "w2"):
            mark = log.seqs("mark", f"step{step}")[0]
            write = [s for s in log.seqs("write", name) if s > mark]
            comp = [s for s in log.seqs("compute", name) if s > mark]
            assert len(write) == 1 and len(comp) == 1 and comp[0] > write[0]
        assert log.count("alloc") == 0
    assert handle.calls == 3 and handle.last_refreshed == 3

    handle.remove()
    assert not handle.active
    opt.step()
    report = verify_fp8_transposes(m)
    assert not report.ok and set(report.stale) == {"w0", "w1", "w2"}, "no refresh once removed"


def test_install_without_writer_reset_still_fixes_stale_bytes():
    m = make_fp8_module(["te1.6", "te1.8", "te2"])
    opt = WritingOptimizer(m.parameters(), reset=False)  # raw byte writes, flags stay clear
    with install_fp8_refresh(opt, m):
        opt.step()
    assert verify_fp8_transposes(m).ok


def test_one_installer_for_optimizers_and_framework_events_with_the_modes_of_the_option():
    """install_fp8_refresh is the installer every entry point calls: a torch optimizer's step, or a framework's
    event through attach(refresh) -> detach (megatron-core's all-gather completion); mode as fp8_refresh."""
    m = make_fp8_module()
    opt = WritingOptimizer(m.parameters())
    assert install_fp8_refresh(opt, m, mode=False) is None
    assert install_fp8_refresh(opt, torch.nn.Linear(2, 2), mode="auto") is None
    with pytest.raises(ValueError, match=r"^Owner\(fp8_refresh=True\): no TransformerEngine Float8Tensor"):
        install_fp8_refresh(opt, torch.nn.Linear(2, 2), owner="Owner(fp8_refresh=True)")
    with pytest.raises(ValueError, match=r"Owner: fp8_refresh=1 is invalid"):
        install_fp8_refresh(opt, m, mode=1, owner="Owner")  # type: ignore[arg-type]
    opt.step()
    assert not verify_fp8_transposes(m).ok, "mode=False and 'auto' without FP8 installed nothing"

    events: list = []

    def attach(refresh):
        events.append(refresh)
        return lambda: events.remove(refresh)

    handle = install_fp8_refresh(attach, m, mode="auto")
    assert handle is not None and handle.optimizer is None and handle.active and len(events) == 1
    assert events[0]() == 3 and handle.calls == 1 and verify_fp8_transposes(m).ok
    handle.remove()
    assert events == [] and not handle.active
    assert "optimizer=event" in repr(handle)


def test_install_errors_are_clear():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="no TransformerEngine Float8Tensor parameter found"):
        install_fp8_refresh(opt, torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="after_param_sync"):
        install_fp8_refresh(object(), make_fp8_module())  # type: ignore[arg-type]


def test_install_strict_refuses_moving_buffers():
    p = make_fp8_param("te1.8", fp8_name="w", realloc_on_refresh=True)
    opt = WritingOptimizer([p])
    install_fp8_refresh(opt, [p])
    with pytest.raises(CaptureError, match="fp8|FP8"):
        opt.step()


def test_after_param_sync_on_model_chunks():
    chunks = [make_fp8_module(["te2"]), make_fp8_module(["te1.8", "te2"])]
    for c in chunks:
        for _, p in named_fp8_params(c):
            write_fp8_bytes(p, reset=False)
    assert after_param_sync(chunks) == 3
    assert all(verify_fp8_transposes(c).ok for c in chunks)


# ---------------------------------------------------------------------------------------------
# verify_fp8_transposes
# ---------------------------------------------------------------------------------------------


def test_verify_reports_stale_flagged_and_skipped():
    m = make_fp8_module(["te2", "te1.8"])
    m.col = make_fp8_param("te2", fp8_name="col", rowwise=False)
    m.none = make_fp8_param("te2", fp8_name="none", with_transpose=False)
    write_fp8_bytes(m.w0, reset=True)
    write_fp8_bytes(m.w1, reset=False)
    r = verify_fp8_transposes(m)
    assert not r.ok and set(r.stale) == {"w0", "w1"} and r.flagged == ["w0"]
    assert set(r.skipped) == {"col", "none"}
    assert r.stale["w0"] > 0 and "flagged invalid" in str(r)
    r2 = verify_fp8_transposes(m, include_flagged=False)
    assert set(r2.stale) == {"w1"} and "w0" in r2.skipped
    with pytest.raises(StaleTransposeError, match="w1"):
        verify_fp8_transposes(m, raise_on_mismatch=True)
    refresh_fp8_transposes(m)
    assert verify_fp8_transposes(m).ok and verify_fp8_transposes(m).matched == ["w0", "w1"]


def test_verify_shape_mismatch():
    p = make_fp8_param("te2", (8, 4), fp8_name="w")
    p._transpose = torch.zeros(2, 16, dtype=torch.uint8)
    assert verify_fp8_transposes(p).stale == {"tensor": -1}


# ---------------------------------------------------------------------------------------------
# TE absent / versions
# ---------------------------------------------------------------------------------------------


def test_without_te_nothing_breaks_and_te_is_not_imported(monkeypatch):
    monkeypatch.undo()  # real te_version
    if te.te_installed():
        pytest.skip("transformer_engine is installed here")
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    assert refresh_fp8_transposes(model) == 0
    assert verify_fp8_transposes(model).ok
    assert fp8_refresh_wanted("auto", model) is False
    assert fp8_refresh_wanted(False, model) is False
    with pytest.raises(ValueError, match=r"transformer_engine is not installed \(pip install"):
        fp8_refresh_wanted(True, model)
    assert graph_safe_rng_generators() == []
    check_delayed_scaling_registered(model)
    assert "transformer_engine" not in sys.modules


def test_fp8_refresh_wanted_modes():
    assert fp8_refresh_wanted("auto", make_fp8_module()) is True
    assert fp8_refresh_wanted(True, make_fp8_module()) is True
    with pytest.raises(ValueError, match="use True, False or 'auto'"):
        fp8_refresh_wanted("yes", make_fp8_module())


def test_version_checks(monkeypatch):
    m = make_fp8_module(["te2"])
    monkeypatch.setattr(te, "te_version", lambda: (1, 5, 0))
    with pytest.raises(RuntimeError, match=r">= 1\.6"):
        refresh_fp8_transposes(m)
    assert refresh_fp8_transposes(torch.nn.Linear(2, 2)) == 0, "no FP8 parameter: no version demand"
    monkeypatch.setattr(te, "te_version", lambda: (3, 1, 0))
    with pytest.warns(RuntimeWarning, match="newer than the versions"):
        refresh_fp8_transposes(m)
    monkeypatch.setattr(te, "te_version", lambda: (1, 12, 0))
    with pytest.warns(RuntimeWarning, match="look like TE API 'te2'.*expected 'te1.8'"):
        assert refresh_fp8_transposes(m) == 1
    monkeypatch.setattr(te, "te_version", lambda: (2, 20, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert refresh_fp8_transposes(m) == 1


def test_version_parsing_and_mapping(monkeypatch):
    monkeypatch.undo()
    assert te._parse_version("2.20.2+cu13") == (2, 20, 2)
    assert te._parse_version("1.13.0.dev0") == (1, 13, 0)
    assert te._parse_version("garbage") is None
    assert [te.expected_generation(v) for v in [(1, 5), (1, 6), (1, 7), (1, 8), (1, 13), (1, 14), (2, 0), (2, 20)]] == [
        None, "te1.6", "te1.6", "te1.8", "te1.8", "te1.8", "te2", "te2",
    ]  # fmt: skip
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(__version__="2.20.2"))
    assert te.te_version() == (2, 20, 2)


# ---------------------------------------------------------------------------------------------
# Hazards: RNG tracker, is_first_microbatch, delayed scaling
# ---------------------------------------------------------------------------------------------


class _Tracker:
    def __init__(self, states):
        self._states = states

    def get_states(self):
        return dict(self._states)


class _Registry:
    def __init__(self):
        self.gens = []

    def register(self, g):
        self.gens.append(g)


@pytest.fixture
def graph_rng_api(monkeypatch):
    monkeypatch.setattr(torch.cuda.CUDAGraph, "register_generator_state", lambda self, g: None, raising=False)


def test_rng_generators_from_tracker_and_te(monkeypatch, graph_rng_api):
    g1, g2 = torch.Generator(), torch.Generator()
    fake = types.SimpleNamespace(get_all_rng_states=lambda: {"model-parallel-rng": g1})
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.distributed", fake)
    gens = graph_safe_rng_generators(_Tracker({"a": g1, "b": g2}))
    assert gens == [g1, g2], "TE's states first, duplicates dropped"
    reg = _Registry()
    assert register_rng_generators(reg, _Tracker({"b": g2})) == 2 and reg.gens == [g1, g2]
    assert graph_safe_rng_generators(include_te=False) == []


def test_rng_tensor_state_refused(graph_rng_api):
    with pytest.raises(CaptureError, match="not a torch.Generator") as ei:
        graph_safe_rng_generators(_Tracker({"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)}))
    assert ei.value.rule == "rng-tracker"
    with pytest.raises(TypeError, match="get_states"):
        graph_safe_rng_generators(object())
    with pytest.raises(TypeError, match="CUDAGraph or an object"):
        register_rng_generators(object(), _Tracker({"a": torch.Generator()}))


def test_rng_without_graph_api_refused(monkeypatch):
    monkeypatch.delattr(torch.cuda.CUDAGraph, "register_generator_state", raising=False)
    with pytest.raises(CaptureError, match="register_generator_state"):
        graph_safe_rng_generators(_Tracker({"a": torch.Generator()}))


class _TELinearLike(torch.nn.Module):
    def __init__(self, fp8_weight: bool = False):
        super().__init__()
        self.weight = make_fp8_param("te2", (4, 4)) if fp8_weight else torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x, is_first_microbatch=None):
        return x @ self.weight.detach().float().t() if not hasattr(self.weight, "_data") else x


class _Block(torch.nn.Module):
    def __init__(self, fp8_weight=False):
        super().__init__()
        self.proj = _TELinearLike(fp8_weight)

    def forward(self, x, microbatches=(None,), positional=False):
        for flag in microbatches:
            x = self.proj(x, flag) if positional else self.proj(x, is_first_microbatch=flag)
        return x


@pytest.mark.parametrize("positional", [False, True])
def test_first_microbatch_false_refused(positional):
    m = _Block()
    with pytest.raises(CaptureError, match="is_first_microbatch=False.*proj") as ei:
        with FirstMicrobatchCheck(m, fp8_enabled=lambda: True):
            m(torch.ones(2, 4), microbatches=(False, False), positional=positional)
    assert ei.value.rule == "fp8-weight-cache"
    assert not m.proj._forward_pre_hooks, "hooks removed after the block"


@pytest.mark.parametrize(
    "flags,fp8,fp8_weight",
    [
        ((True, False), True, False),
        ((None, None), True, False),
        ((False,), False, False),
        ((False,), True, True),
    ],
)
def test_first_microbatch_allowed(flags, fp8, fp8_weight):
    m = _Block(fp8_weight)
    with FirstMicrobatchCheck(m, fp8_enabled=lambda: fp8) as chk:
        m(torch.ones(2, 4), microbatches=flags)
    assert chk.violations == []


def test_first_microbatch_check_does_not_mask_other_errors():
    m = _Block()
    with pytest.raises(ZeroDivisionError):
        with FirstMicrobatchCheck(m, fp8_enabled=lambda: True):
            m(torch.ones(2, 4), microbatches=(False,))
            _ = 1 / 0


class _Recipe:
    def __init__(self, delayed):
        self._d = delayed

    def delayed(self):
        return self._d


def _te_module(delayed=True, registered=True, fp8=True):
    m = torch.nn.Module()
    m.fp8 = fp8
    m.fp8_meta = {"recipe": _Recipe(delayed), "scaling_fwd": object()}
    if registered:
        m.fp8_meta["buffer_index_and_autocast_key"] = (0, "k")
    return m


def test_delayed_scaling_registration(monkeypatch):
    mgr = types.SimpleNamespace(
        get_buffer_info=lambda: "buffer_index_and_autocast_key", is_fp8_enabled=lambda: True
    )
    monkeypatch.setitem(
        sys.modules,
        "transformer_engine.pytorch.quantization",
        types.SimpleNamespace(FP8GlobalStateManager=mgr),
    )
    model = torch.nn.Sequential(
        _te_module(), _te_module(delayed=False, registered=False), _te_module(fp8=False, registered=False)
    )
    check_delayed_scaling_registered(model)
    model.append(_te_module(registered=False))
    with pytest.raises(CaptureError, match=r"modules 3 ran their first FP8") as ei:
        check_delayed_scaling_registered(model)
    assert ei.value.rule == "fp8-delayed-scaling"
    assert te.fp8_enabled() is True


# ---------------------------------------------------------------------------------------------
# Lightning callback
# ---------------------------------------------------------------------------------------------


pl = pytest.importorskip("lightning.pytorch")


class _LitFp8(pl.LightningModule):
    def __init__(self, with_fp8=True, reset=True):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.reset = reset
        self.fp8 = make_fp8_module(["te2", "te1.8"]) if with_fp8 else torch.nn.Module()

    def training_step(self, batch, batch_idx):
        return self.lin(batch).pow(2).mean()

    def configure_optimizers(self):
        return WritingOptimizer(self.parameters(), lr=0.01, reset=self.reset)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)


def _fit(model, callbacks):
    trainer = pl.Trainer(
        max_steps=4,
        callbacks=callbacks,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    return trainer


def test_callback_refreshes_and_verifies_each_step():
    from nemo_cudagraph_plugin.lightning.fp8_callback import Fp8TransposeRefresh

    model = _LitFp8()
    cb = Fp8TransposeRefresh(verify_every_n_steps=1)
    trainer = _fit(model, [cb])
    assert trainer.global_step == 4
    assert cb.refreshes == 4 and cb.verified == 4 and cb.handles == []
    assert not trainer.optimizers[0]._optimizer_step_post_hooks, "hook removed at fit end"
    log = model.fp8.fp8_log
    for name in ("w0", "w1"):
        writes, comps = log.seqs("write", name), log.seqs("compute", name)
        assert len(writes) == 4
        assert all(any(c > w for c in comps) for w in writes)
    assert verify_fp8_transposes(model).ok


def test_without_callback_transposes_go_stale():
    model = _LitFp8()
    _fit(model, [])
    assert not verify_fp8_transposes(model).ok


def test_callback_modes():
    from nemo_cudagraph_plugin.lightning.fp8_callback import Fp8TransposeRefresh

    cb = Fp8TransposeRefresh("auto")
    _fit(_LitFp8(with_fp8=False), [cb])
    assert cb.refreshes == 0
    with pytest.raises(ValueError, match="no TransformerEngine Float8Tensor parameter"):
        _fit(_LitFp8(with_fp8=False), [Fp8TransposeRefresh(True)])
    with pytest.raises(ValueError, match="invalid"):
        Fp8TransposeRefresh("always")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="verify_every_n_steps"):
        Fp8TransposeRefresh(verify_every_n_steps=-1)


def test_callback_owned_subset_per_optimizer():
    from nemo_cudagraph_plugin.lightning.fp8_callback import Fp8TransposeRefresh

    m = make_fp8_module(["te2", "te2", "te2"])
    owner = WritingOptimizer([m.w0])
    masters = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    cb = Fp8TransposeRefresh(refresh_at_fit_start=False)
    cb.on_fit_start(types.SimpleNamespace(optimizers=[owner, masters]), m)
    assert [len(h.plan) for h in cb.handles] == [1, 3]
    cb.teardown(None, m, "fit")
    assert cb.handles == []


@pytest.mark.parametrize("at_fit_start", [True, False])
def test_callback_refreshes_every_fp8_parameter_once_at_fit_start(at_fit_start):
    """Bytes loaded into the existing tensors before fit (a checkpoint) leave the transposes stale: the callback
    refreshes every FP8 parameter once at fit start (not only those an optimizer owns), set up by the installer and
    removed again: nothing of it stays installed or counts as a refresh after a step."""
    from nemo_cudagraph_plugin.lightning.fp8_callback import Fp8TransposeRefresh

    m = make_fp8_module(["te2", "te1.8", "te2"])
    for i, p in enumerate((m.w0, m.w1, m.w2)):
        write_fp8_bytes(p, seed=10 + i, reset=False)
    owner = WritingOptimizer([m.w0])
    cb = Fp8TransposeRefresh(refresh_at_fit_start=at_fit_start)
    cb.on_fit_start(types.SimpleNamespace(optimizers=[owner]), m)
    assert verify_fp8_transposes(m).ok == at_fit_start
    assert [len(h.plan) for h in cb.handles] == [1] and cb.refreshes == 0
    assert len(owner._optimizer_step_post_hooks) == 1
    cb.teardown(None, m, "fit")
