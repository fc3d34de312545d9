"""Hugging Face causal LMs built from configs (nothing downloaded), in a plain LightningModule, and their data.

Shared by the CPU tests (``tests/test_hf_cpu.py``, CPU tape) and the GPU model zoo (``tests/gpu/test_zoo_gpu.py``).
The LightningModule is what a user writes: the model's own loss from ``labels``, ``self.log``, AdamW; nothing in it
knows about CUDA graphs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import Dataset

if os.environ.get("NCG_REQUIRE_ZOO") == "1":  # CI's unit stage installs the zoo extra: a skip would hide a failure
    import transformers
else:
    transformers = pytest.importorskip("transformers")

VOCAB = 512


def llama(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, **kw: Any) -> Any:
    """Llama: GQA, RoPE, SwiGLU, RMSNorm."""
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                    max_position_embeddings=2048, attn_implementation="sdpa", **kw)


def qwen2(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, **kw: Any) -> Any:
    """Qwen2: tied embeddings, bias on q/k/v."""
    return transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                    max_position_embeddings=2048, tie_word_embeddings=True,
                                    attn_implementation="sdpa", **kw)


def gpt2(hidden: int = 64, layers: int = 2, heads: int = 4, **kw: Any) -> Any:
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=2048,
                                   attn_implementation="sdpa", **kw)


def mixtral(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, experts: int = 4,
            **kw: Any) -> Any:
    """Mixtral: top-2 routing over ``experts`` experts."""
    return transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, num_local_experts=experts, num_experts_per_tok=2,
                                      max_position_embeddings=2048, attn_implementation="sdpa", **kw)


def qwen3_moe(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, experts: int = 8,
              **kw: Any) -> Any:
    """Qwen3-MoE: top-2 of ``experts`` fine-grained experts in every layer, q/k norms."""
    return transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                       moe_intermediate_size=hidden, num_hidden_layers=layers,
                                       num_attention_heads=heads, num_key_value_heads=kv_heads,
                                       head_dim=hidden // heads, num_experts=experts, num_experts_per_tok=2,
                                       decoder_sparse_step=1, max_position_embeddings=2048,
                                       attn_implementation="sdpa", **kw)


def qwen2_moe(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, experts: int = 8,
              **kw: Any) -> Any:
    """Qwen2-MoE: top-2 of ``experts`` routed experts plus a gated shared expert."""
    return transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                       moe_intermediate_size=hidden, shared_expert_intermediate_size=2 * hidden,
                                       num_hidden_layers=layers, num_attention_heads=heads,
                                       num_key_value_heads=kv_heads, num_experts=experts, num_experts_per_tok=2,
                                       decoder_sparse_step=1, max_position_embeddings=2048,
                                       attn_implementation="sdpa", **kw)


def deepseek_v3(hidden: int = 64, layers: int = 2, heads: int = 4, experts: int = 8, **kw: Any) -> Any:
    """DeepSeek-V3, small: multi-head latent attention, a dense first layer, then group-limited top-2 routing over
    ``experts`` experts (2 groups) with a shared expert."""
    return transformers.DeepseekV3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                         moe_intermediate_size=hidden, num_hidden_layers=layers,
                                         num_attention_heads=heads, num_key_value_heads=heads,
                                         n_routed_experts=experts, num_experts_per_tok=2, n_group=2, topk_group=1,
                                         n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=hidden // 2,
                                         kv_lora_rank=hidden // 2, qk_rope_head_dim=hidden // heads // 2,
                                         qk_nope_head_dim=hidden // heads // 2, v_head_dim=hidden // heads,
                                         max_position_embeddings=2048, attn_implementation="sdpa", **kw)


class HFCausalLM(pl.LightningModule):
    """``AutoModelForCausalLM.from_config(config)`` trained on its own loss.

    Args:
        config: a transformers config (a fresh copy per module: HF's ``set_attn_implementation`` writes to it).
        padded: pass ``attention_mask`` (batches are right-padded; padded labels are -100).
        use_cache: what ``training_step`` passes as ``use_cache`` (``None``: the model's default).
        compile_kw: ``torch.compile`` keywords for the model, applied in ``configure_model``.
        prepare: called with the model in ``configure_model`` (e.g. gradient checkpointing).
        fused: a fused AdamW (Lightning refuses clipping with a fused optimizer under mixed precision); else
            torch's default implementation.
        experts: the MoE experts implementation the model is built with (transformers 5's
            ``experts_implementation``; ``None``: HF's default).
    """

    def __init__(self, config: Any, lr: float = 2.0**-10, padded: bool = False, use_cache: Optional[bool] = False,
                 compile_kw: Optional[dict] = None, prepare: Optional[Callable[[Any], None]] = None,
                 seed: int = 0, schedule: bool = False, max_steps: int = 100, fused: bool = True,
                 experts: Optional[str] = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        kw = {"experts_implementation": experts} if experts is not None else {}
        self.model = transformers.AutoModelForCausalLM.from_config(config.__class__.from_dict(config.to_dict()),
                                                                   attn_implementation="sdpa", **kw)
        self.lr, self.padded, self.use_cache, self.schedule, self.max_steps = lr, padded, use_cache, schedule, max_steps
        self.compile_kw, self.prepare, self.fused = compile_kw, prepare, fused

    def configure_model(self) -> None:
        if self.prepare is not None and not getattr(self, "_prepared", False):
            self.prepare(self.model)
            self._prepared = True
        if self.compile_kw is not None and not hasattr(self.model, "_orig_mod"):
            self.model = torch.compile(self.model, **self.compile_kw)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        kw = {"attention_mask": batch["attention_mask"]} if self.padded else {}
        if self.use_cache is not None:
            kw["use_cache"] = self.use_cache
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"], **kw).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=self.lr, betas=(0.9, 0.95), fused=self.fused or None)
        if not self.schedule:
            return opt
        warm = max(1, self.max_steps // 10)

        def lr_at(step: int) -> float:  # linear warm-up, then cosine to 10 %
            if step < warm:
                return (step + 1) / warm
            t = min(1.0, (step - warm) / max(1, self.max_steps - warm))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TokenBatches(Dataset):
    """``n`` batches of ``batch`` x ``seq`` random tokens (one item per batch: use ``batch_size=None``).

    ``pad``: right padding of a varying number of tokens in every row but the first (``attention_mask`` 0 there,
    labels -100), so each batch pads differently. ``skew``: every other batch draws its tokens from 4 token ids only,
    so a mixture-of-experts router sends its tokens to few experts, while the batches between spread them.
    """

    def __init__(self, n: int, batch: int = 2, seq: int = 32, pad: bool = False, seed: int = 0,
                 skew: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            ids = torch.randint(0, 4 if skew and i % 2 else VOCAB, (batch, seq), generator=g)
            mask = torch.ones(batch, seq, dtype=torch.long)
            if pad:
                for r in range(1, batch):
                    mask[r, seq - 1 - (i + r) % (seq // 2):] = 0
            self.items.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]
