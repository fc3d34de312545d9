"""Whole-step capture on a real GPU: parity with eager, Lightning semantics, guards, errors."""

from __future__ import annotations

import copy
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from _lightning_utils import CapturableEager, fit, loader, make_module, max_rel

from nemo_cudagraph_plugin import CaptureError, CudaGraphCallback, NonFiniteError
from nemo_cudagraph_plugin.core import CaptureConfig, CaptureEngine

STEPS = 100


def _graphed(steps=STEPS, module_kw=None, cb_kw=None, **kw):
    cb = CudaGraphCallback(**(cb_kw or {}))
    trainer, rec = fit(make_module(**(module_kw or {})), [cb], steps, **kw)
    return cb, trainer, rec


def _eager(steps=STEPS, module_kw=None, capturable=True, math=None, **kw):
    cbs = [CapturableEager(math)] if capturable else []
    return fit(make_module(**(module_kw or {})), cbs, steps, **kw)


def test_fast_adam_trains_as_torchs_capturable_adamw_bit_for_bit():
    # verify_steps: the first graphed steps also run torch's own step eagerly, compared bit for bit (ParityError)
    # fast_adam replaces torch's capturable update: the capturable optimizer math (the default runs the user's own)
    cb, _, g = _graphed(cb_kw={"fast_adam": True, "verify_steps": 3, "optimizer_math": "capturable"})
    _, e = _eager(math="capturable")
    assert cb.stats.verified_steps == 3
    fast = cb.step_runner.adapter.fast_adam
    assert cb.stats.fast_adam_unused == "" and fast.counted_groups == 2 * cb.stats.captures and not fast.torch_groups
    assert fast.tail is not None  # the Triton tail, where Triton runs
    assert cb.stats.replays >= STEPS - 5, cb.stats.summary()
    gl, el = g.loss_tensor(), e.loss_tensor()
    assert torch.equal(gl, el), f"fast_adam graph vs eager(capturable) max rel diff {max_rel(gl, el):.3e}"


def _adam_pair(shapes, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = [torch.randn(s, device="cuda", generator=g) for s in shapes]
    out = []
    for _ in range(2):
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        lr = torch.tensor(1e-3, device="cuda")
        opt = torch.optim.AdamW([{"params": ps[:-8], "weight_decay": 0.1}, {"params": ps[-8:], "weight_decay": 0.0}],
                                lr=lr, betas=(0.9, 0.95), foreach=True, capturable=True)
        out.append((ps, opt))
    return out


def _kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")


@pytest.mark.parametrize("fused_tail", [False, True], ids=["foreach-tail", "triton-tail"])
def test_group_scalar_adam_update_replayed_in_a_cuda_graph_is_torchs_capturable_step_bit_for_bit(fused_tail):
    from nemo_cudagraph_plugin.core.adam_step import GroupScalarAdam

    # an LLM-like list: many square matrices, norms, an embedding
    shapes = [(512, 512)] * 48 + [(2048, 512)] * 8 + [(512,)] * 8
    (ref_ps, ref), (ps, opt) = _adam_pair(shapes)
    grads = [[torch.randn_like(p) * (k + 1) for p in ps] for k in range(6)]
    for (xs, o) in ((ref_ps, ref), (ps, opt)):
        for p, gr in zip(xs, grads[0]):
            p.grad = gr.clone()
        o.step()  # creates the state, as the warm-up does
    fast = GroupScalarAdam(opt, fused_tail=fused_tail)
    assert fast.reason is None and (fast.tail is not None) == fused_tail
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with fast.during_capture(), torch.cuda.graph(graph):
        opt.step()
    assert "step" not in opt.__dict__ and fast.counted_groups == 2
    for k in range(1, 6):
        for p, q, gr in zip(ref_ps, ps, grads[k]):
            p.grad.copy_(gr)
            q.grad.copy_(gr)
        ref.step()
        graph.replay()
    torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(ref_ps, ps)):
        assert torch.equal(p, q), f"parameter {i}"
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref.state[p][key], opt.state[q][key]), f"parameter {i} {key}"
    # torch divides the moments per parameter twice; the group-scalar update once per group, twice
    def eager_fast():
        with fast.during_capture():
            opt.step()
    theirs, ours = _kernels(ref.step), _kernels(eager_fast)
    print(f"\nFAST_ADAM kernels per step: torch {theirs}, group-scalar {ours} ({len(shapes)} parameters, "
          f"fused tail {fused_tail})")
    assert ours <= theirs - len(shapes)  # 2 x (parameters - 2) fewer, less any extra chunk launches


def test_parity_bitwise_dropout_off():
    cb, trainer, g = _graphed()
    _, e = _eager()
    _, v = _eager(capturable=False)
    assert cb.stats.replays >= STEPS - 5, cb.stats.summary()
    assert cb.stats.captures == 1
    gl, el, vl = g.loss_tensor(), e.loss_tensor(), v.loss_tensor()
    assert torch.isfinite(gl).all()
    assert torch.equal(gl, el), f"graph vs eager(capturable) max rel diff {max_rel(gl, el):.3e}"
    # Plain eager AdamW (capturable=False) computes the bias correction on the host in float64;
    # the capturable kernels do it on the device in float32, so the bits differ slightly.
    print(f"\nPARITY tiny 100 steps: graph==eager(capturable) bitwise; vs vanilla eager max rel {max_rel(gl, vl):.3e}")
    assert max_rel(gl, vl) < 1e-3
    # global_step advanced by one per replay, as in eager mode
    assert g.global_steps == e.global_steps == list(range(1, STEPS + 1))
    # the logged value is this step's loss, re-emitted after every replay
    assert torch.equal(torch.stack(g.logged).cpu().float(), gl)


class _MemsetNodes(pl.Callback):
    """Memset nodes left in each live graph of ``cb``, read mid-fit (the graphs are freed when fit ends)."""

    def __init__(self, cb, at: int) -> None:
        self.cb, self.at, self.counts = cb, at, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from nemo_cudagraph_plugin.core import _cuda_nodes

        if batch_idx == self.at:
            cache = self.cb.step_runner.engine.cache
            self.counts = [_cuda_nodes.node_types(cache.peek(k).graph.raw_cuda_graph())["memset"] for k in cache.keys()]


@pytest.mark.parametrize("as_kernels", [True, False])
def test_memset_nodes_run_as_kernels_and_training_equals_eager_bitwise(as_kernels):
    """The attention (cuDNN) and the split reductions of the step zero buffers with memsets; captured graphs run
    them as fill kernels (memsets_as_kernels, the default) and training stays bitwise eager's."""
    from nemo_cudagraph_plugin.core import _cuda_nodes

    if _cuda_nodes.unavailable() is not None:
        pytest.skip(_cuda_nodes.unavailable())
    steps = 30
    cb = CudaGraphCallback(memsets_as_kernels=as_kernels)
    probe = _MemsetNodes(cb, at=steps - 2)  # a graph kept as memsets is not kept as a cudaGraph_t: not read
    _, g = fit(make_module(), [cb, probe] if as_kernels else [cb], steps)
    _, e = _eager(steps)
    assert torch.equal(g.loss_tensor(), e.loss_tensor())
    if as_kernels:
        assert cb.stats.memsets_rewritten > 0, cb.stats
        assert probe.counts == [0]
    else:
        assert cb.stats.memsets_rewritten == 0


def _offset_batch(batch: dict) -> dict:
    """Each tensor moved to a contiguous view 8 bytes into a fresh buffer (not 16-byte aligned)."""
    out = {}
    for k, t in batch.items():
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        out[k] = view
    return out


@pytest.mark.parametrize("case", ["io-in-graph", "unaligned-batch", "copies-around"])
def test_graph_copies_batch_and_outputs_itself_and_training_equals_eager_bitwise(case):
    """io_in_graph (the default): the graph's own copy nodes read each batch where it landed and write the outputs
    into memory allocated for the step; bitwise eager's, also for a batch 8 bytes off 16-byte alignment, and the
    same as copies launched around the replay (io_in_graph=False)."""
    from nemo_cudagraph_plugin.core import _cuda_nodes

    if _cuda_nodes.unavailable() is not None:
        pytest.skip(_cuda_nodes.unavailable())
    steps = 30
    def module():
        m = make_module()
        if case == "unaligned-batch":
            m.on_after_batch_transfer = lambda batch, dataloader_idx: _offset_batch(batch)
        return m

    cb = CudaGraphCallback(io_in_graph=case != "copies-around")
    _, g = fit(module(), [cb], steps)
    _, e = fit(module(), [CapturableEager()], steps)
    assert torch.equal(g.loss_tensor(), e.loss_tensor())
    assert len(set(g.loss_tensor().tolist())) > steps // 2, "outputs alias one buffer"
    assert cb.stats.replays >= steps - 5
    assert cb.stats.graphs_with_io_nodes == (0 if case == "copies-around" else cb.stats.captures), cb.stats


def test_kept_loss_is_a_per_step_value():
    _, _, g = _graphed(steps=20)
    losses = g.loss_tensor()
    assert len(set(losses.tolist())) > 15, "losses repeat: outputs alias the graph's static buffer"


def test_dropout_masks_differ_per_replay_and_match_eager():
    _, _, g = _graphed(steps=60, module_kw={"dropout": 0.1})
    _, e = _eager(steps=60, module_kw={"dropout": 0.1})
    gl, el = g.loss_tensor(), e.loss_tensor()
    assert len(set(gl.tolist())) == len(gl)
    # Same generator, same Philox offsets per step: the graphed run draws eager's masks.
    print(f"\nDROPOUT 60 steps: graph vs eager max rel {max_rel(gl, el):.3e}; mean last 20 {gl[-20:].mean():.4f} vs {el[-20:].mean():.4f}")
    assert abs(float(gl[-20:].mean() - el[-20:].mean())) < 0.05 * float(el[-20:].mean())


def test_engine_dropout_rng_advances_framework_free():
    dev = torch.device("cuda")
    x = torch.ones(4096, device=dev)

    def step(b):
        return torch.nn.functional.dropout(b, 0.5).sum()

    torch.manual_seed(3)
    eager = [float(step(x)) for _ in range(6)]
    torch.manual_seed(3)
    eng = CaptureEngine(CaptureConfig(warmup_steps=2, nan_guard=False), dev, [])
    graphed = [float(eng.step(x, 0, step)) for _ in range(6)]
    assert eng.stats.captures == 1 and eng.stats.replays == 3
    assert graphed == eager, (graphed, eager)


@pytest.mark.parametrize("sched", ["lambda_warmup_cosine", "onecycle"])
def test_schedulers_take_effect_every_replay(sched):
    class M(type(make_module())):
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            if sched == "onecycle":
                # cycle_momentum=False: see test_cycled_momentum_is_refused_or_followed
                s = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=80, cycle_momentum=False)
            else:
                s = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 10) * 0.5 * (1 + math.cos(math.pi * i / 80)))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step"}}

    def run(callbacks):
        pl.seed_everything(0, verbose=False)
        from recipes.gpt import get_config

        m = M(get_config("tiny", n_layer=2, seq_len=256))
        return fit(m, callbacks, 80)

    cb = CudaGraphCallback()
    _, g = run([cb])
    _, e = run([CapturableEager()])
    assert cb.stats.replays > 70 and cb.stats.recaptures == 0, cb.stats.summary()
    assert torch.equal(g.loss_tensor(), e.loss_tensor()), max_rel(g.loss_tensor(), e.loss_tensor())


def test_cycled_momentum_is_refused_or_followed():
    from nemo_cudagraph_plugin.core.optim import probe_tensor_hyperparams

    class M(type(make_module())):
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            s = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=40)  # cycles beta1
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step"}}

    betas_ok = probe_tensor_hyperparams(torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]), torch.device("cuda", 0), False)[1]
    pl.seed_everything(0, verbose=False)
    from recipes.gpt import get_config

    if betas_ok:
        cb = CudaGraphCallback()
        fit(M(get_config("tiny", n_layer=2, seq_len=256)), [cb], 40)
        assert cb.stats.recaptures == 0
    else:
        with pytest.raises(CaptureError, match="cycle_momentum=False"):
            fit(M(get_config("tiny", n_layer=2, seq_len=256)), [CudaGraphCallback()], 40)
    print(f"\nONECYCLE cycle_momentum=True: tensor betas graph-safe on this torch: {betas_ok}")


@pytest.mark.parametrize("algo", ["norm", "value"])
def test_gradient_clipping_in_graph(algo):
    kw = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": algo}
    cb, _, g = _graphed(steps=50, **kw)
    _, e = _eager(steps=50, **kw)
    _, n = _eager(steps=50)
    assert cb.stats.replays > 40
    assert torch.equal(g.loss_tensor(), e.loss_tensor())
    assert not torch.equal(g.loss_tensor(), n.loss_tensor()), "clipping had no effect"


@pytest.mark.parametrize("acc", [2, 3])
def test_gradient_accumulation_graph_per_phase(acc):
    cb, _, g = _graphed(steps=30, accumulate_grad_batches=acc, train_loader=loader(30 * acc))
    _, e = _eager(steps=30, accumulate_grad_batches=acc, train_loader=loader(30 * acc))
    assert cb.stats.captures == acc, cb.stats.summary()  # (zero, accumulate), [(no zero, accumulate)], (no zero, step)
    assert g.global_steps[-1] == e.global_steps[-1] == 30
    assert torch.equal(g.loss_tensor(), e.loss_tensor()), max_rel(g.loss_tensor(), e.loss_tensor())


def test_variable_shapes_one_graph_each_and_cache_limit():
    lengths = [64, 128, 192]
    cb, _, g = _graphed(steps=45, train_loader=loader(45, lengths=lengths))
    _, e = _eager(steps=45, train_loader=loader(45, lengths=lengths))
    assert cb.stats.captures == 3, cb.stats.summary()
    assert torch.equal(g.loss_tensor(), e.loss_tensor())
    cb2, _, g2 = _graphed(steps=45, cb_kw={"max_graphs": 2}, train_loader=loader(45, lengths=lengths))
    assert cb2.stats.graphs == 2 and cb2.stats.eager_reasons.get("graph cache full", 0) > 0, cb2.stats.summary()
    assert torch.equal(g2.loss_tensor(), e.loss_tensor())


def test_validation_interleaved_keeps_graphs():
    vl = loader(4, seed=7)
    cb, _, g = _graphed(steps=40, val_loader=vl, val_check_interval=10, limit_val_batches=2)
    _, e = _eager(steps=40, val_loader=vl, val_check_interval=10, limit_val_batches=2)
    assert cb.stats.captures == 1 and cb.stats.recaptures == 0, cb.stats.summary()
    assert torch.equal(g.loss_tensor(), e.loss_tensor())


def test_resume_from_checkpoint_equals_eager_resume(tmp_path):
    """Resume under graphs continues exactly as an eager resume does.

    (With a plain DataLoader, Lightning itself does not continue bit-for-bit like an uninterrupted run
    when resuming from the checkpoint of a finished epoch: it re-runs one batch. Measured on CPU without
    this plugin; so the reference here is Lightning's own eager resume, from the same checkpoint.)
    """
    from _lightning_utils import Recorder
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer_for(steps, cbs, ckdir):
        return pl.Trainer(
            accelerator="gpu", devices=1, max_steps=steps, callbacks=[*cbs, ModelCheckpoint(dirpath=str(ckdir), save_top_k=-1, every_n_epochs=1)],
            logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        )

    # Checkpoint written by ModelCheckpoint while the graphs (device-tensor lr) are live.
    trainer_for(15, [CudaGraphCallback()], tmp_path / "a").fit(make_module(), train_dataloaders=loader(15))
    ckpt = str(next((tmp_path / "a").glob("*.ckpt")))
    sd = torch.load(ckpt, weights_only=False)
    assert isinstance(sd["optimizer_states"][0]["param_groups"][0]["lr"], float), "checkpoint not portable"
    assert sd["optimizer_states"][0]["param_groups"][0]["capturable"] is False
    cb2, graphed = CudaGraphCallback(), Recorder()
    trainer_for(40, [cb2, graphed], tmp_path / "b").fit(make_module(seed=123), train_dataloaders=loader(15), ckpt_path=ckpt)
    eager = Recorder()
    trainer_for(40, [CapturableEager(), eager], tmp_path / "c").fit(make_module(seed=7), train_dataloaders=loader(15), ckpt_path=ckpt)
    assert cb2.stats.replays > 10, cb2.stats.summary()
    assert len(graphed.losses) == len(eager.losses) == 25
    assert torch.equal(graphed.loss_tensor(), eager.loss_tensor()), max_rel(graphed.loss_tensor(), eager.loss_tensor())


def test_reallocated_optimizer_state_is_recaptured():
    class Swap(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 12:
                opt = trainer.optimizers[0]
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # replaces every state tensor

    cb = CudaGraphCallback()
    _, g = fit(make_module(), [cb, Swap()], 25)
    _, e = fit(make_module(), [CapturableEager(), Swap()], 25)
    assert cb.stats.recaptures >= 1, cb.stats.summary()
    assert torch.equal(g.loss_tensor(), e.loss_tensor())


class _Poisoned(type(make_module())):
    """Adds ``(bad * poison).sum()`` to the loss: only ``bad``'s gradient turns NaN when poisoned."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.bad = torch.nn.Parameter(torch.ones(4))
        self.register_buffer("poison", torch.zeros(4))

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + (self.bad * self.poison).sum()


class _PoisonAt(pl.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.step:
            pl_module.poison.fill_(float("nan"))
        elif batch_idx == self.step + 1:
            pl_module.poison.zero_()


def _poisoned():
    pl.seed_everything(0, verbose=False)
    from recipes.gpt import get_config

    return _Poisoned(get_config("tiny", n_layer=2, seq_len=256))


@pytest.mark.parametrize("clip", [None, "norm"])
def test_nan_guard_names_parameter(clip):
    """No clipping: the guard watches the loss (the poisoned step's loss is NaN through a term on ``bad`` alone, every
    parameter still finite) and counts the parameters once more after that step's update: ``bad``. With clipping by
    norm it reads the per-parameter norms of ``torch._foreach_norm``. Neither builds a read of its own (no
    FiniteCheck). The read ends at the poisoned step (the 13th): with clipping, that step's NaN clip factor makes
    every parameter NaN, so later steps' gradients are all non-finite."""
    cb = CudaGraphCallback(nan_check_every=13)
    kw = {"gradient_clip_val": 1.0, "gradient_clip_algorithm": clip} if clip else {}
    with pytest.raises(NonFiniteError) as ei:
        fit(_poisoned(), [cb, _PoisonAt(12)], 40, **kw)
    assert ei.value.parameter == "bad" and " more)" not in str(ei.value), str(ei.value)
    assert cb.stats.replays > 0
    assert not cb.step_runner.adapter.guard._checks
    print(f"\nNAN GUARD (clip={clip}): {ei.value}")


class _GradPoisoned(type(make_module())):
    """The loss is scaled by ``bad.mean()`` and ``bad``'s gradient is multiplied by NaN in the poisoned step: only
    that gradient turns NaN, that step's loss stays finite, and from the next step on the NaN in ``bad`` reaches the
    loss and every gradient. ``fused``: torch's fused AdamW, else its default (foreach) one."""

    def __init__(self, *a, fused=False, unused=False, **k):
        super().__init__(*a, **k)
        self.fused = fused
        self.bad = torch.nn.Parameter(torch.ones(4))
        # a parameter the loss never uses: no gradient, so clipping computes no norm for its slot
        self.unused = torch.nn.Parameter(torch.ones(3)) if unused else None
        self.register_buffer("poison", torch.zeros(4))  # set by _PoisonAt: NaN in the poisoned step, else 0
        self.bad.register_hook(lambda g: g * (1 + self.poison))

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.bad.mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused)


@pytest.mark.parametrize("fused", [False, True])
def test_nan_guard_watching_the_loss_names_parameter_long_after_the_bad_step(fused):
    """No clipping: no gradient is read in the step (no FiniteCheck built); the guard watches the loss. The read comes
    27 steps after the poisoned one, long after the NaN spread to every gradient and parameter, and still names the
    one bad parameter: the parameters were counted at the first NaN loss only."""
    pl.seed_everything(0, verbose=False)
    from recipes.gpt import get_config

    cb = CudaGraphCallback(nan_check_every=50)
    with pytest.raises(NonFiniteError) as ei:
        fit(_GradPoisoned(get_config("tiny", n_layer=2, seq_len=256), fused=fused), [cb, _PoisonAt(12)], 40)
    assert ei.value.parameter == "bad" and " more)" not in str(ei.value), str(ei.value)
    assert "non-finite loss and non-finite gradient or update of parameter 'bad'" in str(ei.value), str(ei.value)
    assert cb.stats.replays > 20 and not cb.step_runner.adapter.guard._checks, cb.stats.summary()
    print(f"\nNAN GUARD (watched, fused={fused}): {ei.value}")


@pytest.mark.parametrize("unused", [False, True], ids=["all-grads", "a-param-without-grad"])
def test_nan_guard_with_clipping_names_parameter_long_after_the_bad_step(unused):
    """Clipping by norm: the guard marks the non-finite per-parameter norms clipping computes. The poisoned step's
    NaN clip factor makes every parameter NaN, so every later step's norms are non-finite; the read comes 27 steps
    later and still names the one bad parameter: only the window's first step with a bad norm marks. With a
    parameter that gets no gradient, its slot gets a zero norm inside the graph and the norms still cover the step
    (no gradient read of the guard's own)."""
    pl.seed_everything(0, verbose=False)
    from recipes.gpt import get_config

    cb = CudaGraphCallback(nan_check_every=50)
    with pytest.raises(NonFiniteError) as ei:
        fit(_GradPoisoned(get_config("tiny", n_layer=2, seq_len=256), fused=True, unused=unused), [cb, _PoisonAt(12)],
            40, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    assert ei.value.parameter == "bad" and " more)" not in str(ei.value), str(ei.value)
    assert cb.stats.replays > 20 and not cb.step_runner.adapter.guard._checks, cb.stats.summary()
    print(f"\nNAN GUARD (clipped, read long after): {ei.value}")


def test_nan_guard_watch_names_the_parameter_when_the_loss_goes_bad_first():
    """The poisoned step's loss is NaN through a term on ``bad`` (every parameter finite then); the read comes 17 steps
    later. The watch counts the parameters once more after that step's update: ``bad``, and only ``bad``."""
    cb = CudaGraphCallback(nan_check_every=50)
    with pytest.raises(NonFiniteError) as ei:
        fit(_poisoned(), [cb, _PoisonAt(12)], 30)
    assert ei.value.parameter == "bad" and " more)" not in str(ei.value), str(ei.value)
    assert cb.stats.replays > 20 and not cb.step_runner.adapter.guard._checks, cb.stats.summary()


class _SlowFused(type(make_module())):
    """Fused AdamW, and about a millisecond of device time per step (a sleep kernel): the host runs many steps ahead."""

    def training_step(self, batch, batch_idx):
        torch.cuda._sleep(1_000_000)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def _routed_fit_equals_eager(run, min_replays):
    """``run(callbacks)`` (a fit) with our callback and eagerly: every batch's transfer was routed to the transfer
    stream, the steps replayed, and the losses are bitwise eager's."""
    routed = []

    class Seen(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            routed.append("batch_to_device" in trainer.strategy.__dict__)

    cb = CudaGraphCallback()
    _, g = run([cb, Seen()])
    assert all(routed) and cb.stats.replays >= min_replays, (routed, cb.stats.summary())
    _, e = run([CapturableEager()])
    gl, el = g.loss_tensor(), e.loss_tensor()
    assert torch.isfinite(gl).all() and torch.equal(gl, el), f"max rel diff {max_rel(gl, el):.3e}"


def test_host_far_ahead_with_pinned_batches_copied_on_their_own_stream_equals_eager():
    """Batches from pinned memory are copied to the GPU on the transfer stream while earlier steps still run, and
    the host is many steps ahead of the device: every step must still train on its own batch (bitwise eager), with the
    NaN guard watching the loss (a kernel per step that changes nothing while the loss is finite)."""
    from recipes.gpt import get_config

    def run(cbs):
        pl.seed_everything(0, verbose=False)
        module = _SlowFused(get_config("tiny", n_layer=2, seq_len=256))
        pinned = torch.utils.data.DataLoader(loader(30).dataset, batch_size=2, shuffle=False, pin_memory=True)
        return fit(module, cbs, 30, train_loader=pinned)

    _routed_fit_equals_eager(run, 25)


def test_step_waits_for_its_batch_copied_on_the_transfer_stream():
    """The step must not read its batch before the transfer stream has copied it. Each batch carries 128 MB that the
    model ignores, copied first: the token copies queue behind it on the transfer stream and arrive milliseconds
    after the host reached the step. Every step must still train on its own tokens (bitwise eager)."""
    from torch.utils.data import default_collate

    bulk = torch.zeros(32 * 2**20)  # float32, 128 MB

    def collate(items):
        return {"bulk": bulk, **default_collate(items)}  # first: copied first

    def run(cbs):
        pinned = torch.utils.data.DataLoader(loader(20).dataset, batch_size=2, shuffle=False, pin_memory=True,
                                             collate_fn=collate)
        return fit(make_module(), cbs, 20, train_loader=pinned)

    _routed_fit_equals_eager(run, 15)


def test_nan_guard_skip_mode_keeps_parameters_finite():
    cb = CudaGraphCallback(nan_check_every=5, nan_action="skip")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        trainer, rec = fit(_poisoned(), [cb, _PoisonAt(12)], 30)
    module = trainer.lightning_module
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert cb.stats.skipped_steps == 1, cb.stats.summary()
    assert torch.isfinite(rec.loss_tensor()[14:]).all()


class _Bad(type(make_module())):
    kind = "item"

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.kind == "item":
            if loss.item() > 1e9:  # LINE-ITEM
                loss = loss * 0
        elif self.kind == "cpu":
            loss = loss * torch.tensor(1.0).to(self.device)  # LINE-CPU
        elif self.kind == "mask":
            loss = loss + batch["labels"][batch["labels"] > 1000].float().sum()  # LINE-MASK
        return loss


def _line_of(tag):
    src = open(__file__).read().splitlines()
    return next(i + 1 for i, line in enumerate(src) if line.rstrip().endswith("# " + tag))


@pytest.mark.parametrize("kind,rule,tag", [("item", "host-sync", "LINE-ITEM"), ("cpu", "cpu-tensor", "LINE-CPU"), ("mask", "dynamic-shape", "LINE-MASK")])
def test_capture_error_names_user_line(kind, rule, tag):
    pl.seed_everything(0, verbose=False)
    from recipes.gpt import get_config

    m = _Bad(get_config("tiny", n_layer=1, seq_len=256))
    m.kind = kind
    with pytest.raises(CaptureError) as ei:
        fit(m, [CudaGraphCallback(scope="step")], 10)
    err = ei.value
    print(f"\nCAPTURE ERROR [{kind}]: {str(err).splitlines()[0]}")
    assert err.rule == rule, str(err)
    assert err.location is not None and err.location.endswith(f"test_capture_gpu.py:{_line_of(tag)}"), str(err)


def test_on_capture_error_eager_trains_with_one_warning():
    pl.seed_everything(0, verbose=False)
    from recipes.gpt import get_config

    m = _Bad(get_config("tiny", n_layer=1, seq_len=256))
    cb = CudaGraphCallback(on_capture_error="eager", scope="step")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _, rec = fit(m, [cb], 12)
    ours = [x for x in w if "CUDA graphs disabled" in str(x.message)]
    assert len(ours) == 1, [str(x.message) for x in w]
    assert len(rec.losses) == 12 and cb.stats.replays == 0 and cb.eager_reason


def test_verify_steps_passes_on_a_correct_step():
    cb, _, g = _graphed(steps=20, cb_kw={"verify_steps": 3})
    _, e = _eager(steps=20)
    assert cb.stats.verified_steps == 3
    assert torch.equal(g.loss_tensor(), e.loss_tensor())


def test_disabled_is_plain_eager():
    cb = CudaGraphCallback(enabled=False)
    _, g = fit(make_module(), [cb], 20)
    _, v = _eager(steps=20, capturable=False)
    assert cb.stats.replays == 0
    assert torch.equal(g.loss_tensor(), v.loss_tensor())


def test_bf16_mixed_parity():
    cb, _, g = _graphed(steps=40, precision="bf16-mixed")
    _, e = _eager(steps=40, precision="bf16-mixed")
    assert cb.stats.replays > 30
    assert torch.equal(g.loss_tensor(), e.loss_tensor()), max_rel(g.loss_tensor(), e.loss_tensor())


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_sgd_momentum_and_plain_adam(opt_name):
    class M(type(make_module())):
        def configure_optimizers(self):
            if opt_name == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    def run(cbs):
        pl.seed_everything(0, verbose=False)
        from recipes.gpt import get_config

        return fit(M(get_config("tiny", n_layer=2, seq_len=256)), cbs, 30)

    cb = CudaGraphCallback()
    _, g = run([cb])
    _, e = run([CapturableEager()])
    assert cb.stats.replays > 20, (opt_name, cb.stats.summary())
    assert torch.equal(g.loss_tensor(), e.loss_tensor()), (opt_name, max_rel(g.loss_tensor(), e.loss_tensor()))


def test_lbfgs_is_refused_with_a_clear_message():
    class M(type(make_module())):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters())

    with pytest.raises(CaptureError, match="LBFGS cannot run inside a CUDA graph"):
        fit(M(), [CudaGraphCallback()], 3)


class _AtStep(pl.Callback):
    """Runs ``change(pl_module)`` before the batch of global step ``at`` (a callback between replays)."""

    def __init__(self, at, change):
        self.at, self.change = at, change

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            self.change(pl_module)


def _freeze_block0(m):
    for p in m.model.blocks[0].parameters():
        p.requires_grad_(False)


def test_layers_frozen_after_capture_stop_training_like_eager():
    """requires_grad turned off between replays: the graphs are captured again, the frozen block stays as it was, and
    the losses equal eager's bit for bit."""
    with pytest.warns(UserWarning, match=r"re-captured: model\.blocks\.0\.[\w.]+\.requires_grad changed from True"):
        cb = CudaGraphCallback()
        module = make_module()
        snap = {}
        _, g = fit(module, [cb, _AtStep(30, _freeze_block0),
                            _AtStep(31, lambda m: snap.update({n: p.detach().clone() for n, p in
                                                               m.model.blocks[0].named_parameters()}))], 60)
    _, e = fit(make_module(), [CapturableEager(), _AtStep(30, _freeze_block0)], 60)
    assert cb.stats.recaptures >= 1 and cb.stats.replays >= 50, cb.stats.summary()
    assert torch.equal(g.loss_tensor(), e.loss_tensor())
    assert all(torch.equal(p.cpu(), snap[n].cpu()) for n, p in module.model.blocks[0].named_parameters()), "moved"


def test_dropout_changed_after_capture_is_followed():
    """nn.Dropout.p set from 0 to 0.5 between replays: the replays draw dropout masks from then on (without the
    re-capture they would keep p = 0 and train exactly like the run that never changed it)."""

    def set_p(m):
        for mod in m.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.5

    with pytest.warns(UserWarning, match=r"re-captured: model\.[\w.]+\.p changed from 0\.0 to 0\.5"):
        cb = CudaGraphCallback()
        _, g = fit(make_module(), [cb, _AtStep(30, set_p)], 60)
    _, unchanged = fit(make_module(), [CapturableEager()], 60)
    _, e = fit(make_module(), [CapturableEager(), _AtStep(30, set_p)], 60)
    gl, ul, el = g.loss_tensor(), unchanged.loss_tensor(), e.loss_tensor()
    assert torch.equal(gl[:30], ul[:30])
    assert not torch.equal(gl[31:], ul[31:]), "the replays kept p = 0"
    assert abs(float(gl[-20:].mean() - el[-20:].mean())) < 0.05 * float(el[-20:].mean())


class _WideMLP(pl.LightningModule):
    """Weights dominate the memory (40 M parameters, a 4 x 2048 batch) and plain SGD adds no optimizer state or
    temporaries: a set of gradients the graphed run keeps beyond eager's shows up whole in the peak."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU())
                                         for _ in range(10)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_graphed_peak_memory_is_that_of_eager_training_with_the_same_optimizer():
    """The graphed run holds one set of gradients at its peak, as eager training does: the previous step's gradients
    are released before the capture, and the NaN guard's checks of the eager warm-up steps keep no gradient alive.
    Peak allocated memory over the whole fit, against eager with the optimizer prepared as under graphs."""
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(48, 2048, generator=g), torch.randn(48, 2048, generator=g)),
        batch_size=4)

    def peak(callbacks):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fit(_WideMLP(), callbacks, steps=12, train_loader=data)
        return torch.cuda.max_memory_allocated() - base

    eager = peak([CapturableEager()])
    cb = CudaGraphCallback()
    graphed = peak([cb])
    assert cb.stats.replays > 0
    print(f"peak MiB: eager (same optimizer) {eager / 2**20:.1f}, graphed {graphed / 2**20:.1f}, "
          f"ratio {graphed / eager:.4f}, stats.peak_over_eager {cb.stats.peak_over_eager:.4f}")
    assert graphed <= 1.02 * eager, f"graphed peak {graphed / 2**20:.1f} MiB, eager {eager / 2**20:.1f} MiB"
