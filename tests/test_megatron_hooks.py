"""CPU tests of the Megatron-core hooks in ``nemo_cudagraph_plugin.integrations.megatron`` and their Lightning callbacks.

* The FP8 completion-path refresh (``install_param_gather_refresh``) on a stand-in of megatron-core 0.16.1's
  DDP bucket groups: the same control flow as ``_ParamAndGradBucketGroup.start_param_sync`` /
  ``finish_param_sync`` and ``DistributedDataParallel.start_param_sync`` (param_and_grad_buffer.py:250-362,
  distributed_data_parallel.py:460-511), with the FP8 test doubles of ``tests/fp8_doubles.py`` as parameters. The
  all-gather writes the bytes without invalidating the transposes, as TE does for megatron-core when
  ``manual_post_all_gather_processing=True``; the "backward" reads the transposes the way a graph does.
* ``@pytest.mark.nemo`` (``.venv-nemo``, real megatron-core 0.16.1 and NeMo 2.7.3): the capability detection reads
  the real code; ``full_iteration_forward_backward`` refuses what would not engage; the NeMo step callback on a
  real ``MegatronStep`` and ``CallbackConnector``.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import warnings

import fp8_doubles
import pytest
import torch
from torch import nn

from nemo_cudagraph_plugin.integrations.megatron import (
    MegatronCapabilities,
    ParamGatherRefresh,
    find_megatron_ddp,
    fused_wgrad_graph_safety,
    install_param_gather_refresh,
)

REQUIRE_NEMO = os.environ.get("NCG_REQUIRE_NEMO") == "1"


def _need(module: str):
    if REQUIRE_NEMO:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed (ci/stages.sh nemo builds .venv-nemo)")


def caps(rebuild: bool = True, forced: bool = False, te_hook: bool = True) -> MegatronCapabilities:
    return MegatronCapabilities(
        version="fake", te_post_all_gather_processing=te_hook, rebuild_after_overlapped_gather=rebuild,
        rebuild_after_sync_gather=rebuild, rebuild_after_forced_gather=forced,
        replay_sets_grad_added_to_main_grad=True, ddp_hooks_skip_megatron_capture=True, full_cuda_graph_wrapper=True,
    )


# ------------------------------------------------------------------------------------------------------------
# A stand-in of megatron-core 0.16.1's DDP parameter all-gather
# ------------------------------------------------------------------------------------------------------------


class DDPConfig:
    def __init__(self, overlap: bool):
        self.overlap_param_gather = overlap
        self.use_distributed_optimizer = True


class Bucket:
    def __init__(self, params):
        self.params_list = list(params)
        self.params = set(self.params_list)


class BucketGroup:
    """``_ParamAndGradBucketGroup``'s all-gather state machine. ``rebuild``: megatron-core calls
    ``post_all_gather_processing`` (TE's ``_create_transpose``) after a completed overlapped all-gather."""

    def __init__(self, params, cfg, log, rebuild):
        self.buckets = [Bucket(params)]
        self.ddp_config = cfg
        self.log = log
        self.rebuild = rebuild
        self.param_gather_handle = None
        self.param_gather_dispatched = False
        self.next_param_gather_bucket_group = None
        self.step = 0
        self.lands = 0

    def _land(self):  # new FP8 bytes arrive; TE was told not to invalidate the transposes (manual post-processing)
        self.lands += 1
        for i, p in enumerate(self.buckets[0].params_list):
            fp8_doubles.write_fp8_bytes(p, seed=self.lands * 31 + i, reset=False)
        self.log.append(("land", self.step))

    def start_param_sync(self, force_sync=False):
        if force_sync:
            if self.param_gather_handle is not None:
                self._land()
                self.param_gather_handle = None
                return
        else:
            assert self.param_gather_handle is None
        if self.ddp_config.overlap_param_gather and not force_sync:
            self.param_gather_handle = "in flight"
            self.log.append(("dispatch", self.step))
        else:
            self._land()
            self.log.append(("sync_gather" if not force_sync else "forced_gather", self.step))
        self.param_gather_dispatched = True

    def finish_param_sync(self, skip_next_bucket_dispatch=False):
        if not self.param_gather_dispatched:
            self.start_param_sync()
        if self.param_gather_handle is not None:
            self._land()
            self.param_gather_handle = None
            if self.next_param_gather_bucket_group is not None and not skip_next_bucket_dispatch:
                if not self.next_param_gather_bucket_group.param_gather_dispatched:
                    self.next_param_gather_bucket_group.start_param_sync()
            if self.rebuild:
                for p in self.buckets[0].params_list:
                    p._create_transpose()
                self.log.append(("megatron_rebuild", self.step))


class FakeDDP(nn.Module):
    """``DistributedDataParallel`` with two bucket groups of FP8 doubles."""

    def __init__(self, overlap=True, rebuild=True, rebuild_sync=True, n=4):
        super().__init__()
        self.log: list = []
        tlog = fp8_doubles.TransposeLog()
        self.ps = nn.ParameterList(
            [fp8_doubles.make_fp8_param("te2", (8, 4), fp8_name=f"w{i}", log=tlog, seed=i) for i in range(n)]
        )
        self.ddp_config = DDPConfig(overlap)
        half = n // 2
        self.bucket_groups = [BucketGroup(list(self.ps)[half:], self.ddp_config, self.log, rebuild),
                              BucketGroup(list(self.ps)[:half], self.ddp_config, self.log, rebuild)]
        self.bucket_groups[0].next_param_gather_bucket_group = self.bucket_groups[1]
        self.expert_parallel_bucket_groups = []
        self.rebuild_sync = rebuild_sync
        self.overlap_param_gather_with_optimizer_step = False

    def start_param_sync(self, *unused, force_sync=False, force_dispatch=False):
        for g in self.bucket_groups:
            g.start_param_sync(force_sync=force_sync)
            if not self.ddp_config.overlap_param_gather and self.rebuild_sync:
                for p in g.buckets[0].params_list:
                    p._create_transpose()

    def train_step(self, step):
        """Forward pre-hooks finish each group's all-gather (overlap) or nothing; backward reads transposes as a
        captured graph would. Returns the names of the stale transposes the backward read."""
        for g in self.bucket_groups:
            g.step = step
        if self.ddp_config.overlap_param_gather:
            for g in self.bucket_groups:  # megatron's forward pre-hook, per module
                g.finish_param_sync()
        self.log.append(("backward", step))
        stale = [p.fp8_name for p in self.ps if not torch.equal(fp8_doubles.graph_read(p),
                                                                fp8_doubles.expected_transpose(p))]
        for g in self.bucket_groups:  # finish_grad_sync
            g.param_gather_dispatched = False
        if not self.ddp_config.overlap_param_gather:  # the optimizer's step_with_ready_grads
            self.start_param_sync()
        return stale


def test_megatron_rebuilds_itself_so_the_refresh_is_inert_and_nothing_is_forced():
    ddp = FakeDDP(overlap=True, rebuild=True)
    h = install_param_gather_refresh([ddp], capabilities=caps(rebuild=True))
    assert h.paths == {"forced"}  # only the gap megatron-core leaves
    for step in range(3):
        assert ddp.train_step(step) == []
    assert h.refreshed == {}  # no double work on ordinary steps
    assert not any(kind == "forced_gather" for kind, _ in ddp.log)  # every all-gather was dispatched, overlapped
    assert [k for k, _ in ddp.log].count("dispatch") == 6


def test_forced_sync_gap_is_found_and_closed_on_the_completion_path():
    # NeMo's save_checkpoint forces the all-gather after an optimizer step; megatron-core 0.16.1 then rebuilds
    # nothing, and the next forward's pre-hook finds nothing pending: the backward reads stale transposes.
    ddp = FakeDDP(overlap=True, rebuild=True)
    assert ddp.train_step(0) == []
    ddp.start_param_sync(force_sync=True)
    assert sorted(ddp.train_step(1)) == ["w0", "w1", "w2", "w3"]  # the check can fail: the gap is real here
    ddp = FakeDDP(overlap=True, rebuild=True)
    h = install_param_gather_refresh([ddp], capabilities=caps(rebuild=True))
    assert ddp.train_step(0) == []
    ddp.start_param_sync(force_sync=True)
    assert ddp.train_step(1) == []
    assert h.refreshed == {"forced": 4} and h.calls == {"forced": 1}
    assert ddp.train_step(2) == [] and h.refreshed == {"forced": 4}  # ordinary steps: megatron-core again


def test_older_megatron_gets_the_refresh_when_each_bucket_completes():
    ddp = FakeDDP(overlap=True, rebuild=False)
    h = install_param_gather_refresh([ddp], capabilities=caps(rebuild=False))
    assert h.paths == {"overlapped", "sync", "forced"} and h.plans == 2
    for step in range(2):
        assert ddp.train_step(step) == []
    assert h.refreshed == {"overlapped": 8}  # 4 parameters, 2 steps, each at its own bucket's completion
    kinds = [k for k, s in ddp.log if s == 1]
    assert kinds == ["dispatch", "land", "dispatch", "land", "backward"]  # no forced sync: overlap kept
    ddp2 = FakeDDP(overlap=True, rebuild=False)
    assert ddp2.train_step(0) != []  # without the refresh that megatron-core reads stale transposes


def test_sync_all_gather_path_only_where_megatron_does_not_rebuild():
    ddp = FakeDDP(overlap=False, rebuild_sync=True)
    h = install_param_gather_refresh([ddp], capabilities=caps(rebuild=True))
    assert "start_param_sync" not in ddp.__dict__  # nothing to wrap: megatron-core rebuilds after a sync gather
    for step in range(2):
        assert ddp.train_step(step) == []
    ddp = FakeDDP(overlap=False, rebuild_sync=False)
    h = install_param_gather_refresh([ddp], capabilities=caps(rebuild=False))
    for step in range(2):
        assert ddp.train_step(step) == []
    assert h.refreshed == {"sync": 8}


def test_remove_and_bad_input():
    ddp = FakeDDP()
    original = ddp.start_param_sync
    h = install_param_gather_refresh([ddp], capabilities=caps(rebuild=False))
    assert ddp.start_param_sync != original and "finish_param_sync" in ddp.bucket_groups[0].__dict__
    h.remove()
    h.remove()
    assert "start_param_sync" not in ddp.__dict__ and "finish_param_sync" not in ddp.bucket_groups[0].__dict__
    assert not h.active
    with pytest.raises(TypeError, match="not Megatron-core DistributedDataParallel"):
        install_param_gather_refresh([nn.Linear(2, 2)])
    wrapper = types.SimpleNamespace(module=types.SimpleNamespace(module=ddp))  # NeMo: MegatronParallel[i].module
    assert find_megatron_ddp(wrapper) is ddp
    plain = FakeDDP(n=0)
    h = install_param_gather_refresh([plain], capabilities=caps(rebuild=False))
    assert not h.active  # no FP8 parameter: nothing wrapped


def test_fused_wgrad_safety_reasons():
    ok, why = fused_wgrad_graph_safety(impl="local", full_iteration=False, capabilities=caps())
    assert ok and "restores grad_added_to_main_grad" in why
    old = MegatronCapabilities(**{**caps().__dict__, "replay_sets_grad_added_to_main_grad": False})
    ok, why = fused_wgrad_graph_safety(impl="local", full_iteration=False, capabilities=old)
    assert not ok and "#1279" in why and "_CudagraphReplayNode.backward" in why
    ok, why = fused_wgrad_graph_safety(impl="local", full_iteration=True, capabilities=old)
    assert ok and "during capture" in why
    assert fused_wgrad_graph_safety(impl="local", full_iteration=False, capabilities=None)[0] is False


# ------------------------------------------------------------------------------------------------------------
# What the installed megatron-core does: version gates and probes, the safe choice when unsure
# ------------------------------------------------------------------------------------------------------------


def _fake_megatron_core(monkeypatch, version, *, force_sync=True, full_graph=True):
    """Stand-in ``megatron.core`` modules with only the public attributes the detection reads."""
    from nemo_cudagraph_plugin.core import warn

    monkeypatch.setattr(warn, "_WARNED", set())

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)

    if force_sync:
        class Group:
            def start_param_sync(self, force_sync: bool = False): ...
            def finish_param_sync(self, skip_next_bucket_dispatch: bool = False): ...

        class DDP:
            def start_param_sync(self, *unused, force_sync: bool = False): ...
    else:
        class Group:
            def start_param_sync(self): ...
            def finish_param_sync(self): ...

        class DDP:
            def start_param_sync(self, *unused): ...

    module("megatron")
    module("megatron.core", __version__=version)
    module("megatron.core.package_info", __version__=version)
    module("megatron.core.distributed")
    module("megatron.core.distributed.param_and_grad_buffer", _ParamAndGradBucketGroup=Group)
    module("megatron.core.distributed.distributed_data_parallel", DistributedDataParallel=DDP)
    module("megatron.core.fp8_utils", te_post_all_gather_processing=lambda *a, **k: None)
    if full_graph:
        module("megatron.core.full_cuda_graph", FullCudaGraphWrapper=object)
    else:
        monkeypatch.delitem(sys.modules, "megatron.core.full_cuda_graph", raising=False)


def test_capabilities_of_a_tested_megatron_core_come_from_its_version(monkeypatch):
    from nemo_cudagraph_plugin.integrations.megatron import megatron_capabilities

    _fake_megatron_core(monkeypatch, "0.16.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tested version: no warning
        c = megatron_capabilities()
    assert c.tested and c.version == "0.16.1" and c.te_post_all_gather_processing and c.full_cuda_graph_wrapper
    assert c.megatron_rebuilds("overlapped") and c.megatron_rebuilds("sync") and not c.megatron_rebuilds("forced")
    assert c.replay_sets_grad_added_to_main_grad and c.per_layer_input_buffer_reuse
    assert c.where["per_layer_input_buffer_reuse"] == "megatron/core/transformer/cuda_graphs.py:995"
    assert fused_wgrad_graph_safety(impl="local", full_iteration=False, capabilities=c)[0]


@pytest.mark.parametrize("version, force_sync, why", [
    ("0.18.0", True, "outside the tested series (0.16.x)"),
    ("0.16.1", False, "do not have the tested parameters"),
    ("not a version", True, "could not be read"),
])
def test_capabilities_fail_closed_when_unsure_and_say_so_once(monkeypatch, version, force_sync, why):
    from nemo_cudagraph_plugin.integrations.megatron import megatron_capabilities, per_layer_refusal

    _fake_megatron_core(monkeypatch, version, force_sync=force_sync)
    with pytest.warns(UserWarning, match="assuming the safe choice") as record:
        c = megatron_capabilities()
        again = megatron_capabilities()
    assert len(record) == 1 and why in str(record[0].message)
    assert c == again and not c.tested and c.where == {}
    # Every all-gather path is refreshed by us, fused wgrad accumulation is off under per-layer graphs, and the
    # whole-iteration graph is preferred to per-layer graphs.
    assert not any(c.megatron_rebuilds(p) for p in ("overlapped", "sync", "forced"))
    safe, reason = fused_wgrad_graph_safety(impl="local", full_iteration=False, capabilities=c)
    assert not safe and "not a tested version" in reason
    assert c.per_layer_input_buffer_reuse and "not a version whose per-layer CUDA graphs were checked" in (
        per_layer_refusal(c) or "")
    ddp = FakeDDP(overlap=True)
    handle = install_param_gather_refresh([ddp], capabilities=c)
    assert handle.paths == {"overlapped", "sync", "forced"}
    handle.remove()


def test_capabilities_without_the_whole_iteration_graph_keep_per_layer_graphs(monkeypatch):
    from nemo_cudagraph_plugin.integrations.megatron import megatron_capabilities, per_layer_refusal

    _fake_megatron_core(monkeypatch, "0.13.0", full_graph=False)
    with pytest.warns(UserWarning, match="assuming the safe choice"):
        c = megatron_capabilities()
    assert not c.full_cuda_graph_wrapper and not c.per_layer_input_buffer_reuse and per_layer_refusal(c) is None


# ------------------------------------------------------------------------------------------------------------
# Lightning callbacks on Megatron chunks
# ------------------------------------------------------------------------------------------------------------


class _NoStepHooks:
    """NeMo's McoreDistributedOptimizer: no torch.optim.Optimizer.__init__, no step hooks."""


def test_align_pipeline_transposes_on_megatron_chunks_forces_nothing_and_needs_no_step_hook(monkeypatch):
    from nemo_cudagraph_plugin.integrations.megatron import capabilities as mod
    from nemo_cudagraph_plugin.integrations.megatron.callbacks import AlignPipelineTransposes

    monkeypatch.setattr(mod, "megatron_capabilities", lambda: caps(rebuild=True))
    chunks = nn.ModuleList([FakeDDP(), FakeDDP()])
    trainer = types.SimpleNamespace(optimizers=[_NoStepHooks()], strategy=types.SimpleNamespace(model=chunks),
                                    global_step=0)
    cb = AlignPipelineTransposes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning, no "no FP8" warning
        cb.on_fit_start(trainer, nn.Linear(1, 1))
    assert cb.hook is None and isinstance(cb.gather_refresh, ParamGatherRefresh) and not cb.fallback
    assert cb._handles == []
    for c in chunks:
        assert c.train_step(0) == []
        c.start_param_sync(force_sync=True)
        assert c.train_step(1) == []
    trainer.global_step = 1
    cb.on_train_batch_end(trainer, None, None, None, 0)
    # The only forced all-gathers are the ones this test made (2 chunks x 2 bucket groups): the callback forced none.
    assert [k for c in chunks for k, _ in c.log].count("forced_gather") == 4
    assert cb.gather_refresh.refreshed == {"forced": 8}
    cb.teardown(trainer, None, "fit")
    assert all("start_param_sync" not in c.__dict__ for c in chunks)


def test_fp8_param_gather_refresh_callback(monkeypatch):
    from nemo_cudagraph_plugin.integrations.megatron import capabilities as mod
    from nemo_cudagraph_plugin.integrations.megatron.callbacks import Fp8ParamGatherRefresh

    monkeypatch.setattr(mod, "megatron_capabilities", lambda: caps(rebuild=True))
    ddp = FakeDDP()
    chunk = types.SimpleNamespace(module=ddp)  # as in MegatronParallel
    chunks = nn.ModuleList([nn.Module()])
    chunks[0].module = ddp
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(model=chunks))
    cb = Fp8ParamGatherRefresh()
    cb.on_fit_start(trainer, nn.Linear(1, 1))
    assert cb.handle is not None and cb.handle.paths == {"forced"}
    ddp.start_param_sync(force_sync=True)
    assert cb.handle.refreshed == {"forced": 4}
    cb.teardown(trainer, None, "fit")
    assert "start_param_sync" not in ddp.__dict__
    assert find_megatron_ddp(chunk) is ddp
    with pytest.warns(UserWarning, match="no Megatron-core DistributedDataParallel chunk"):
        Fp8ParamGatherRefresh(model_chunks=[nn.Linear(2, 2)]).on_fit_start(trainer, nn.Linear(1, 1))


# ------------------------------------------------------------------------------------------------------------
# Real megatron-core 0.16.1 / NeMo 2.7.3 (.venv-nemo)
# ------------------------------------------------------------------------------------------------------------

nemo_only = pytest.mark.nemo


@nemo_only
def test_capabilities_read_from_megatron_core_0161():
    _need("megatron.core")
    from nemo_cudagraph_plugin.integrations.megatron import megatron_capabilities

    c = megatron_capabilities()
    assert c is not None and c.version == "0.16.1"
    assert c.rebuild_after_overlapped_gather and c.rebuild_after_sync_gather
    assert not c.rebuild_after_forced_gather  # the gap NeMo's checkpoint save falls into
    assert c.replay_sets_grad_added_to_main_grad and c.ddp_hooks_skip_megatron_capture and c.full_cuda_graph_wrapper
    assert c.where["rebuild_after_overlapped_gather"] == "megatron/core/distributed/param_and_grad_buffer.py:362"
    assert c.where["rebuild_after_sync_gather"] == "megatron/core/distributed/distributed_data_parallel.py:511"
    assert c.where["replay_sets_grad_added_to_main_grad"] == "megatron/core/transformer/cuda_graphs.py:657"
    # the forward capture returns its input buffers to the reuse pool (the likely cause of the per-layer divergence)
    assert c.per_layer_input_buffer_reuse
    assert c.where["per_layer_input_buffer_reuse"] == "megatron/core/transformer/cuda_graphs.py:995"
    te = importlib.util.find_spec("transformer_engine") is not None
    assert c.te_post_all_gather_processing is te  # this CPU venv has no TE: megatron-core found none
    assert c.megatron_rebuilds("overlapped") is te


@nemo_only
def test_full_iteration_forward_backward_refuses_what_would_not_engage():
    _need("megatron.core")
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_cudagraph_plugin.integrations.megatron import (
        apply_megatron_graph_fields,
        full_iteration_forward_backward,
    )

    def cfg(**kw):
        return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **kw)

    with pytest.raises(ValueError, match=r"cuda_graph_scope=\[\]: set it to \['full_iteration'\]"):
        full_iteration_forward_backward(lambda **kw: None, config=cfg(cuda_graph_impl="local"))
    with pytest.raises(ValueError, match="cuda_graph_impl='transformer_engine'"):
        full_iteration_forward_backward(lambda **kw: None, config=cfg(cuda_graph_impl="transformer_engine"))
    good = cfg()
    apply_megatron_graph_fields(good, scope=["full_iteration"], capabilities=None)
    good.__post_init__()
    ddp = types.SimpleNamespace(ddp_config=DistributedDataParallelConfig(check_for_nan_in_grad=True),
                                bucket_groups=[], start_param_sync=lambda **kw: None)
    with pytest.raises(ValueError, match="check_for_nan_in_grad.*cannot be captured"):
        full_iteration_forward_backward(lambda **kw: None, config=good, model_chunks=[ddp])
    with pytest.raises(ValueError, match="warmup_steps=0"):
        full_iteration_forward_backward(lambda **kw: None, config=good, warmup_steps=0)


@nemo_only
def test_full_iteration_callback_on_a_real_nemo_megatron_step(monkeypatch):
    _need("nemo.lightning")
    from nemo.lightning.megatron_parallel import CallbackConnector, MegatronStep

    from nemo_cudagraph_plugin.integrations.megatron import callbacks as pc

    built = []

    def wrapper(**kwargs):
        wrapper.calls.append(kwargs)
        return ["loss"]

    wrapper.calls = []

    def fake_builder(forward_backward_func=None, *, config, model_chunks=None, warmup_steps=None):
        # FullCudaGraphWrapper needs a CUDA stream; the GPU bed runs the real one. Here: the wiring.
        built.append((config, list(model_chunks), warmup_steps))
        return wrapper

    monkeypatch.setattr(pc, "full_iteration_forward_backward", fake_builder)
    # NeMo's distillation shape hook reads megatron's pipeline group, which needs torch.distributed: not here.
    monkeypatch.setattr(MegatronStep, "adjust_tensor_shapes_fn", None)
    chunk = types.SimpleNamespace(config=object())
    pipeline = types.SimpleNamespace(pipeline=chunk, trainer=None)
    cb = pc.MegatronFullIterationGraph(warmup_steps=3)
    connector = CallbackConnector().add(cb)  # what MegatronStrategy does with every trainer callback
    assert cb in connector.callbacks["on_megatron_step_start"]

    def step(forward_only):
        return MegatronStep(pipeline=pipeline, data=[iter([{}])], forward_step_func=lambda *a: None,
                            forward_only=forward_only, micro_batch_size=1, seq_length=8, num_microbatches=2)

    val = connector.transform_event("on_megatron_step_start", step(True))
    assert "forward_backward_func" not in val.__dict__  # validation stays eager (NeMo's own function)
    train = connector.transform_event("on_megatron_step_start", step(False))
    assert train.forward_backward_func is wrapper  # overrides MegatronStep's cached_property
    assert train() == ["loss"]  # NeMo's MegatronStep.__call__ now calls the whole-iteration wrapper
    kw = wrapper.calls[0]
    assert kw["num_microbatches"] == 2 and kw["forward_only"] is False and kw["model"] is chunk
    connector.transform_event("on_megatron_step_start", step(False))
    assert len(built) == 1 and built[0] == (chunk.config, [chunk], 3) and cb.wrapped_steps == 2
