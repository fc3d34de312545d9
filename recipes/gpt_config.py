"""The GPT recipe's model shapes and presets, without torch: the command line's help and checks read them before
torch is imported (re-exported by :mod:`recipes.gpt`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["PRESETS", "GPTConfig", "get_config"]


@dataclass(frozen=True)
class GPTConfig:
    """Model shape plus the default batch shape of a preset.

    ``seq_len`` is both the training sequence length and the size of the learned position table: the model
    accepts any input length ``<= seq_len``. ``batch_size`` is the per-device micro-batch the recipe uses for
    this preset; the model itself does not depend on it.
    """

    vocab_size: int = 256
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    seq_len: int = 256
    batch_size: int = 2
    dropout: float = 0.0
    mlp_ratio: int = 4
    bias: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_embd", "n_head", "seq_len", "batch_size", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                "change one of them"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def replace(self, **changes: Any) -> GPTConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def num_params(self) -> int:
        """Parameter count of :class:`GPT` for this config (tied head counted once)."""
        d, f = self.n_embd, self.n_embd * self.mlp_ratio
        b = 1 if self.bias else 0
        per_block = (
            2 * 2 * d  # two LayerNorms
            + d * 3 * d + b * 3 * d  # qkv
            + d * d + b * d  # attention out
            + d * f + b * f  # fc
            + f * d + b * d  # proj
        )
        return self.vocab_size * d + self.seq_len * d + self.n_layer * per_block + 2 * d


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_embd=256, n_head=4, seq_len=256, batch_size=2),
    "small": GPTConfig(n_layer=12, n_embd=768, n_head=12, seq_len=512, batch_size=4),
    "medium": GPTConfig(n_layer=24, n_embd=1024, n_head=16, seq_len=1024, batch_size=8),
}
"""Model size presets. ``vocab_size`` is the byte tokenizer's (256); :func:`get_config` replaces it with the
vocabulary of the data actually used."""


def get_config(preset: str = "tiny", **overrides: Any) -> GPTConfig:
    """The preset ``preset`` with ``overrides`` applied; ``None`` overrides are ignored."""
    try:
        base = PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}") from None
    return base.replace(**{k: v for k, v in overrides.items() if v is not None})
