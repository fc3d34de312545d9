"""Pipeline transpose alignment with real TransformerEngine (written against TE 2.20.2, Hopper).

(1) A stage of ``te.TransformerLayer`` with FP8 primary weights, several microbatches per step, an
    optimizer-style in-place FP8 write (``_reset_caches()`` + new bytes) after each step: without
    alignment TE computes every weight transpose inside microbatch 0 (counted by wrapping
    ``_create_transpose`` for the test); with ``align_fp8_transposes`` none is computed inside any
    microbatch and the transposes already match the new bytes before microbatch 0.
(2) Under a CUDA graph: byte write + refresh captured together; every replay leaves the transposes
    equal to the new bytes at the same addresses; the group barrier refuses to be captured.
(3) ``MicrobatchTimer`` on CUDA records with events only: no host sync per microbatch.
(4) The Lightning callback's optimizer post-hook captured with a graphed optimizer step: replays keep
    the transposes current with no Python; the same step captured without the hook reads stale ones.

Skipped without CUDA (conftest), without ``transformer_engine.pytorch`` or without FP8 support.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # conftest marks these skipped; do not import TE on a CPU machine
    pytest.skip("needs a CUDA device", allow_module_level=True)

te = pytest.importorskip(
    "transformer_engine.pytorch", reason="TransformerEngine is not installed (pip install '.[te]')"
)

from nemo_cudagraph_plugin.diagnostics import MicrobatchTimer  # noqa: E402
from nemo_cudagraph_plugin.fp8 import iter_fp8_params  # noqa: E402
from nemo_cudagraph_plugin.fp8.pipeline import TransposeAligner, align_fp8_transposes  # noqa: E402

_ok = te.is_fp8_available(return_reason=True)
_ok, _why = _ok if isinstance(_ok, tuple) else (_ok, "")
if not _ok:
    pytest.skip(f"FP8 not available: {_why}", allow_module_level=True)

MICROBATCHES = 3
STEPS = 3


def _recipe():
    from transformer_engine.common import recipe

    return recipe.Float8CurrentScaling()


def _autocast(rec):
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=rec)
    return te.fp8_autocast(enabled=True, fp8_recipe=rec)


def _stage(rec) -> nn.Module:
    init = te.quantized_model_init if hasattr(te, "quantized_model_init") else te.fp8_model_init
    torch.manual_seed(0)
    with init(enabled=True, recipe=rec):
        layers = [
            te.TransformerLayer(
                256,
                1024,
                8,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                params_dtype=torch.bfloat16,
                fuse_qkv_params=True,
            )
            for _ in range(2)
        ]
    return nn.Sequential(*layers).cuda()


def _rowwise_quantizer(device):
    import transformer_engine_torch as tex

    return te.Float8CurrentScalingQuantizer(
        tex.DType.kFloat8E4M3, device=device, rowwise=True, columnwise=False
    )


def _write(params, quantizer, noise=0.1):
    """A distributed optimizer's write: transposes marked invalid, new row-wise FP8 bytes copied in.

    The update is not a pure rescale (current scaling would give the same bytes), so every tensor's
    FP8 bytes really change.
    """
    with torch.no_grad():
        for p in params:
            w = p.dequantize()
            new = w + noise * w.std() * torch.randn_like(w)
            p._reset_caches()
            p.copy_(quantizer(new))


def _transpose_matches(p) -> bool:
    data = p._data.view(torch.uint8)
    return p._transpose is not None and torch.equal(p._transpose.view(torch.uint8), data.t().contiguous())


def _microbatches(model, rec, xs, state=None):
    for x in xs:
        if state is not None:
            state["inside"] = True
        with _autocast(rec):
            out = model(x)
        out.float().square().mean().backward()
        if state is not None:
            state["inside"] = False


def _count_create_transpose(monkeypatch, params, state):
    """Count ``_create_transpose`` calls on the FP8 *weights* while a microbatch runs (activations
    get transposes too; those are not what alignment is about)."""
    # By FP8 storage, so that an alias TE may make of a weight (detach/view) counts as that weight.
    storages = {p._data.untyped_storage().data_ptr() for p in params}
    cls = next(c for c in type(params[0]).__mro__ if "_create_transpose" in c.__dict__)
    orig = cls._create_transpose

    def counting(self, *a, **k):
        data = getattr(self, "_data", None)
        if state["inside"] and data is not None and data.untyped_storage().data_ptr() in storages:
            state["computed_inside"] += 1
        return orig(self, *a, **k)

    monkeypatch.setattr(cls, "_create_transpose", counting)


@pytest.mark.parametrize("mode", ["lazy", "aligned"])
def test_no_transpose_inside_microbatches_when_aligned(monkeypatch, mode):
    rec = _recipe()
    model = _stage(rec)
    params = list(iter_fp8_params(model))
    assert len(params) == 8, "2 layers x (qkv, proj, fc1, fc2) FP8 weights expected"
    xs = [torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16) for _ in range(MICROBATCHES)]
    quantizer = _rowwise_quantizer(params[0].device)
    _microbatches(model, rec, xs)  # warm-up: TE creates the transpose buffers
    state = {"inside": False, "computed_inside": 0}
    _count_create_transpose(monkeypatch, params, state)
    per_step = []
    for _ in range(STEPS):
        for p in model.parameters():
            p.grad = None
        old = [p._data.clone() for p in params]
        _write(params, quantizer)
        assert all(p._transpose_invalid for p in params), "precondition: the write invalidates the transposes"
        assert all(not torch.equal(p._data, o) for p, o in zip(params, old)), "precondition: new bytes"
        if mode == "aligned":
            assert align_fp8_transposes([model]) == len(params)
        before = state["computed_inside"]
        invalid_at_mb0 = [bool(p._transpose_invalid) for p in params]
        fresh_at_mb0 = [_transpose_matches(p) for p in params]
        _microbatches(model, rec, xs, state)
        per_step.append((state["computed_inside"] - before, sum(invalid_at_mb0), sum(fresh_at_mb0)))
    torch.cuda.synchronize()
    print(
        f"\n{mode}: (transposes computed inside microbatches, invalid at mb0, current at mb0) per step: {per_step}"
    )
    for computed, invalid, fresh in per_step:
        if mode == "aligned":
            assert computed == 0 and invalid == 0 and fresh == len(params)
        else:  # the check can fail: TE computes each one lazily inside the step's microbatches
            assert computed >= len(params) and invalid == len(params) and fresh == 0
    assert all(_transpose_matches(p) for p in params)


def test_refresh_captured_in_graph_follows_new_bytes():
    rec = _recipe()
    model = _stage(rec)
    params = list(iter_fp8_params(model))
    xs = [torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16)]
    _microbatches(model, rec, xs)
    quantizer = _rowwise_quantizer(params[0].device)
    bytes_a = [p._data.clone() for p in params]
    with (
        torch.no_grad()
    ):  # other weights entirely (a rescale would give the same bytes under current scaling)
        bytes_b = [quantizer(0.02 * torch.randn_like(p.dequantize()))._data.clone() for p in params]
    assert all(not torch.equal(a, b) for a, b in zip(bytes_a, bytes_b))
    staging = [torch.empty_like(p._data) for p in params]
    ptrs = [p._transpose.data_ptr() for p in params]
    aligner = TransposeAligner([model])
    timer = MicrobatchTimer("cuda")

    def step_tail():  # the end of a graphed optimizer step: new bytes land, then the refresh
        for p, s in zip(params, staging):
            p._data.copy_(s)
            p._reset_caches()
        aligner.refresh()

    for s, a in zip(staging, bytes_a):
        s.copy_(a)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step_tail()  # warm-up on a side stream, as torch.cuda.graph capture expects
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_tail()
        with timer.record("fwd", 0):
            pass
        with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture"):
            align_fp8_transposes([model], sync_group=True)
    assert timer.skipped_captured == 1 and timer.durations() == {}
    for src in (bytes_b, bytes_a, bytes_b):
        for s, x in zip(staging, src):
            s.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        for p, x in zip(params, src):
            assert torch.equal(p._data, x)
            assert _transpose_matches(p), "the replayed refresh must follow the new bytes"
    assert [p._transpose.data_ptr() for p in params] == ptrs


def test_timer_records_without_host_sync():
    timer = MicrobatchTimer("cuda")
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            timer.start_step()
            for mb in range(4):
                with timer.record("fwd", mb):
                    b = a @ a
                with timer.record("bwd", mb):
                    b = b @ a
    finally:
        torch.cuda.set_sync_debug_mode(0)
    rep = timer.report()
    print(f"\n{rep.summary()}")
    assert rep.device == "cuda" and rep.steps == 2 and rep.microbatches == 4
    assert all(v > 0 for v in rep.first_ms.values()) and all(v > 0 for v in rep.rest_ms.values())


class _WriteBack(torch.optim.Optimizer):
    """FP32 masters updated from static gradients, written into the FP8 weights in place (capturable)."""

    def __init__(self, fp8_params, lr):
        with torch.no_grad():
            masters = [p.dequantize().float().clone() for p in fp8_params]
        super().__init__(masters, {"lr": lr})
        self.fp8, self.masters = fp8_params, masters
        self.grads = [torch.zeros_like(m) for m in masters]
        self.quantizer = _rowwise_quantizer(masters[0].device)

    @torch.no_grad()
    def step(self, closure=None):
        for m, g in zip(self.masters, self.grads):
            m.add_(g, alpha=-self.defaults["lr"])
        _write_from(self.fp8, self.masters, self.quantizer)


def _write_from(params, masters, quantizer):
    for p, m in zip(params, masters):
        p._reset_caches()
        p.copy_(quantizer(m.to(p.dtype)))


def _capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up on a side stream, as torch.cuda.graph capture expects
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _replay_and_check(graph, opt, params):
    current = []
    for _ in range(3):
        for g in opt.grads:
            g.normal_()
        before = [p._data.clone() for p in params]
        graph.replay()
        torch.cuda.synchronize()
        assert any(not torch.equal(p._data, b) for p, b in zip(params, before)), (
            "each replay writes new bytes"
        )
        current.append(sum(_transpose_matches(p) for p in params))
    return current


def test_lightning_callback_refresh_is_captured_with_the_optimizer_step():
    from types import SimpleNamespace

    from nemo_cudagraph_plugin.integrations.megatron.callbacks import AlignPipelineTransposes

    rec = _recipe()
    model = _stage(rec)
    params = list(iter_fp8_params(model))
    _microbatches(model, rec, [torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16)])
    opt = _WriteBack(params, lr=1e-2)
    cb = AlignPipelineTransposes(model_chunks=[model])
    trainer = SimpleNamespace(optimizers=[opt], strategy=SimpleNamespace(model=None), global_step=0)
    cb.on_fit_start(trainer, model)
    for g in opt.grads:
        g.normal_()
    opt.step()  # eager: the post-hook refreshes right after the step
    assert cb.refreshes == 1 and all(_transpose_matches(p) for p in params)

    graph = _capture(opt.step)  # warm-up + capture: the hook runs twice in Python, once inside the capture
    calls = cb.refreshes
    ptrs = [p._transpose.data_ptr() for p in params]
    current = _replay_and_check(graph, opt, params)
    print(f"\ncallback captured: transposes current after each replay {current} of {len(params)}")
    assert current == [len(params)] * 3, "the refresh must replay with the optimizer step"
    assert cb.refreshes == calls, "no Python runs on replay: the refresh is part of the graph"
    assert [p._transpose.data_ptr() for p in params] == ptrs

    # Control (the check can fail): the same step captured without the callback's hook reads stale transposes.
    cb.on_fit_end(trainer, model)
    assert cb._handles == []
    stale_graph = _capture(opt.step)
    current = _replay_and_check(stale_graph, opt, params)
    print(f"without the hook: transposes current after each replay {current} of {len(params)}")
    assert all(c < len(params) for c in current)
