"""Training recipes for ``nemo_cudagraph_plugin``.

* :mod:`recipes.gpt` — a small GPT model (plain PyTorch, and an FP8 TransformerEngine variant), the byte-level
  tokenizer, the embedded public-domain corpus, ``GPTDataModule`` and ``GPTLightningModule``. Reused by the
  benchmarks and the GPU tests.
* :mod:`recipes.gpt_pretrain` — the ``gpt-pretrain`` command line (``python -m recipes.gpt_pretrain``).
"""

from recipes import gpt
from recipes.gpt import *  # noqa: F403 - the package re-exports recipes.gpt's public API, listed once there

__all__ = list(gpt.__all__)
