"""Shared pieces of the GPU tests: a recorder callback, trainer factory and small models."""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from nemo_cudagraph_plugin.core.config import CaptureConfig
from nemo_cudagraph_plugin.core.optim import OptimizerPrep
from recipes.gpt import GPTLightningModule, get_config


class Recorder(pl.Callback):
    """Keeps every step's loss (the tensor Lightning got back) and the logged train_loss."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.logged: list[torch.Tensor] = []
        self.global_steps: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"])
        m = trainer.callback_metrics.get("train_loss")
        if m is not None:
            self.logged.append(m.detach().clone())
        self.global_steps.append(trainer.global_step)

    def loss_tensor(self) -> torch.Tensor:
        return torch.stack([x.float() for x in self.losses]).cpu()


class CapturableEager(pl.Callback):
    """Eager reference with the optimizer configured exactly as under graphs (capturable, tensor lr).

    Graph replay and this eager run then execute the same kernels, so they must agree bit for bit.
    """

    def __init__(self, math: Optional[str] = None) -> None:
        # the callback's optimizer_math (its default where None): the user's own update where it covers the optimizer
        self.math = math or CaptureConfig().optimizer_math

    def on_train_start(self, trainer, pl_module):
        self.prep = OptimizerPrep(trainer.optimizers[0], pl_module.device, math=self.math,
                                  step_count=lambda: trainer.global_step)
        self.prep.apply()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.prep.sync_hyperparams()  # what the graph path does before each replay


class TokenWindows(Dataset):
    """Random token windows, optionally with a sequence length that cycles through ``lengths``."""

    def __init__(self, n: int, lengths: list[int], vocab: int = 256, seed: int = 0, batch_size: int = 2) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            t = lengths[(i // batch_size) % len(lengths)]
            x = torch.randint(0, vocab, (t + 1,), generator=g)
            self.items.append({"input_ids": x[:-1], "labels": x[1:]})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def loader(steps: int, batch_size: int = 2, lengths: Optional[list[int]] = None, seed: int = 0) -> DataLoader:
    lengths = lengths or [128]
    return DataLoader(TokenWindows(steps * batch_size, lengths, seed=seed, batch_size=batch_size), batch_size=batch_size, shuffle=False)


def make_module(seed: int = 0, dropout: float = 0.0, n_layer: int = 2, **kw: Any) -> GPTLightningModule:
    pl.seed_everything(seed, verbose=False)
    cfg = get_config("tiny", n_layer=n_layer, seq_len=256, dropout=dropout)
    return GPTLightningModule(cfg, **kw)


def fit(module: pl.LightningModule, callbacks: list, steps: int, train_loader=None, val_loader=None, **trainer_kw: Any):
    rec = Recorder()
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=steps,
        callbacks=[*callbacks, rec],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kw,
    )
    trainer.fit(module, train_dataloaders=train_loader or loader(steps), val_dataloaders=val_loader)
    return trainer, rec


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp_min(1e-12)).max())


def finite(x: float) -> bool:
    return math.isfinite(x)
