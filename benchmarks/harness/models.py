"""The harness's LightningModule, its data and optimizer: what a user of Lightning writes, nothing about graphs.

One module for every kind of workload: a Hugging Face ``LlamaForCausalLM`` or ``Qwen3MoeForCausalLM`` built from a
config (its own loss from ``labels``; the MoE model's includes the router's auxiliary loss) or the recipe's GPT (``recipes/gpt.py``, :func:`recipes.gpt.gpt_loss`). ``training_step`` returns the loss
and logs it (no progress bar: a progress-bar metric reads the loss on the host every step); ``configure_optimizers``
gives AdamW (weight decay on >= 2-D weights) and a ``LambdaLR`` stepped every step: linear warm-up over the first
tenth of the steps, then cosine decay to a tenth of the peak. NeMo's variant gets the same schedule as a
``_LRScheduler`` subclass (:class:`WarmupCosineLR`), the only kind NeMo's callback accepts.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from recipes.gpt import GPT, get_config, gpt_loss

from .workloads import Workload


def build_model(w: Workload) -> nn.Module:
    """The workload's model with fresh weights (from the current RNG state; nothing downloaded)."""
    if w.kind == "llama":
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=w.vocab, hidden_size=w.hidden, intermediate_size=w.intermediate,
                                       num_hidden_layers=w.layers, num_attention_heads=w.heads,
                                       num_key_value_heads=w.kv_heads, max_position_embeddings=max(2048, w.seq))
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        if w.host_read == "layer":
            model.model.layers[1] = HostCheck(model.model.layers[1])
        return model
    if w.kind == "moe":
        import transformers

        cfg = transformers.Qwen3MoeConfig(vocab_size=w.vocab, hidden_size=w.hidden, intermediate_size=w.intermediate
                                          or 4 * w.hidden, moe_intermediate_size=w.expert_intermediate,
                                          num_hidden_layers=w.layers, num_attention_heads=w.heads,
                                          num_key_value_heads=w.kv_heads, head_dim=w.hidden // w.heads,
                                          num_experts=w.experts, num_experts_per_tok=w.top_k, decoder_sparse_step=1,
                                          output_router_logits=True, max_position_embeddings=max(2048, w.seq))
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    if w.kind == "gpt":
        return GPT(gpt_config(w))
    raise ValueError(f"unknown workload kind {w.kind!r}")


class HostCheck(nn.Module):
    """A user's module around a decoder layer that asks the host about the hidden states (a read of the host in the
    step: the partial tier's case)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if hidden_states.abs().max() > 1e4:
            hidden_states = hidden_states.clamp(-1e4, 1e4)
        return self.inner(hidden_states, *args, **kwargs)


def gpt_config(w: Workload) -> Any:
    """The recipe preset of a ``gpt`` workload with the workload's shape."""
    return get_config(w.preset or "tiny", n_layer=w.layers, n_embd=w.hidden, n_head=w.heads, seq_len=w.seq,
                      batch_size=w.batch, vocab_size=w.vocab)


def param_counts(model: nn.Module) -> tuple[int, int]:
    """(all parameters, parameters that multiply activations): the second leaves out the embedding tables, except
    an LM head tied to one (it is a matmul, counted once), and of each mixture-of-experts layer counts the experts a
    token is routed to (``top_k`` of them), not all."""
    unique = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in unique.values())
    tables = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "head", None)
    tied = head is not None and id(head.weight) in tables
    config = getattr(model, "config", None)
    experts, top_k = getattr(config, "num_experts", 0) or 0, getattr(config, "num_experts_per_tok", 0) or 0
    idle = 0
    if experts and top_k:
        expert_weights = sum(p.numel() for m in model.modules() if type(m).__name__.endswith("Experts")
                             for p in m.parameters(recurse=False))
        idle = expert_weights * (experts - top_k) // experts
    return total, total - sum(tables.values()) + (head.weight.numel() if tied else 0) - idle


def lr_lambda(steps: int) -> Any:
    """Linear warm-up over ``max(1, steps // 10)`` steps, then cosine to 0.1 at ``steps``."""
    warm = max(1, steps // 10)

    def at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = min(1.0, (step - warm) / max(1, steps - warm))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    return at


class WarmupCosineLR(torch.optim.lr_scheduler._LRScheduler):
    """:func:`lr_lambda`'s schedule as a subclass of torch's ``_LRScheduler``, as NeMo's own schedulers are.

    NeMo 3.0.0's ``CUDAGraphCallback`` asserts ``isinstance(scheduler, _LRScheduler)`` on train start, which no
    scheduler of ``torch.optim.lr_scheduler`` passes (they derive from ``LRScheduler``, of which ``_LRScheduler`` is
    a subclass). The learning rates are ``LambdaLR``'s: each is ``base_lr * lr_lambda(steps)(step)`` (a tensor where
    the optimizer's lr is one, as NeMo's callback needs).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        self.at = lr_lambda(steps)
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [base * self.at(self.last_epoch) for base in self.base_lrs]


class BenchLM(pl.LightningModule):
    """The workload's model trained on next-token loss.

    Args:
        workload: the model and batch shape.
        compile_mode: ``torch.compile`` mode applied to the model in ``configure_model`` (None: eager).
        compile_backend: a ``torch.compile`` backend instead of inductor and the mode (the CPU smoke run: ``"eager"``).
        optim: ``"adamw"`` (torch's default, foreach, implementation) or ``"fused_adamw"``. Lightning refuses
            gradient clipping with a fused optimizer under ``bf16-mixed`` (it unscales internally).
        capturable: ``AdamW(capturable=True)`` (NeMo's callback needs it and does not set it).
        schedule: the warm-up + cosine ``LambdaLR`` over ``max_steps``, stepped every step.
        nemo_schedule: that schedule as :class:`WarmupCosineLR` (NeMo's callback accepts no ``LambdaLR``), and with
            ``capturable`` the learning rate a 0-d device tensor (NeMo's callback copies the schedule's values into
            tensors, and a float would be frozen into its graph).
        log: ``self.log("train_loss", loss)`` in the step.
        device: where the weights are created (on the GPU a 1 B model initialises in a fraction of the CPU's time).
    """

    def __init__(self, workload: Workload, *, compile_mode: Optional[str] = None,
                 compile_backend: Optional[str] = None, optim: str = "adamw",
                 capturable: bool = False, schedule: bool = True, nemo_schedule: bool = False, max_steps: int = 100,
                 lr: float = 3e-4, log: bool = True, device: Optional[str] = None) -> None:
        super().__init__()
        self.workload, self.compile_mode, self.compile_backend = workload, compile_mode, compile_backend
        self.optim_kind = optim
        self.capturable, self.schedule, self.max_steps, self.lr, self.log_loss = capturable, schedule, max_steps, lr, log
        self.nemo_schedule = nemo_schedule
        with torch.device(device or "cpu"):
            self.model = build_model(workload)
        self.n_params, self.n_matmul_params = param_counts(self.model)

    def configure_model(self) -> None:
        if self.compile_mode is not None and not hasattr(self.model, "_orig_mod"):
            if self.compile_backend is not None:
                kw: dict[str, Any] = {"backend": self.compile_backend}
            else:
                kw = {} if self.compile_mode == "default" else {"mode": self.compile_mode}
            self.model = torch.compile(self.model, **kw)

    def loss(self, batch: dict) -> torch.Tensor:
        if self.workload.kind == "gpt":
            return gpt_loss(self.model(batch["input_ids"]), batch["labels"])
        if self.workload.host_read == "packed":
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"],
                              position_ids=self.packed_positions(batch["input_ids"]), use_cache=False).loss
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss  # llama, moe

    def packed_positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Two documents per row: positions restart at the middle of each row (made once per shape, on the device)."""
        pos = getattr(self, "_packed", None)
        if pos is None or pos.shape != ids.shape or pos.device != ids.device:
            half = ids.shape[1] // 2
            pos = torch.cat([torch.arange(half), torch.arange(ids.shape[1] - half)]).to(ids.device).expand_as(ids)
            self._packed = pos
        return pos

    def training_step(self, batch: dict, batch_idx: Optional[int] = None) -> torch.Tensor:
        # batch_idx optional: NeMo's callback calls training_step(batch)
        loss = self.loss(batch)
        if self.workload.host_read == "loss":
            self.last_loss = loss.item()  # a host read every step (the partial tier's case)
        if self.log_loss:
            self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        rest = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        kw: dict[str, Any] = {"fused": True} if self.optim_kind == "fused_adamw" else {}
        # NeMo's callback copies the scheduler's learning rates into the first ones it saw (tensor.copy_): with a
        # float lr it fails, and an lr that is not a device tensor would be frozen into its graph.
        lr: Any = torch.tensor(self.lr, device=self.device) if self.nemo_schedule and self.capturable else self.lr
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=lr, betas=(0.9, 0.95), capturable=self.capturable, **kw)
        if not self.schedule:
            return opt
        if self.nemo_schedule:
            sched: Any = WarmupCosineLR(opt, self.max_steps)
        else:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(self.max_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TokenWindows(Dataset):
    """Fixed random token windows: every variant of a workload sees the same batches in the same order.

    ``gpt``: ``labels`` are the inputs shifted by one (the recipe's loss); ``llama``: ``labels`` equal the inputs
    (Hugging Face shifts them inside its loss).
    """

    def __init__(self, n: int, seq: int, vocab: int, seed: int, shifted: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=g)
        self.shifted = shifted

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        x = self.data[i]
        if self.shifted:
            return {"input_ids": x[:-1], "labels": x[1:]}
        return {"input_ids": x[:-1], "labels": x[:-1]}


def token_loader(w: Workload, steps: int, seed: int, pin: bool) -> DataLoader:
    """``steps`` batches of the workload's shape, in order."""
    ds = TokenWindows(steps * w.batch, w.seq, w.vocab, seed, shifted=w.kind == "gpt")
    return DataLoader(ds, batch_size=w.batch, shuffle=False, drop_last=True, pin_memory=pin)
