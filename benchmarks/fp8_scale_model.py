"""The child side of :mod:`benchmarks.fp8_scale`: the Llama-style TransformerEngine model, its LightningModule, and one
variant's run (or the probe) in this process.

Imported only in the child (torch, Lightning, TransformerEngine). The record follows the harness's conventions
(:func:`benchmarks.harness.child.child_main`: ``ok``, ``error``, ``env``; a failure is a result), the timing and the
kernel floor come from the harness's probe (:func:`benchmarks.harness.child.make_probe`).

The model: token embedding (FP32, plain torch), ``layers`` × ``te.TransformerLayer`` (RMSNorm, SwiGLU, GQA, RoPE
frequencies from ``te.RotaryPositionEmbedding`` passed as ``rotary_pos_emb``, causal self-attention, fused QKV, no
bias, no dropout, ``params_dtype=bfloat16``, layout ``[seq, batch, hidden]``), final RMSNorm and an untied LM head
(FP32, plain torch). FP8 variants build the layers under ``te.quantized_model_init(recipe=...,
preserve_high_precision_init_val=True)`` and run them under ``te.autocast(recipe=...)``; the optimizer's FP32 masters
start from the kept high-precision values. The dry run (no CUDA) swaps each TE layer for a plain-torch layer of the
same shape: it checks the plumbing, not TE.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.fp8_scale import RECIPES, VARIANTS, matmul_params
from benchmarks.harness import child as hchild

ROPE_BASE = 10000.0
INIT_STD = 0.02


# ------------------------------------------------------------------------------------------------ TransformerEngine


def import_te() -> Any:
    import transformer_engine.pytorch as te

    return te


def te_version() -> Optional[str]:
    try:
        import transformer_engine

        return str(getattr(transformer_engine, "__version__", "?"))
    except Exception:  # noqa: BLE001 - not installed or does not load
        return None


def make_recipe(name: str) -> Any:
    """A fresh TE recipe object of :data:`benchmarks.fp8_scale.RECIPES` (TE's defaults)."""
    from transformer_engine.common import recipe as te_recipe

    cls = getattr(te_recipe, RECIPES[name][0], None)
    if cls is None:
        raise RuntimeError(f"this TransformerEngine has no recipe {RECIPES[name][0]}")
    return cls()


def recipe_support(te: Any, name: str) -> tuple[bool, str]:
    """TE's own answer: can this GPU run the recipe (``is_fp8_available``, ``is_fp8_block_scaling_available``, ...)."""
    from transformer_engine.common import recipe as te_recipe

    cls_name, check_name = RECIPES[name]
    if getattr(te_recipe, cls_name, None) is None:
        return False, f"TransformerEngine {te_version()} has no {cls_name}"
    check = getattr(te, check_name, None)
    if check is None:
        return False, f"TransformerEngine {te_version()} has no {check_name}()"
    got = check(return_reason=True)
    ok, why = got if isinstance(got, tuple) else (bool(got), "")
    return bool(ok), str(why)


def rope_freqs(te: Optional[Any], head_dim: int, seq: int, device: torch.device) -> torch.Tensor:
    """RoPE frequencies ``[seq, 1, 1, head_dim]`` (float32): TE's ``RotaryPositionEmbedding`` where TE is given, else
    the same formula in torch (the dry run)."""
    if te is not None:
        rope_cls = getattr(te, "RotaryPositionEmbedding", None)
        if rope_cls is None:
            rope_cls = te.attention.RotaryPositionEmbedding
        return rope_cls(head_dim, rotary_base=ROPE_BASE)(seq).to(device)
    inv = 1.0 / ROPE_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    f = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv)
    return torch.cat((f, f), dim=-1).reshape(seq, 1, 1, head_dim)


class TorchLlamaLayer(nn.Module):
    """The dry run's stand-in for one ``te.TransformerLayer`` of the same configuration, in plain torch."""

    def __init__(self, hidden: int, ffn: int, heads: int, kv_heads: int, out_std: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hidden // heads
        self.norm1 = nn.RMSNorm(hidden, eps=1e-5)
        self.qkv = nn.Linear(hidden, hidden + 2 * kv_heads * self.hd, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden, eps=1e-5)
        self.fc1 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, hidden, bias=False)
        for lin, std in ((self.qkv, INIT_STD), (self.fc1, INIT_STD), (self.proj, out_std), (self.fc2, out_std)):
            nn.init.normal_(lin.weight, 0.0, std)

    @staticmethod
    def _rope(t: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        a, b = t.chunk(2, dim=-1)
        return t * f.cos() + torch.cat((-b, a), dim=-1) * f.sin()

    def forward(self, x: torch.Tensor, rotary_pos_emb: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        kv = self.kv_heads * self.hd
        q, k, v = self.qkv(self.norm1(x)).split([h, kv, kv], dim=-1)
        q = self._rope(q.view(s, b, self.heads, self.hd), rotary_pos_emb).permute(1, 2, 0, 3)
        k = self._rope(k.view(s, b, self.kv_heads, self.hd), rotary_pos_emb).permute(1, 2, 0, 3)
        v = v.view(s, b, self.kv_heads, self.hd).permute(1, 2, 0, 3)
        rep = self.heads // self.kv_heads
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        x = x + self.proj(y.permute(2, 0, 1, 3).reshape(s, b, h))
        a, g = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(a) * g)


class LlamaTE(nn.Module):
    """The benchmark's model; ``forward(input_ids [batch, seq]) -> logits [batch, seq, vocab]``, no host sync.

    ``fp8``: FP8 primary weights and TE's FP8 autocast with ``recipe``; else BF16 TE layers without FP8.
    ``te=None``: the dry run's plain-torch stand-in layers (CPU)."""

    def __init__(self, w: dict, *, fp8: bool, recipe: Any, te: Optional[Any], device: torch.device) -> None:
        super().__init__()
        self.te, self.fp8, self.recipe = te, fp8 and te is not None, recipe
        h, hd = w["hidden"], w["hidden"] // w["heads"]
        out_std = INIT_STD / math.sqrt(2 * w["layers"])
        self.embed = nn.Embedding(w["vocab"], h, device=device)
        nn.init.normal_(self.embed.weight, 0.0, INIT_STD)
        self.register_buffer("rope", rope_freqs(te, hd, w["seq"], device), persistent=False)
        if te is None:
            self.layers = nn.ModuleList(TorchLlamaLayer(h, w["ffn"], w["heads"], w["kv_heads"], out_std).to(device)
                                        for _ in range(w["layers"]))
        else:
            from benchmarks.fp8_refresh import quantized_init

            with quantized_init(recipe) if self.fp8 else contextlib.nullcontext():
                self.layers = nn.ModuleList(
                    te.TransformerLayer(
                        h, w["ffn"], w["heads"], num_gqa_groups=w["kv_heads"], layernorm_epsilon=1e-5,
                        hidden_dropout=0.0, attention_dropout=0.0,
                        init_method=lambda t: nn.init.normal_(t, 0.0, INIT_STD),
                        output_layer_init_method=lambda t: nn.init.normal_(t, 0.0, out_std),
                        layer_number=i + 1, self_attn_mask_type="causal", normalization="RMSNorm",
                        activation="swiglu", bias=False, fuse_qkv_params=True, params_dtype=torch.bfloat16,
                        device=device, attn_input_format="sbhd",
                    )
                    for i in range(w["layers"])
                )
        self.norm = nn.RMSNorm(h, eps=1e-5, device=device)
        self.head = nn.Linear(h, w["vocab"], bias=False, device=device)
        nn.init.normal_(self.head.weight, 0.0, INIT_STD)
        self.act_dtype = torch.bfloat16 if te is not None else torch.float32

    def _autocast(self) -> Any:
        if not self.fp8:
            return contextlib.nullcontext()
        from recipes.gpt import _te_autocast

        return _te_autocast(self.te, self.recipe)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids).transpose(0, 1).to(self.act_dtype).contiguous()  # [seq, batch, hidden]
        with self._autocast():
            for layer in self.layers:
                x = layer(x, rotary_pos_emb=self.rope)
        return self.head(self.norm(x.transpose(0, 1)))


def master_adamw(params: list[torch.nn.Parameter], lr: float, mark_stale: bool) -> torch.optim.Optimizer:
    """``fp8_refresh.MasterWeightAdamW`` (AdamW on FP32 masters, FP8 bytes written in place; capturable on a GPU, the
    non-capturable update torch allows on the CPU in the dry run)."""
    from benchmarks.fp8_refresh import MasterWeightAdamW

    return MasterWeightAdamW(params, lr=lr, mark_stale=mark_stale)


class ScaleLM(pl.LightningModule):
    """The model, the recipe GPT's loss (mean next-token cross entropy in FP32) and the FP32-master AdamW."""

    def __init__(self, w: dict, *, fp8: bool, recipe: Any, te: Optional[Any], lr: float, mark_stale: bool,
                 device: torch.device) -> None:
        super().__init__()
        self.model = LlamaTE(w, fp8=fp8, recipe=recipe, te=te, device=device)
        self.lr, self.mark_stale = lr, mark_stale

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        from recipes.gpt import gpt_loss

        return gpt_loss(self.model(batch["input_ids"]), batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return master_adamw(list(self.parameters()), self.lr, self.mark_stale)


def token_loader(w: dict, seed: int, pin: bool) -> torch.utils.data.DataLoader:
    """``steps`` batches of random windows of the embedded corpus (byte tokens), the same for every run."""
    from recipes.gpt import TokenDataset, load_tokens

    tokens, _ = load_tokens(None)
    ds = TokenDataset(tokens, w["seq"], mode="random", num_samples=w["steps"] * w["batch"], seed=seed)
    return torch.utils.data.DataLoader(ds, batch_size=w["batch"], shuffle=False, drop_last=True, pin_memory=pin)


def quantized_params(module: nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that are TE quantized tensors (``Float8Tensor``, ``Float8BlockwiseQTensor``, ...)."""
    try:
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensor
    except ImportError:
        return []
    return [p for p in module.parameters() if isinstance(p, QuantizedTensor)]


# ------------------------------------------------------------------------------------------------------- callbacks


class TELayerGraphs(pl.Callback):
    """TE's ``make_graphed_callables`` over the model's layers before the first step (the layer forwards are
    replaced by graph replays; the rest of the step stays eager), with the run's FP8 recipe; and, with ``post_step``,
    TE's ``post_all_gather_processing`` on the FP8 weights after every optimizer step: their transposes rewritten in
    place from the bytes the optimizer wrote, which TE asks of an optimizer writing FP8 weights
    (``cache_quantized_params=False``)."""

    def __init__(self, w: dict, post_step: bool) -> None:
        self.w, self.post_step = w, post_step
        self.done = False
        self.seconds = 0.0
        self._hook: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.post_step:
            return
        weights = quantized_params(pl_module)
        try:
            from transformer_engine.pytorch.tensor.utils import post_all_gather_processing
        except ImportError:  # older TE: the same in-place rebuild per tensor
            def post_all_gather_processing(ws: list) -> None:
                for p in ws:
                    if hasattr(p, "_create_transpose"):
                        p._create_transpose()

        def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            with torch.no_grad():
                post_all_gather_processing(weights)

        self._hook = trainer.optimizers[0].register_step_post_hook(hook)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.done:
            return
        self.done = True
        model, w = pl_module.model, self.w
        te = model.te
        t = time.perf_counter()
        layers = tuple(model.layers)
        sample_args = tuple((torch.randn(w["seq"], w["batch"], w["hidden"], device="cuda", dtype=torch.bfloat16,
                                         requires_grad=True),) for _ in layers)
        sample_kwargs = tuple({"rotary_pos_emb": model.rope} for _ in layers)
        kwargs = te_graph_kwargs(te.make_graphed_callables, model.fp8, model.recipe)
        with torch.enable_grad(), torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            te.make_graphed_callables(layers, sample_args, sample_kwargs=sample_kwargs, **kwargs)
        torch.cuda.synchronize()
        self.seconds = time.perf_counter() - t

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def te_graph_kwargs(make_graphed: Any, fp8: bool, recipe: Any) -> dict:
    """``make_graphed_callables``' FP8 arguments under the names this TE takes (2.x: ``enabled``, ``recipe``,
    ``cache_quantized_params``; older: ``fp8_enabled``, ``fp8_recipe``, ``fp8_weight_caching``)."""
    import inspect

    names = inspect.signature(make_graphed).parameters
    if "enabled" in names and "cache_quantized_params" in names:
        return {"enabled": fp8, "recipe": recipe if fp8 else None, "cache_quantized_params": False}
    return {"fp8_enabled": fp8, "fp8_recipe": recipe if fp8 else None, "fp8_weight_caching": False}


class EndChecks(pl.Callback):
    """After the last step, before Lightning's teardown: the peak memory, the FP8 transposes compared with their
    bytes (``verify_fp8_transposes``), and the transposes' cost alone (captured into a graph of their own and
    replayed, as ``benchmarks.fp8_lightning`` times the refresh): one launch (the plugin's refresh) and per tensor
    (TE's ``_create_transpose`` per weight)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.result: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from nemo_cudagraph_plugin.fp8 import iter_fp8_params, verify_fp8_transposes

        r = self.result
        if self.cuda:
            torch.cuda.synchronize()
            r["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            r["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        rep = verify_fp8_transposes(pl_module)
        r["verify"] = {"checked": len(rep.checked), "stale": len(rep.stale),
                       "stale_flagged": len([n for n in rep.stale if n in rep.flagged]), "skipped": len(rep.skipped),
                       "stale_names": sorted(rep.stale)[:8]}
        if not self.cuda or next(iter_fp8_params(pl_module), None) is None:
            return
        from benchmarks.fp8_lightning import _time_refresh_graph
        from nemo_cudagraph_plugin.fp8._multi_transpose import triton_available

        for key, fused in (("refresh_fused_ms", True), ("refresh_per_tensor_ms", False)):
            if fused and not triton_available():
                r.setdefault("notes", []).append("no Triton: the one-launch refresh was not timed")
                continue
            try:
                r[key] = _time_refresh_graph(pl_module, fused)
            except Exception as exc:  # noqa: BLE001 - a failed timing is reported, the run stands
                r.setdefault("notes", []).append(f"{key}: {type(exc).__name__}: {str(exc)[:160]}")


# ------------------------------------------------------------------------------------------------------------ runs


def env_info(cuda: bool) -> dict:
    info = hchild.env_info(cuda)
    info.pop("transformers", None)
    info["transformer_engine"] = te_version()
    if cuda:
        info["capability"] = list(torch.cuda.get_device_capability())
        info["cudnn"] = torch.backends.cudnn.version()
    return info


def fp8_gemm_ceiling(n: int = 8192, reps: int = 20) -> float:
    """The FP8 (E4M3) GEMM rate of ``torch._scaled_mm`` on ``n³`` GEMMs with BF16 output and fast accumulation,
    TFLOP/s."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    for _ in range(3):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def run_probe(job: dict) -> dict:
    """Once per session: versions, TE's answer for every recipe asked for, the BF16 and FP8 GEMM ceilings."""
    cuda = job["device"] == "cuda"
    out: dict[str, Any] = {"env": env_info(cuda), "notes": []}
    if not cuda:
        out["support"] = {r: [True, "dry run: plain-torch stand-in, no FP8"] for r in job["recipes"]}
        return out
    te = import_te()
    out["env"]["transformer_engine"] = te_version()
    out["support"] = {r: list(recipe_support(te, r)) for r in job["recipes"]}
    ceilings: dict[str, float] = {"bf16_tflops": hchild.matmul_ceiling()["matmul_tflops"]}
    try:
        ceilings["fp8_tflops"] = fp8_gemm_ceiling()
    except Exception as exc:  # noqa: BLE001 - information only
        out["notes"].append(f"FP8 GEMM ceiling: {type(exc).__name__}: {str(exc)[:160]}")
    out["ceilings"] = ceilings
    return out


def run_variant(job: dict) -> dict:
    """Train one variant of one recipe group; the record's measured fields."""
    w, v = job["workload"], VARIANTS[job["variant"]]
    cuda = job["device"] == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    out: dict[str, Any] = {"notes": []}
    te = recipe = None
    if cuda:
        te = import_te()
    out["env"] = env_info(cuda)
    if cuda:
        if v.fp8:
            ok, why = recipe_support(te, w["recipe"])
            if not ok:  # the parent leaves such recipes out after its probe; this is the same answer, later
                raise RuntimeError(f"not run: TE says this GPU cannot run {RECIPES[w['recipe']][0]}: {why}")
            recipe = make_recipe(w["recipe"])
    else:
        out["notes"].append("dry run: plain-torch stand-in layers on the CPU (no TE, no FP8)")
    callbacks: list[pl.Callback] = []
    if v.ours:
        from nemo_cudagraph_plugin import CudaGraphCallback

        callbacks.append(CudaGraphCallback(**dict(v.options)))
        if not cuda:
            out["notes"].append("CPU: the callback trains eagerly (no CUDA)")
    graphs = None
    if v.te_graphs:
        if cuda:
            graphs = TELayerGraphs(w, post_step=v.te_post_step)
            callbacks.append(graphs)
        else:
            out["notes"].append("dry run: TE's graphed layers need TE and CUDA; eager")
    hchild.fresh_start(job["seed"], cuda)
    t = time.perf_counter()
    module = ScaleLM(w, fp8=v.fp8, recipe=recipe, te=te, lr=job["lr"], mark_stale=v.writer == "te-flags",
                     device=device)
    if cuda:
        torch.cuda.synchronize()
    qparams = quantized_params(module) if cuda else []
    out.update(build_s=time.perf_counter() - t, n_params=sum(p.numel() for p in module.parameters()),
               n_matmul_params=sum(p.numel() for n, p in module.named_parameters() if p.dim() == 2 and "embed" not in n),
               n_matmul_params_formula=matmul_params(w), fp8_params=len(qparams),
               fp8_param_class=type(qparams[0]).__name__ if qparams else None,
               recipe_class=type(recipe).__name__ if recipe is not None else None)
    probe = hchild.make_probe(job)
    end = EndChecks(cuda)
    trainer = pl.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision=job["precision"],
                         max_steps=w["steps"], callbacks=[*callbacks, probe, end], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, gradient_clip_val=job["clip"] or None)
    t = time.perf_counter()
    trainer.fit(module, train_dataloaders=token_loader(w, job["seed"], pin=cuda))
    if cuda:
        torch.cuda.synchronize()
    out["fit_s"] = time.perf_counter() - t
    out.update(probe.summary())
    notes = end.result.pop("notes", [])
    out.update(end.result)
    out["notes"] += notes
    if graphs is not None:
        out["te_graphs_s"] = graphs.seconds
    for cb in callbacks:
        if hasattr(cb, "stats"):
            out["stats"] = hchild.stats_record(cb.stats)
            reason = getattr(cb, "eager_reason", None)
            if reason:
                out["notes"].append(f"trained eagerly: {reason}")
    return out


def run_job(job: dict) -> dict:
    """The probe or one variant; the deterministic settings before TE or cuBLAS start."""
    # TE reads it when it picks the attention backend: "0" keeps cuDNN's fused attention on Hopper, deterministic
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0" if job.get("deterministic") else "1"
    return run_probe(job) if job["kind"] == "probe" else run_variant(job)


def child_main(job_path: Path, record_path: Path) -> int:
    """``python -m benchmarks.fp8_scale --child JOB --record RECORD``: the harness's child with this benchmark's
    jobs."""
    return hchild.child_main(job_path, record_path, run=run_job)


if __name__ == "__main__":
    sys.exit(child_main(Path(sys.argv[1]), Path(sys.argv[2])))
