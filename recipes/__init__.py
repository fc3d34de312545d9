"""Training recipes for ``nemo_cudagraph_plugin``.

* :mod:`recipes.gpt` — a small GPT model (plain PyTorch, and an FP8 TransformerEngine variant), the byte-level
  tokenizer, the embedded public-domain corpus, ``GPTDataModule`` and ``GPTLightningModule``. Reused by the
  benchmarks and the GPU tests.
* :mod:`recipes.gpt_pretrain` — the ``gpt-pretrain`` command line (``python -m recipes.gpt_pretrain``).
"""

from recipes.gpt import (
    GPT,
    PRESETS,
    TEGPT,
    ByteTokenizer,
    GPTConfig,
    GPTDataModule,
    GPTLightningModule,
    TokenDataset,
    TransformerEngineUnavailable,
    build_model,
    get_config,
    gpt_loss,
    load_embedded_corpus,
    load_tokens,
)

__all__ = [
    "GPT",
    "PRESETS",
    "TEGPT",
    "ByteTokenizer",
    "GPTConfig",
    "GPTDataModule",
    "GPTLightningModule",
    "TokenDataset",
    "TransformerEngineUnavailable",
    "build_model",
    "get_config",
    "gpt_loss",
    "load_embedded_corpus",
    "load_tokens",
]
