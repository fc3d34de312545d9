"""Training recipes for ``nemo_cudagraph_plugin``.

* :mod:`recipes.gpt` — a small GPT model (plain PyTorch, and an FP8 TransformerEngine variant), the byte-level
  tokenizer, the embedded public-domain corpus, ``GPTDataModule`` and ``GPTLightningModule``. Reused by the
  benchmarks and the GPU tests.
* :mod:`recipes.gpt_pretrain` — the ``gpt-pretrain`` command line (``python -m recipes.gpt_pretrain``).

The package re-exports :mod:`recipes.gpt`'s public API (listed once there) on first access, so that the command
line's ``--help`` answers before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__") and name != "__all__" or name in ("gpt", "gpt_config", "gpt_pretrain", "pretrain_cli"):
        # dunders the import system probes, and submodules not imported yet: not recipes.gpt's names
        raise AttributeError(f"module 'recipes' has no attribute {name!r}")
    gpt = importlib.import_module("recipes.gpt")
    if name == "__all__":
        return list(gpt.__all__)
    if name in gpt.__all__:
        return getattr(gpt, name)
    raise AttributeError(f"module 'recipes' has no attribute {name!r}")
