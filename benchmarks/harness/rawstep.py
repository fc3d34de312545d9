"""A GPT preset's whole training step as one hand-written ``torch.cuda.CUDAGraph``, without Lightning.

For the probes that study the graph itself (``benchmarks/graph_memsets.py``, ``benchmarks/step_boundary.py``): bf16
parameters, fused AdamW (``capturable=True``), no clipping, no schedule; gradients owned by the graph (set to None
before capture), batches pre-staged on the GPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from recipes.gpt import GPT, get_config, gpt_loss

from .models import TokenWindows


@dataclass
class RawStep:
    """The captured step: ``static`` is its input buffer (a ``[batch, seq + 1]`` token window), ``out`` its loss."""

    model: Any
    opt: torch.optim.Optimizer
    data: torch.Tensor
    static: torch.Tensor
    graph: Any
    out: torch.Tensor
    warmup_losses: list[torch.Tensor]


def prepare(preset: str, steps: int, seed: int = 0, device: str = "cuda") -> tuple[Any, torch.optim.Optimizer, torch.Tensor]:
    """The preset's GPT in bf16 with a fused capturable AdamW, and ``steps`` batches on the device."""
    cfg = get_config(preset)
    torch.manual_seed(seed)
    model = GPT(cfg).to(device=device, dtype=torch.bfloat16)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), capturable=True, fused=True)
    data = TokenWindows(steps * cfg.batch_size, cfg.seq_len, cfg.vocab_size, seed, shifted=True).data
    return model, opt, data.reshape(steps, cfg.batch_size, cfg.seq_len + 1).to(device)


def step_fn(model: Any, opt: torch.optim.Optimizer, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Forward, backward and optimizer step on the window in ``x`` (no zero-grad)."""

    def step() -> torch.Tensor:
        loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def capture_raw_step(preset: str, steps: int, seed: int = 0, warmup: int = 3, keep_graph: bool = False) -> RawStep:
    """``warmup`` eager steps on a side stream, then the capture. ``keep_graph``: not instantiated yet (its nodes
    can be rewritten first; ``graph.instantiate()`` or the first replay does it)."""
    model, opt, data = prepare(preset, steps, seed)
    static = data[0].clone()
    step = step_fn(model, opt, static)
    losses = []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with warnings.catch_warnings(), torch.cuda.stream(s):
        warnings.simplefilter("ignore")  # "capturable=True but step() runs without graph capture"
        for i in range(warmup):
            static.copy_(data[i])
            opt.zero_grad(set_to_none=True)
            losses.append(step().clone())
    torch.cuda.current_stream().wait_stream(s)
    opt.zero_grad(set_to_none=True)  # backward inside the graph allocates the gradients from its pool
    g = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    torch.cuda.synchronize()
    return RawStep(model, opt, data, static, g, out, losses)
