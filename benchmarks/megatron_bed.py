"""Megatron-core test bed on one GPU: eager vs per-layer graphs vs the whole-iteration graph.

What it measures that the harness cannot: megatron-core's own per-layer and whole-iteration graphs with FP8 and
the distributed optimizer, which the NeMo flag configures (the harness runs Lightning modules only).

A small GPT from megatron-core's TransformerEngine layer spec (``get_gpt_layer_with_transformer_engine_spec``),
TP = PP = 1 in a 1-rank NCCL group, bf16, FP8 (``fp8="hybrid"``, FP8 primary weights with ``fp8_param_gather``),
the distributed optimizer with ``overlap_param_gather`` and ``overlap_grad_reduce``, several microbatches per
step through ``get_forward_backward_func()``. One process runs one arm and writes one JSON record::

    python benchmarks/megatron_bed.py --mode eager --steps 120 --out eager_a.json
    python benchmarks/megatron_bed.py --mode layer --steps 120 --out layer.json   # the NeMo flag's fields
    python benchmarks/megatron_bed.py --mode full  --steps 120 --out full.json    # FullCudaGraphWrapper
    python benchmarks/megatron_bed.py report eager_a.json eager_b.json layer.json full.json ... \
        --md record.md --json record.json

``--shape 1b`` gives the arm a 0.94 B-parameter model at sequence 2048 (:data:`SHAPES`) in place of the small default.

The report groups arms by what they compute (``GROUP_FIELDS``: precision, FP8 primary weights, fused wgrad,
steps, model and data sizes, seed, lr): each arm is compared with the first plain eager arm of its own group, and
the group's second eager arm gives the eager-vs-eager noise floor. Mode, tag, timing/verification and the graph
switches are not part of a group.

Modes. ``eager``: no graph. ``layer``: the fields ``nemo_cudagraph_plugin.integrations.nemo.with_cuda_graph`` puts on a recipe's
``model.config``, applied by the same function (``apply_megatron_graph_fields``) to this ``TransformerConfig``:
megatron-core captures and replays each transformer layer. Where the flag refuses per-layer graphs (megatron-core
0.16.1, ``megatron.per_layer_refusal``: its default there is the whole iteration) the arm sets the per-layer fields as
a user would by hand and its record keeps the reason (``flag.refused``); with ``--keep-graph-inputs`` the flag sees
that hazard removed. ``full``: the same function with
``scope=["full_iteration"]`` plus ``nemo_cudagraph_plugin.integrations.megatron.full_iteration_forward_backward`` (megatron-core's
``FullCudaGraphWrapper``, what the flag's ``MegatronFullIterationGraph`` callback installs under NeMo).

What each record holds: per-step loss and gradient norm (the distributed optimizer's, i.e. of ``main_grad`` before
clipping), per-step wall time, the CUDA graphs megatron-core actually captured (counted from its objects), FP8
transpose checks (``verify_fp8_transposes`` at chosen steps, outside the timed steps), the flag's field changes,
and the installed megatron-core's capabilities. Arms for the other questions:

* ``--force-sync-every K``: after every K-th optimizer step force the parameter all-gather, as NeMo's
  ``save_checkpoint`` does (``force_param_sync()``); the next step's transposes are then checked.
  ``--param-gather-refresh`` installs the plugin's completion-path refresh; ``--align-every-step`` is the old
  approach (force the all-gather and refresh after every step: ``make_param_sync_hook``).
* Seed 000 (Megatron-LM #1279): ``--gaf`` (default on) turns TE's fused wgrad accumulation on
  (``gradient_accumulation_fusion=True``) and ``--poison-placeholder`` (default on) fills TE's placeholder wgrads
  with NaN, so any double add into ``main_grad`` shows as a NaN gradient norm. ``--break-grad-added`` empties
  megatron-core's restore of ``grad_added_to_main_grad`` after the per-layer capture (what a megatron-core without
  it does); ``--guard-fused-wgrad`` lets the flag's decision see that missing capability.
* Per-layer graphs vs eager (why they are not bitwise on megatron-core 0.16.1): ``--grad-fingerprints N`` records,
  at steps 0..N-1, one fingerprint per parameter of ``main_grad`` after the forward-backward (before clipping and
  the optimizer step); the report names the parameters whose gradient is not bitwise the reference's.
  ``--keep-graph-inputs`` (mode layer) keeps each layer graph's forward input buffers out of megatron-core's
  ``TensorReusePool``, into which megatron-core < 0.18 returns them right after the forward capture
  (``cuda_graphs.py`` 0.16.1 l.986-995) although the backward graph still reads them: the first layer's input
  buffer is then handed to the last layer's backward graph as its output-gradient buffer (l.1056), and every
  replayed step overwrites the first layer's saved norm input with that gradient (l.639-643) before the first
  layer's backward reads it. core_v0.18.0 deletes that return (Megatron-LM commit 481efd020e, #4433).

A benchmark: it measures and records, it asserts nothing (``tests/gpu/test_megatron_gpu.py`` does).
Everything except ``run()`` works without a GPU (config building, argument parsing, the report).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

MODES = ("eager", "layer", "full")

#: ``--shape NAME``: the model and data sizes of an arm (flags given after it win). ``small``: the defaults, 100+ steps
#: in seconds. ``1b``: 16 layers of hidden 2048 (16 heads, FFN 8192), vocabulary 32000, sequence 2048, 4 microbatches
#: of 1: 0.94 B parameters, the size FP8 is turned on for; 40 M-parameter buckets (megatron-core's default size).
SHAPES: dict[str, dict[str, int]] = {
    "small": {},
    "1b": {"layers": 16, "hidden": 2048, "heads": 16, "vocab": 32000, "seq_length": 2048, "micro_batch_size": 1,
           "microbatches": 4, "bucket_params": 40_000_000, "steps": 60},
}


@dataclasses.dataclass
class BedConfig:
    """One arm of the bed. Defaults: 2 layers, hidden 256, seq 128, 2 microbatches of 2: 100+ steps in seconds."""

    mode: str = "eager"
    steps: int = 120
    microbatches: int = 2
    micro_batch_size: int = 2
    seq_length: int = 128
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    vocab: int = 1024
    fp8: str = "hybrid"  # "hybrid" or "none"
    fp8_recipe: str = "tensorwise"  # megatron's Fp8Recipe: tensorwise (current scaling) or delayed
    fp8_params: bool = True  # FP8 primary weights (fp8_param + fp8_param_gather)
    gaf: bool = True  # gradient_accumulation_fusion: TE's fused wgrad accumulation into main_grad
    poison_placeholder: bool = True  # fill TE's placeholder wgrads with NaN (seed 000 detector)
    warmup_steps: int = 2  # cuda_graph_warmup_steps
    seed: int = 1234
    lr: float = 1e-3
    bucket_params: int = 150_000  # several buckets, so overlapped all-gathers chain
    overlap_param_gather: bool = True  # False: the all-gather runs in the optimizer step (outside any graph)
    force_sync_every: int = 0
    param_gather_refresh: bool = False
    align_every_step: bool = False
    break_grad_added: bool = False
    guard_fused_wgrad: bool = False
    keep_graph_inputs: bool = False  # keep per-layer graph input buffers out of megatron-core's reuse pool
    grad_fingerprints: int = 0  # per-parameter main_grad fingerprints at steps 0..N-1
    verify_every: int = 10
    timing_skip: int = 5  # first steps (warm-up, capture) left out of ms/step
    tag: str = ""
    out: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: use one of {MODES}.")
        if self.fp8 not in ("hybrid", "none"):
            raise ValueError(f"fp8={self.fp8!r}: use 'hybrid' or 'none'.")
        if self.microbatches < 2:
            raise ValueError("microbatches must be >= 2 (the bed exercises gradient accumulation across microbatches).")
        if self.break_grad_added and self.mode != "layer":
            raise ValueError("--break-grad-added removes megatron-core's per-layer replay restore: use --mode layer.")
        if self.guard_fused_wgrad and not self.break_grad_added:
            raise ValueError("--guard-fused-wgrad only makes sense with --break-grad-added (the capability it hides).")
        if self.keep_graph_inputs and self.mode != "layer":
            raise ValueError("--keep-graph-inputs changes megatron-core's per-layer graph capture: use --mode layer.")
        if self.grad_fingerprints < 0:
            raise ValueError("--grad-fingerprints N: N is a number of steps (0 = none).")
        if self.fp8 == "none":
            self.fp8_params = False
        if not self.tag:
            self.tag = self.mode


def parse_args(argv: Optional[list[str]] = None) -> BedConfig:
    """Command line of one arm (``run``, the default) -> :class:`BedConfig`."""
    shape = argparse.ArgumentParser(add_help=False)
    shape.add_argument("--shape", choices=tuple(SHAPES), default="small")
    known, _ = shape.parse_known_args(argv)
    p = argparse.ArgumentParser(prog="megatron_bed.py", description=__doc__.split("\n\n")[0], parents=[shape])
    d = dataclasses.replace(BedConfig(), **SHAPES[known.shape])
    p.add_argument("--mode", choices=MODES, default=d.mode)
    for name in ("steps", "microbatches", "micro_batch_size", "seq_length", "layers", "hidden", "heads", "vocab",
                 "warmup_steps", "seed", "bucket_params", "force_sync_every", "verify_every", "timing_skip",
                 "grad_fingerprints"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--fp8", choices=("hybrid", "none"), default=d.fp8)
    p.add_argument("--fp8-recipe", choices=("tensorwise", "delayed"), default=d.fp8_recipe)
    for name in ("fp8_params", "gaf", "poison_placeholder", "param_gather_refresh", "align_every_step",
                 "break_grad_added", "guard_fused_wgrad", "overlap_param_gather", "keep_graph_inputs"):
        p.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=getattr(d, name))
    p.add_argument("--tag", default="")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    return BedConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(BedConfig)})


# ------------------------------------------------------------------------------------------------------------
# Configs (no GPU needed)
# ------------------------------------------------------------------------------------------------------------


def parameter_count(cfg: BedConfig) -> int:
    """The GPT's parameters: embedding and untied output layer, per layer attention (4 h^2), MLP (8 h^2) and two
    RMSNorms (2 h), the final norm."""
    h = cfg.hidden
    return 2 * cfg.vocab * h + cfg.layers * (12 * h * h + 2 * h) + h


def transformer_config(cfg: BedConfig) -> tuple[Any, dict[str, Any]]:
    """The model's megatron-core ``TransformerConfig`` for this arm, with the flag's fields for layer/full.

    Returns ``(config, info)``; ``info`` has the flag's changes and notes. Runs on a CPU machine too.
    """
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_cudagraph_plugin.integrations.megatron import apply_megatron_graph_fields

    fp8 = cfg.fp8 if cfg.fp8 != "none" else None
    tc = TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        ffn_hidden_size=4 * cfg.hidden, kv_channels=cfg.hidden // cfg.heads,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        fp8=fp8, fp8_recipe=cfg.fp8_recipe, fp8_param=bool(fp8 and cfg.fp8_params),
        gradient_accumulation_fusion=cfg.gaf,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        normalization="RMSNorm", use_te_rng_tracker=False,
    )
    info: dict[str, Any] = {"changes": [], "notes": []}
    if cfg.mode != "eager":
        from nemo_cudagraph_plugin.integrations.megatron import megatron_capabilities, per_layer_refusal

        caps = megatron_capabilities()
        if caps is not None and cfg.guard_fused_wgrad:
            # The decision sees a megatron-core whose replay does not restore grad_added_to_main_grad (what
            # --break-grad-added makes of this one).
            caps = dataclasses.replace(caps, replay_sets_grad_added_to_main_grad=False)
        if caps is not None and cfg.keep_graph_inputs:
            caps = dataclasses.replace(caps, per_layer_input_buffer_reuse=False)  # what --keep-graph-inputs removes
        refused = per_layer_refusal(caps) if cfg.mode == "layer" else None
        if refused is not None:
            # The flag does not give per-layer graphs on this megatron-core (its default is the whole iteration);
            # the arm measures what a user who sets the per-layer fields by hand gets, and its record says so.
            caps = dataclasses.replace(caps, per_layer_input_buffer_reuse=False)
        setup = apply_megatron_graph_fields(tc, impl="local", scope=["full_iteration"] if cfg.mode == "full" else None,
                                            warmup_steps=cfg.warmup_steps, capabilities=caps)
        tc.__post_init__()  # as NeMo's MegatronStrategy.connect() re-runs it: scope strings -> enums
        info = {"changes": [str(c) for c in setup.changes], "notes": setup.notes,
                "full_iteration": setup.full_iteration, "refused": refused}
    else:
        tc.use_te_rng_tracker = True  # the same RNG tracker in every arm, so eager and graphed draw alike
    return tc, info


def ddp_config(cfg: BedConfig) -> Any:
    """Distributed optimizer, overlapped all-gather and reduce-scatter, FP8 parameter all-gather."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, overlap_param_gather=cfg.overlap_param_gather,
        use_distributed_optimizer=True, fp8_param_gather=cfg.fp8_params,
        check_for_nan_in_grad=False,  # a host read inside the step: off in every arm, for like-for-like timing
        bucket_size=cfg.bucket_params,
    )


def optimizer_config(cfg: BedConfig) -> Any:
    import torch
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=cfg.lr, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, bf16=True,
        params_dtype=torch.bfloat16, use_distributed_optimizer=True, overlap_param_gather=cfg.overlap_param_gather,
        clip_grad=1.0,
    )


# ------------------------------------------------------------------------------------------------------------
# The run (CUDA)
# ------------------------------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("megatron.core", "transformer_engine"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[mod] = str(getattr(m, "__version__", "?"))
        except Exception as exc:  # noqa: BLE001  (recorded, not fatal here)
            out[mod] = f"missing ({type(exc).__name__})"
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def _init_distributed() -> None:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        raise RuntimeError("megatron_bed run needs a CUDA device (this machine has none); the report works anywhere.")
    torch.cuda.set_device(0)
    # With NCCL async error handling on, PyTorch's watchdog may query work created during a capture; the
    # whole-iteration graph captures the all-gathers and reduce-scatters (as CudaGraphStrategy does for DDP).
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="megatron_bed_"), "store")
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def _make_data(cfg: BedConfig) -> Any:
    """Learnable token streams (a fixed next-token permutation, 10 % noise), all steps on the GPU up front."""
    import torch

    g = torch.Generator().manual_seed(cfg.seed + 17)
    n = cfg.steps * cfg.microbatches * cfg.micro_batch_size
    perm = torch.randperm(cfg.vocab, generator=g)
    x = torch.empty(n, cfg.seq_length + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, cfg.vocab, (n,), generator=g)
    noise = torch.rand(n, cfg.seq_length, generator=g) < 0.1
    rand = torch.randint(0, cfg.vocab, (n, cfg.seq_length), generator=g)
    for t in range(cfg.seq_length):
        x[:, t + 1] = torch.where(noise[:, t], rand[:, t], perm[x[:, t]])
    return x.view(cfg.steps, cfg.microbatches, cfg.micro_batch_size, cfg.seq_length + 1).cuda()


def _batches(data: Any, step: int, cfg: BedConfig) -> list[dict[str, Any]]:
    import torch

    pos = torch.arange(cfg.seq_length, device="cuda").unsqueeze(0).expand(cfg.micro_batch_size, -1).contiguous()
    out = []
    for mb in range(cfg.microbatches):
        x = data[step, mb]
        out.append({"tokens": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous(),
                    "loss_mask": torch.ones_like(x[:, 1:], dtype=torch.float), "position_ids": pos})
    return out


def _loss_func(loss_mask: Any, output_tensor: Any) -> tuple[Any, Any, dict[str, Any]]:
    import torch

    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(output_tensor.float().reshape(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss_sum.detach().view(1), num_tokens.float().view(1)])
    return loss_sum, num_tokens, {"lm loss": report}


def _forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(_loss_func, batch["loss_mask"])


def build(cfg: BedConfig, tc: Any) -> tuple[Any, Any]:
    """The DDP-wrapped GPT and the distributed optimizer (CUDA)."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel import layers as tp_layers

    torch.manual_seed(cfg.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed, te_rng_tracker=True, force_reset_rng=True)
    spec = get_gpt_layer_with_transformer_engine_spec()
    saved = tp_layers._grad_accum_fusion_available
    if tc.gradient_accumulation_fusion:
        # The TE layers fuse wgrad accumulation themselves (fuse_wgrad_accumulation). megatron-core's own output
        # layer would need APEX's fused_weight_gradient_mlp_cuda, which the host lacks: build past its check and
        # give that one layer the unfused path below.
        tp_layers._grad_accum_fusion_available = True
    try:
        gpt = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=cfg.vocab,
                       max_sequence_length=cfg.seq_length, position_embedding_type="rope",
                       share_embeddings_and_output_weights=False)
    finally:
        tp_layers._grad_accum_fusion_available = saved
    gpt.output_layer.gradient_accumulation_fusion = False
    gpt.cuda()
    # NeMo builds DDP on a side stream ("required ... for full iteration CUDA graph", megatron_parallel.py).
    with torch.cuda.stream(torch.cuda.Stream()):
        model = DistributedDataParallel(config=tc, ddp_config=ddp_config(cfg), module=gpt)
    torch.cuda.synchronize()
    optimizer = get_megatron_optimizer(optimizer_config(cfg), [model])
    tc.no_sync_func = model.no_sync
    tc.finalize_model_grads_func = finalize_model_grads
    return model, optimizer


def _poison_placeholders() -> int:
    """Fill TransformerEngine's cached placeholder wgrads (``get_dummy_wgrad``, ``torch.empty``) with NaN."""
    try:
        from transformer_engine.pytorch.module import base
    except ImportError:
        return 0
    bufs = getattr(base, "_dummy_wgrads", {}) or {}
    for t in bufs.values():
        t.fill_(float("nan"))
    return len(bufs)


def _break_grad_added_restore(model: Any) -> int:
    """Empty megatron-core's per-runner restore of ``grad_added_to_main_grad`` (a megatron-core without it)."""
    n = 0
    for m in model.modules():
        for attr in ("cudagraph_manager", "cudagraph_manager_router", "cudagraph_manager_postprocess"):
            mgr = getattr(m, attr, None)
            for r in getattr(mgr, "cudagraph_runners", ()) if mgr is not None else ():
                if getattr(r, "groundtruth_grad_added_to_main_grad", None):
                    r.groundtruth_grad_added_to_main_grad = {}
                    n += 1
    return n


def withhold_forward_inputs(runner: Any, pool: Any) -> int:
    """Take ``runner``'s forward-graph input buffers back out of megatron-core's ``TensorReusePool``; returns how many.

    megatron-core < 0.18 puts the input buffers a layer's forward graph copies its inputs into back into the pool
    as soon as that forward graph is captured (``_CudaGraphRunner.create_fwd_graph``, 0.16.1 l.986-995), although
    the layer's backward graph still reads them (TransformerEngine's norm backward reads the saved norm input). The
    pool then hands the same memory to a later capture (the last layer's output-gradient buffer, l.1056), whose
    replay overwrites it before this layer's backward replays. Withheld buffers stay owned by this runner alone.
    """
    import torch

    live = {t.data_ptr() for t in getattr(runner, "fwd_graph_input_surface", ()) if torch.is_tensor(t)}
    kept = [b for b in pool.pool if b.data_ptr() not in live]
    withheld = len(pool.pool) - len(kept)
    pool.pool[:] = kept
    return withheld


def install_keep_graph_inputs() -> dict[str, int]:
    """Make every per-layer forward capture keep its input buffers (``--keep-graph-inputs``); returns live counts.

    What megatron-core 0.18.0 does by deleting the return to the pool (Megatron-LM commit 481efd020e, #4433). Only
    the bed's process is patched; nothing else changes in the capture.
    """
    from megatron.core.transformer import cuda_graphs as cg

    record = getattr(cg, "_CudagraphGlobalRecord", None)
    if getattr(record, "tensor_reuse_pool", None) is None or not hasattr(cg, "_CudaGraphRunner"):
        raise RuntimeError("--keep-graph-inputs: this megatron-core has no _CudagraphGlobalRecord.tensor_reuse_pool "
                           "(the per-layer graph buffer pool of megatron-core < 0.18); run the arm without it.")
    stats = {"forward_captures": 0, "withheld_buffers": 0}
    original = cg._CudaGraphRunner.create_fwd_graph

    @functools.wraps(original)
    def create_fwd_graph(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        stats["forward_captures"] += 1
        stats["withheld_buffers"] += withhold_forward_inputs(self, record.tensor_reuse_pool)
        return out

    cg._CudaGraphRunner.create_fwd_graph = create_fwd_graph
    return stats


def grad_fingerprints(model: Any) -> dict[str, dict[str, Any]]:
    """One fingerprint per parameter of its ``main_grad`` (the fp32 gradient the optimizer reads): a hash of the
    bytes (bitwise equality), the norm and the count of non-finite elements. Synchronises with the device."""
    import hashlib

    import torch

    out: dict[str, dict[str, Any]] = {}
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            continue
        host = g.detach().float().contiguous().cpu().reshape(-1)
        out[name.removeprefix("module.")] = {
            "sha1": hashlib.sha1(host.view(torch.uint8).numpy().tobytes()).hexdigest(),
            "norm": float(host.double().norm()), "numel": host.numel(),
            "nonfinite": int((~torch.isfinite(host)).sum()),
        }
    return out


def run(cfg: BedConfig) -> dict[str, Any]:
    """Train ``cfg.steps`` steps of one arm; returns the record (also on failure, with ``error``)."""
    import torch

    # Deterministic kernels, so that eager-vs-eager differences measure only what is left (TE attention backward,
    # cuBLAS workspaces); set before TE picks an attention backend.
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    rec: dict[str, Any] = {"tag": cfg.tag, "mode": cfg.mode, "config": dataclasses.asdict(cfg),
                           "parameters": parameter_count(cfg), "error": None,
                           "losses": [], "grad_norms": [], "ms": [], "excluded_steps": [], "fp8_checks": [],
                           "events": [], "grad_fingerprints": {}}
    try:
        rec["versions"] = _versions()
        _init_distributed()
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from nemo_cudagraph_plugin.fp8 import verify_fp8_transposes
        from nemo_cudagraph_plugin.integrations.megatron import (
            count_megatron_graphs,
            full_iteration_forward_backward,
            install_param_gather_refresh,
            make_param_sync_hook,
            megatron_capabilities,
        )

        caps = megatron_capabilities()
        rec["capabilities"] = dataclasses.asdict(caps) if caps else None
        tc, info = transformer_config(cfg)
        rec["flag"] = info
        rec["gradient_accumulation_fusion"] = bool(tc.gradient_accumulation_fusion)
        keep = install_keep_graph_inputs() if cfg.keep_graph_inputs else None
        model, optimizer = build(cfg, tc)
        torch.cuda.set_stream(torch.cuda.Stream())  # every arm on a side stream (megatron's per-layer graphs do)
        from nemo_cudagraph_plugin.fp8 import iter_fp8_params

        rec["fp8_params"] = sum(1 for _ in iter_fp8_params(model))
        gather = install_param_gather_refresh([model]) if cfg.param_gather_refresh else None
        align = make_param_sync_hook([model]) if cfg.align_every_step else None
        if cfg.mode == "full":
            fbf = full_iteration_forward_backward(get_forward_backward_func(), config=tc, model_chunks=[model])
        else:
            fbf = get_forward_backward_func()
        data = _make_data(cfg)
        verify_at = set(range(cfg.verify_every - 1, cfg.steps, cfg.verify_every)) if cfg.verify_every > 0 else set()
        forced_at = set(range(cfg.force_sync_every - 1, cfg.steps, cfg.force_sync_every)) if cfg.force_sync_every else set()
        verify_at |= {s + 1 for s in forced_at if s + 1 < cfg.steps}  # the step that reads after a forced sync
        for step in range(cfg.steps):
            if cfg.gaf and cfg.poison_placeholder and step > 0:
                _poison_placeholders()
            it = iter(_batches(data, step, cfg))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.zero_grad_buffer()
            optimizer.zero_grad()
            out = fbf(forward_step_func=_forward_step, data_iterator=it, model=[model],
                      num_microbatches=cfg.microbatches, seq_length=cfg.seq_length,
                      micro_batch_size=cfg.micro_batch_size, decoder_seq_length=cfg.seq_length, forward_only=False)
            if step < cfg.grad_fingerprints:  # after finalize_model_grads, before clipping and the step
                rec["grad_fingerprints"][str(step)] = grad_fingerprints(model)
            if step in verify_at:
                torch.cuda.synchronize()
                r = verify_fp8_transposes(model)
                unflagged = [n for n in r.stale if n not in r.flagged]
                rec["fp8_checks"].append({"step": step, "checked": len(r.checked), "stale": len(r.stale),
                                          "stale_unflagged": len(unflagged), "flagged": len(r.flagged),
                                          "after_forced_sync": (step - 1) in forced_at})
            _ok, grad_norm, _ = optimizer.step()
            if step in forced_at:
                model.start_param_sync(force_sync=True)  # what NeMo's save_checkpoint does (force_param_sync)
            if align is not None:
                align()
            rep = torch.stack([o["lm loss"] for o in out]).sum(0)
            loss = float(rep[0] / rep[1])
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            rec["losses"].append(loss)
            rec["grad_norms"].append(float(grad_norm) if grad_norm is not None else float("nan"))
            rec["ms"].append(ms)
            if step % 20 == 0 or step == cfg.steps - 1:
                print(f"  {cfg.tag} step {step}: loss {loss:.5f} grad_norm {rec['grad_norms'][-1]:.4g} {ms:.2f} ms",
                      flush=True)
            if step in verify_at or step in forced_at or step < max(cfg.timing_skip, cfg.grad_fingerprints):
                rec["excluded_steps"].append(step)
            if step == 0 and cfg.break_grad_added:
                rec["events"].append(f"emptied the grad_added_to_main_grad restore of {_break_grad_added_restore(model)} "
                                     "per-layer graph runners after step 0")
        rec["graphs"] = count_megatron_graphs([model])
        if keep is not None:
            rec["keep_graph_inputs"] = dict(keep)
            rec["events"].append(f"kept {keep['withheld_buffers']} forward input buffers of "
                                 f"{keep['forward_captures']} per-layer forward captures out of the reuse pool")
        if gather is not None:
            rec["param_gather_refresh"] = {"paths": sorted(gather.paths), "refreshed": dict(gather.refreshed),
                                           "calls": dict(gather.calls), "summary": gather.summary()}
        if align is not None:
            rec["align_every_step"] = {"param_syncs_forced": align.param_syncs_forced, "alignments": align.alignments}
    except Exception as exc:  # noqa: BLE001  (a record with the error is the product of a failed arm)
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["traceback"] = traceback.format_exc()
    rec["summary"] = summarize(rec, cfg.timing_skip)
    return rec


def summarize(rec: dict[str, Any], timing_skip: int = 5) -> dict[str, Any]:
    """ms/step and counts of one record."""
    excluded = set(rec.get("excluded_steps", ())) | set(range(timing_skip))
    ms = [m for i, m in enumerate(rec.get("ms", ())) if i not in excluded]
    gn = rec.get("grad_norms", [])
    checks = rec.get("fp8_checks", [])
    return {
        "steps": len(rec.get("losses", [])),
        "ms_median": statistics.median(ms) if ms else None,
        "ms_mean": statistics.fmean(ms) if ms else None,
        "timed_steps": len(ms),
        "nonfinite_grad_norms": sum(1 for g in gn if not math.isfinite(g)),
        "nonfinite_losses": sum(1 for x in rec.get("losses", []) if not math.isfinite(x)),
        "final_loss": rec["losses"][-1] if rec.get("losses") else None,
        "fp8_stale": sum(c["stale"] for c in checks),
        "fp8_stale_unflagged": sum(c["stale_unflagged"] for c in checks),
        "fp8_stale_after_forced": sum(c["stale"] for c in checks if c.get("after_forced_sync")),
        "fp8_checked": sum(c["checked"] for c in checks),
    }


# ------------------------------------------------------------------------------------------------------------
# Report (no GPU needed)
# ------------------------------------------------------------------------------------------------------------


def _diff(a: list[float], b: list[float]) -> dict[str, Any]:
    n = min(len(a), len(b))
    if n == 0:
        return {"steps": 0, "max_abs": None, "bitwise_steps": 0, "max_rel": None}
    pairs = list(zip(a[:n], b[:n]))
    finite = [(x, y) for x, y in pairs if math.isfinite(x) and math.isfinite(y)]
    max_abs = max((abs(x - y) for x, y in finite), default=None)
    max_rel = max((abs(x - y) / max(abs(y), 1e-12) for x, y in finite), default=None)
    return {"steps": n, "max_abs": max_abs, "max_rel": max_rel, "bitwise_steps": sum(1 for x, y in pairs if x == y),
            "nonfinite_pairs": n - len(finite)}


def grad_fingerprint_diff(rec: dict[str, Any], ref: dict[str, Any]) -> list[dict[str, Any]]:
    """Per step both records fingerprinted (``--grad-fingerprints``): the parameters whose ``main_grad`` is not
    bitwise the reference's, each with both norms and the relative norm difference, largest first."""
    a_all, b_all = rec.get("grad_fingerprints") or {}, ref.get("grad_fingerprints") or {}
    out = []
    for step in sorted(set(a_all) & set(b_all), key=int):
        a, b = a_all[step], b_all[step]
        names = [n for n in b if n in a]
        differ = []
        for n in names:
            if a[n]["sha1"] != b[n]["sha1"]:
                x, y = a[n]["norm"], b[n]["norm"]
                rel = abs(x - y) / abs(y) if y and math.isfinite(x) and math.isfinite(y) else (0.0 if x == y else None)
                differ.append({"param": n, "norm": x, "ref_norm": y, "norm_rel_diff": rel,
                               "nonfinite": a[n].get("nonfinite", 0)})
        differ.sort(key=lambda d: math.inf if d["norm_rel_diff"] is None else d["norm_rel_diff"], reverse=True)
        out.append({"step": int(step), "params": len(names), "differ": differ})
    return out


# Which BedConfig fields define what an arm computes (its comparison group) and which only say how it runs.
# Arms of one group train the same model on the same data with the same optimizer: each is compared with that
# group's first plain eager arm (the reference), and the group's second plain eager arm gives the noise floor.
# steps is in the key because _make_data draws the token streams for the whole run at once (a 60-step run sees
# other data than a 120-step run). Every BedConfig field is in exactly one of the two tuples (a CPU test checks).
GROUP_FIELDS = ("fp8", "fp8_recipe", "fp8_params", "gaf", "poison_placeholder", "steps", "microbatches",
                "micro_batch_size", "seq_length", "layers", "hidden", "heads", "vocab", "seed", "lr",
                "bucket_params")
RUN_FIELDS = ("mode", "warmup_steps", "overlap_param_gather", "force_sync_every", "param_gather_refresh",
              "align_every_step", "break_grad_added", "guard_fused_wgrad", "keep_graph_inputs", "grad_fingerprints",
              "verify_every", "timing_skip", "tag", "out")


def group_key(rec: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The comparison group of one record: its ``GROUP_FIELDS`` (BedConfig defaults where the record lacks them)."""
    cfg = rec.get("config") or {}
    d = BedConfig()
    fp8 = cfg.get("fp8", d.fp8)
    key = {name: cfg.get(name, getattr(d, name)) for name in GROUP_FIELDS}
    if fp8 == "none":
        key["fp8_params"] = False  # as BedConfig.__post_init__ does
    return tuple(key.items())


def _plain_eager(rec: dict[str, Any]) -> bool:
    """An eager arm that ran and is not deliberately perturbed (no forced parameter sync): a reference candidate."""
    cfg = rec.get("config") or {}
    return (rec.get("mode") == "eager" and not rec.get("error") and bool(rec.get("losses"))
            and not cfg.get("force_sync_every"))


def _label(key: tuple[tuple[str, Any], ...], varying: list[str]) -> str:
    """The precision fields always, then whatever else tells this group from the others in the report."""
    return " ".join(f"{k}={v}" for k, v in key if k in ("fp8", "fp8_params") or k in varying)


def compare(records: list[dict[str, Any]], reference: Optional[str] = None,
            noise: Optional[str] = None) -> dict[str, Any]:
    """Each record against the eager reference of its own configuration group (:func:`group_key`).

    A group's reference is its first plain eager arm in the order given (``reference`` names a preferred tag), its
    noise arm the second one (``noise`` names a preferred tag); the noise arm's difference from the reference is
    that group's eager-vs-eager noise floor. Verdicts: ``bitwise`` (every loss and gradient norm identical),
    ``within eager noise`` (max loss difference and gradient-norm relative difference both <= the group's
    eager-vs-eager ones), else ``differs``; any
    non-finite loss or gradient norm is ``NaN``; ``no eager ref`` where the group has no plain eager arm.
    """
    keys = [group_key(r) for r in records]
    order: list[tuple[tuple[str, Any], ...]] = []
    for k in keys:
        if k not in order:
            order.append(k)
    varying = [name for name in GROUP_FIELDS if len({dict(k)[name] for k in order}) > 1]
    groups = []
    by_key: dict[Any, dict[str, Any]] = {}
    for i, k in enumerate(order, 1):
        members = [r for r, rk in zip(records, keys) if rk == k]
        cands = [r for r in members if _plain_eager(r)]
        ref = next((r for r in cands if r["tag"] == reference), cands[0] if cands else None)
        rest = [r for r in cands if r is not ref]
        nz = next((r for r in rest if r["tag"] == noise), rest[0] if rest else None)
        noise_diff = _diff(nz["losses"], ref["losses"]) if ref and nz else None
        g = {"name": f"G{i}", "label": _label(k, varying), "key": dict(k), "tags": [r["tag"] for r in members],
             "reference": ref["tag"] if ref else None, "noise_arm": nz["tag"] if nz else None,
             "noise": noise_diff,
             "noise_grad_norm_max_rel": _diff(nz["grad_norms"], ref["grad_norms"])["max_rel"] if ref and nz else None}
        groups.append(g)
        by_key[k] = {"group": g, "ref": ref}
    rows = []
    for r, k in zip(records, keys):
        g, ref = by_key[k]["group"], by_key[k]["ref"]
        s = r.get("summary") or summarize(r)
        row: dict[str, Any] = {"tag": r["tag"], "mode": r["mode"], "error": r.get("error"), **s,
                               "graphs": r.get("graphs"), "gaf": r.get("gradient_accumulation_fusion"),
                               "group": g["name"], "reference": g["reference"], "noise_arm": g["noise_arm"]}
        n = g["noise"]
        floor = n["max_abs"] if n and n["max_abs"] is not None else 0.0
        if r is ref:
            pass
        elif ref is None:
            row["verdict"] = "no eager ref"
        elif r.get("losses"):
            ld = _diff(r["losses"], ref["losses"])
            gd = _diff(r["grad_norms"], ref["grad_norms"])
            row["loss_vs_ref"] = ld
            row["grad_norm_vs_ref"] = gd
            if s["nonfinite_grad_norms"] or s["nonfinite_losses"]:
                verdict = "NaN"
            elif ld["bitwise_steps"] == ld["steps"] and gd["bitwise_steps"] == gd["steps"]:
                verdict = "bitwise"
            elif (ld["max_abs"] is not None and ld["max_abs"] <= floor
                  and (gd["max_rel"] or 0.0) <= (g["noise_grad_norm_max_rel"] or 0.0)):
                # losses *and* gradient norms inside the eager-vs-eager spread (equal losses with different
                # gradients are a different training run whose losses have not diverged yet)
                verdict = "within eager noise"
            else:
                verdict = "differs"
            row["verdict"] = verdict
            if r.get("grad_fingerprints") and ref.get("grad_fingerprints"):
                row["grads_vs_ref"] = grad_fingerprint_diff(r, ref)
        rows.append(row)
    return {"groups": groups, "rows": rows}


def _fmt(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def table(summary: dict[str, Any]) -> str:
    """A short fixed-width table, one row per arm; ``vs`` is the eager arm the row is compared with (its group's
    reference), then one line per configuration group with its eager-vs-eager noise floor."""
    head = (f"{'arm':<18} {'grp':>3} {'ms/step':>8} {'graphs(l/f)':>11} {'vs':<16} {'loss Δmax':>10} {'bitwise':>9} "
            f"{'gnorm Δrel':>10} {'NaN':>4} {'stale(unfl)':>11} {'verdict':<18}")
    lines = [head]
    for r in summary["rows"]:
        g = r.get("graphs") or {}
        graphs = f"{g.get('layer_fwd_graphs', '-')}+{g.get('layer_bwd_graphs', '-')}/{g.get('full_iteration_graphs', '-')}"
        ld = r.get("loss_vs_ref") or {}
        gd = r.get("grad_norm_vs_ref") or {}
        is_ref = r["tag"] == r.get("reference")
        bit = f"{ld.get('bitwise_steps')}/{ld.get('steps')}" if ld else ("ref" if is_ref else "-")
        verdict = r.get("verdict", "reference" if is_ref else "-") if not r.get("error") else "ERROR"
        vs = "(itself)" if is_ref else (r.get("reference") or "-")
        lines.append(
            f"{r['tag']:<18} {r.get('group', '-'):>3} {_fmt(r.get('ms_median'), '.2f'):>8} {graphs:>11} {vs:<16} "
            f"{_fmt(ld.get('max_abs')):>10} {bit:>9} {_fmt(gd.get('max_rel')):>10} {r.get('nonfinite_grad_norms', '-'):>4} "
            f"{str(r.get('fp8_stale', '-')) + '(' + str(r.get('fp8_stale_unflagged', '-')) + ')':>11} {verdict:<18}"
        )
    for r in summary["rows"]:
        for st in r.get("grads_vs_ref") or ():
            names = ", ".join(f"{d['param']} ({_fmt(d['norm_rel_diff'])})" for d in st["differ"][:4])
            more = f" +{len(st['differ']) - 4} more" if len(st["differ"]) > 4 else ""
            lines.append(f"{r['tag']} main_grad vs {r['reference']} step {st['step']}: {len(st['differ'])}/{st['params']} "
                         f"params not bitwise" + (f": {names}{more} (norm rel Δ)" if names else ""))
    for grp in summary.get("groups", []):
        head = f"{grp['name']} [{grp['label']}]"
        n = grp.get("noise")
        if grp.get("reference") is None:
            lines.append(f"{head}: no plain eager arm, no verdicts")
        elif n is None:
            lines.append(f"{head}: reference {grp['reference']}, no second eager arm: eager-vs-eager noise unknown "
                         "(floor taken as 0)")
        else:
            lines.append(f"{head}: reference {grp['reference']}, eager-vs-eager noise ({grp['noise_arm']}): loss max "
                         f"|Δ| {_fmt(n.get('max_abs'))}, bitwise steps {n.get('bitwise_steps')}/{n.get('steps')}, "
                         f"grad-norm max rel {_fmt(grp.get('noise_grad_norm_max_rel'))}")
    return "\n".join(lines)


def markdown(records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The evidence record: versions, the table, the flag's changes, errors with their last traceback lines."""
    versions = next((r.get("versions") for r in records if r.get("versions")), {})
    caps = next((r.get("capabilities") for r in records if r.get("capabilities")), None)
    out = ["# Megatron-core test bed", "",
           "Produced by `benchmarks/megatron_session.sh` (`benchmarks/megatron_bed.py`). Versions: "
           + ", ".join(f"{k} {v}" for k, v in versions.items()), "",
           "Arms are grouped by configuration (" + ", ".join(GROUP_FIELDS) + "): each is compared with the "
           "first plain eager arm of its own group (column `vs`), and the group's second eager arm gives its "
           "eager-vs-eager noise floor (the lines under the table). Columns: configuration group, ms/step (median of "
           "the timed steps), graphs megatron-core captured (per-layer fwd+bwd / whole-iteration), the reference, "
           "loss max |Δ| and bitwise-equal steps vs it, gradient-norm max relative difference, non-finite gradient "
           "norms, FP8 transposes found stale at the checked steps (unflagged ones in brackets: eager TE reads those "
           "too). Lines `main_grad vs`: per fingerprinted step (`--grad-fingerprints`), the parameters whose "
           "gradient is not bitwise the reference's, with the relative difference of its norm.", "", "```", table(summary), "```", ""]
    if caps:
        out += ["installed megatron-core capabilities (version gates and probes):", "```",
                json.dumps({k: v for k, v in caps.items() if k != "where"}, indent=1),
                json.dumps(caps.get("where", {}), indent=1), "```", ""]
    for r in records:
        flag = r.get("flag") or {}
        lines = [f"## {r['tag']} (mode {r['mode']})"]
        cfg = r.get("config", {})
        row = next((x for x in summary["rows"] if x["tag"] == r["tag"]), {})
        if row.get("group"):
            ref = row.get("reference")
            lines.append(f"group {row['group']}, compared with "
                         + ("nothing (it is the reference)" if ref == r["tag"] else f"`{ref}`" if ref else
                            "nothing (no plain eager arm in its group)"))
        lines.append(", ".join(f"{k}={cfg.get(k)}" for k in ("steps", "microbatches", "fp8", "fp8_recipe",
                                                              "fp8_params", "gaf", "overlap_param_gather",
                                                              "force_sync_every", "param_gather_refresh",
                                                              "align_every_step", "break_grad_added",
                                                              "guard_fused_wgrad", "keep_graph_inputs",
                                                              "grad_fingerprints")))
        if flag.get("refused"):
            lines.append(f"- the flag refuses per-layer graphs here; the arm set its fields as a user would by hand: "
                     f"{flag['refused']}")
        for c in flag.get("changes", []):
            lines.append(f"- flag: `{c}`")
        for n in flag.get("notes", []):
            lines.append(f"- note: {n}")
        for e in r.get("events", []):
            lines.append(f"- event: {e}")
        for key in ("param_gather_refresh", "align_every_step"):
            if r.get(key):
                lines.append(f"- {key}: `{json.dumps(r[key])}`")
        if r.get("error"):
            tb = (r.get("traceback") or "").strip().splitlines()[-12:]
            lines += [f"- **error**: {r['error']}", "```", *tb, "```"]
        out += lines + [""]
    return "\n".join(out)


def report_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatron_bed.py report")
    p.add_argument("records", nargs="+")
    # Each arm is compared within its configuration group (compare()); these only pick, inside a group that holds
    # them, which plain eager arm is the reference / the noise arm (default: the first / second in the order given).
    p.add_argument("--reference", default=None, help="preferred reference tag inside its group")
    p.add_argument("--noise", default=None, help="preferred eager-vs-eager noise tag inside its group")
    p.add_argument("--md", default="")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    records = []
    for path in a.records:
        try:
            with open(path) as f:
                records.append(json.load(f))
        except (OSError, json.JSONDecodeError) as exc:
            print(f"megatron_bed report: skipped {path}: {exc}", file=sys.stderr)
    if not records:
        print("megatron_bed report: no record could be read", file=sys.stderr)
        return 2
    summary = compare(records, a.reference, a.noise)
    if a.md:
        with open(a.md, "w") as f:
            f.write(markdown(records, summary))
    if a.json:
        slim = [{k: v for k, v in r.items() if k != "traceback"} for r in records]
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "records": slim}, f, indent=1, default=str)
    print(table(summary))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        return report_main(argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    cfg = parse_args(argv)
    hang = float(os.environ.get("BED_HANG_DUMP", "0") or 0)
    if hang > 0:  # a stack dump in the log before an outer `timeout` kills a hung arm
        import faulthandler

        faulthandler.dump_traceback_later(hang, exit=False)
    rec = run(cfg)
    if cfg.out:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
        with open(cfg.out, "w") as f:
            json.dump(rec, f, indent=1, default=str)
    s = rec["summary"]
    print(f"BED {cfg.tag}: mode={cfg.mode} steps={s['steps']} ms/step={_fmt(s['ms_median'], '.2f')} "
          f"graphs={rec.get('graphs')} final_loss={_fmt(s['final_loss'], '.5f')} nan_gn={s['nonfinite_grad_norms']} "
          f"fp8_stale={s['fp8_stale']}({s['fp8_stale_unflagged']} unflagged) error={rec['error']}")
    if rec.get("traceback"):
        print(rec["traceback"], file=sys.stderr)
    return 1 if rec["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
