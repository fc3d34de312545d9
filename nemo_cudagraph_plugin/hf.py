"""Hugging Face ``transformers`` models inside a captured step: padded batches without a host sync.

With ``attn_implementation="sdpa"`` (HF's default), a model called with a 2-D ``attention_mask`` asks the host
whether the mask pads anything (``padding_mask.all()`` in ``transformers.masking_utils``), so that an unpadded
batch can use SDPA's ``is_causal=True`` instead of a mask. That read waits for the GPU: a CUDA graph cannot
capture it, and the capture is refused at that line.

:func:`graph_safe_attention` switches such models to :data:`SDPA_GRAPH_SAFE`, registered through HF's public
``AttentionInterface`` / ``AttentionMaskInterface``: the same SDPA attention function, with a mask function that
never asks the host. A batch with an ``attention_mask`` always gets the boolean mask HF builds for a padded batch
(for a batch that pads nothing this is SDPA with a mask of all-causal entries instead of ``is_causal``: the same
function, other kernels); a batch without one keeps ``is_causal``. Padded batches therefore train exactly as with
``"sdpa"``. ``CudaGraphCallback`` / ``CudaGraphStrategy`` apply it before the first step when they capture
(``hf_attention="graph_safe"``, the default), so user code needs no change, and put them back to ``"sdpa"`` after ``fit``.

Other attention implementations are left as they are: ``"eager"`` builds its mask without a host read, and
flash-attention's variable-length path (``flash_attention_2`` with padding) reads sequence lengths on the host and
is refused at capture with that line.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

__all__ = ["SDPA_GRAPH_SAFE", "graph_safe_attention", "has_hf_models", "restore_attention"]

#: The attention implementation :func:`graph_safe_attention` registers and switches ``"sdpa"`` models to.
SDPA_GRAPH_SAFE = "sdpa_graph_safe"


def _sdpa_mask_no_host_read(*args: Any, attention_mask: Any = None, **kwargs: Any) -> Any:
    from transformers.masking_utils import sdpa_mask

    # ``allow_is_causal_skip`` is what makes HF read the padding mask on the host; without a padding mask the skip
    # reads nothing (``padding_mask is None`` decides it), so ``is_causal`` stays for unmasked batches.
    if attention_mask is not None:
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SDPA_GRAPH_SAFE, sdpa_attention_forward)
    AttentionMaskInterface.register(SDPA_GRAPH_SAFE, _sdpa_mask_no_host_read)


def has_hf_models(module: nn.Module) -> bool:
    """Whether ``module`` holds a ``transformers.PreTrainedModel`` (without importing ``transformers``)."""
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return any(isinstance(m, PreTrainedModel) for m in module.modules())


def graph_safe_attention(module: nn.Module) -> list[str]:
    """Switch every HF model in ``module`` whose attention is ``"sdpa"`` to :data:`SDPA_GRAPH_SAFE`.

    Returns the names (as ``module.named_modules()`` gives them; ``""`` for ``module`` itself) of the models
    switched. Models with another attention implementation are left alone. Call it before training (e.g. in
    ``configure_model``) when graphs are captured by other means than this package's callback or strategy, and
    for an eager reference run that should use the same kernels as the graphed one.
    """
    if not has_hf_models(module):
        return []
    from transformers import PreTrainedModel

    _register()
    switched = []
    for name, m in module.named_modules():
        # An outer model switches the models inside it (LlamaModel inside LlamaForCausalLM shares its config), so
        # those read as switched by the time the walk reaches them.
        if isinstance(m, PreTrainedModel) and m.config._attn_implementation == "sdpa":
            m.set_attn_implementation(SDPA_GRAPH_SAFE)
            switched.append(name)
    return switched


def restore_attention(module: nn.Module, switched: list[str]) -> None:
    """Put the models that :func:`graph_safe_attention` switched (its return value) back to ``"sdpa"``."""
    models = dict(module.named_modules())
    for name in switched:
        m = models.get(name)
        if m is not None and m.config._attn_implementation == SDPA_GRAPH_SAFE:
            m.set_attn_implementation("sdpa")

