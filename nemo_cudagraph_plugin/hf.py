"""Hugging Face ``transformers`` models inside a captured step: attention masks and mixture-of-experts layers
without host reads.

**Attention** (``hf_attention="graph_safe"``). With ``attn_implementation="sdpa"`` (HF's default) a model asks the
host about its batch before building the attention mask, and a CUDA graph cannot capture that read:

* a 2-D ``attention_mask``: whether it pads anything (``padding_mask.all()`` in ``transformers.masking_utils``), so
  that an unpadded batch can use SDPA's ``is_causal=True`` instead of a mask;
* no ``attention_mask`` and no ``position_ids`` (transformers 5): whether the position ids the model made itself
  pack several sequences into a row (``find_packed_sequence_indices``). They never do: the model numbers the
  tokens ``0 .. seq - 1``.

:func:`graph_safe_attention` switches such models to :data:`SDPA_GRAPH_SAFE`, registered through HF's public
``AttentionInterface`` / ``AttentionMaskInterface``: the same SDPA attention function, with a mask function that
never asks the host. A batch with an ``attention_mask`` always gets the boolean mask HF builds for a padded batch
(for a batch that pads nothing this is SDPA with a mask of all-causal entries instead of ``is_causal``: the same
function, other kernels). A call with neither an ``attention_mask`` nor ``position_ids`` is handed to HF's mask code
with a mask of ones (a forward pre-hook on the innermost HF model), which skips the packing question, and the mask
function turns it back into "no mask": SDPA's ``is_causal``, the kernels the unmodified model runs. Padded and
unpadded batches therefore train exactly as with ``"sdpa"``. Under ``torch.compile`` the same holds, traced or not:
HF's traced mask code would skip the read by itself, but code that dynamo runs eagerly (past its recompile limit, or
around a graph break) reads the host, so the hook does not depend on it; a compiled graph-safe model therefore runs
``is_causal`` where the unmodified compiled model masks with the packed-sequence mask HF builds when tracing. A call that passes ``position_ids`` without a mask
still asks the host whether they pack sequences, and is refused at capture with that line.

**Mixture of experts** (``hf_experts="graph_safe"``, transformers 5). The experts of an MoE layer run through HF's
``ExpertsInterface``; of its implementations, ``"eager"`` gathers each expert's tokens with ``nonzero`` (a shape
read on the host), and ``"grouped_mm"`` (the default) calls ``torch.nn.functional.grouped_mm`` on the weights'
dtype: with FP32 weights (``bf16-mixed``) that is torch's FP32 grouped GEMM, which copies the group offsets to the
host, and under ``torch.compile`` HF falls back to a loop over ``offs.tolist()``. :func:`graph_safe_experts`
switches the model to :data:`EXPERTS_GRAPH_SAFE`: HF's own grouped-GEMM experts (offsets from ``histc`` and
``cumsum`` on the device, every token routed, no capacity, no dropped tokens) run on the experts' weights cast to
the autocast dtype, as autocast runs an ``nn.Linear`` (the cast is differentiable: gradients reach the FP32
weights in FP32). Where no grouped GEMM captures (no autocast and weights that are not BF16, e.g. ``32-true``, or
no CUDA device) HF's ``"batched_mm"`` experts run instead (one small GEMM per routed token: graph-safe, more
memory). With BF16 weights on a GPU the experts compute exactly what HF's ``"grouped_mm"`` does. transformers 4.x
has no experts interface; its MoE layers keep being refused at capture, naming the line.

``CudaGraphCallback`` / ``CudaGraphStrategy`` apply both before the first step when they capture, so user code
needs no change, and put the models back after ``fit``. Other attention implementations are left as they are:
``"eager"`` builds its mask without a host read, and flash-attention's variable-length path (``flash_attention_2``
with padding) reads sequence lengths on the host and is refused at capture with that line.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from torch import nn

__all__ = [
    "EXPERTS_GRAPH_SAFE",
    "SDPA_GRAPH_SAFE",
    "graph_safe_attention",
    "graph_safe_experts",
    "has_hf_models",
    "restore_attention",
    "restore_experts",
]

#: The attention implementation :func:`graph_safe_attention` registers and switches ``"sdpa"`` models to.
SDPA_GRAPH_SAFE = "sdpa_graph_safe"
#: The experts implementation :func:`graph_safe_experts` registers and switches MoE models to.
EXPERTS_GRAPH_SAFE = "grouped_mm_graph_safe"

# One entry per forward of an innermost HF model that is running now: True where the pre-hook handed HF a mask of
# ones in place of none. HF's mask code runs inside that forward, so the innermost entry belongs to its call.
_ONES_FOR_NO_MASK: list[bool] = []
_HOOKS = "_nemo_cudagraph_mask_hooks"  # attribute of a switched model: its pre- and post-hook handles


def _sdpa_mask_no_host_read(*args: Any, attention_mask: Any = None, **kwargs: Any) -> Any:
    from transformers.masking_utils import sdpa_mask

    if _ONES_FOR_NO_MASK and _ONES_FOR_NO_MASK[-1]:
        # The mask of ones stands for "no mask": HF then skips the causal mask when it can (is_causal), reading
        # nothing on the host (``padding_mask is None`` decides it).
        attention_mask = None
    elif attention_mask is not None:
        # ``allow_is_causal_skip`` is what makes HF read the padding mask on the host.
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


def _ones_for_no_mask(model: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """Forward pre-hook of an innermost HF model: a mask of ones where the call passes neither a mask nor
    position ids (nor a cache: its offsets would size the mask)."""
    if len(args) > 1:  # the model called with positional arguments beyond the tokens: leave the call alone
        _ONES_FOR_NO_MASK.append(False)
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    tokens = ids if ids is not None else embeds
    ones = (kwargs.get("attention_mask") is None and kwargs.get("position_ids") is None
            and kwargs.get("past_key_values") is None and kwargs.get("cache") is None and tokens is not None)
    _ONES_FOR_NO_MASK.append(ones)
    if not ones:
        return None
    kwargs["attention_mask"] = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
    return args, kwargs


def _forward_done(model: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    if _ONES_FOR_NO_MASK:
        _ONES_FOR_NO_MASK.pop()


def _innermost_models(module: nn.Module) -> list[nn.Module]:
    """The HF models in ``module`` that hold no other HF model: those that build the attention masks."""
    from transformers import PreTrainedModel

    models = [m for m in module.modules() if isinstance(m, PreTrainedModel)]
    return [m for m in models if not any(isinstance(c, PreTrainedModel) for c in m.modules() if c is not m)]


def _major_version() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _packing_check_exists() -> bool:
    """transformers 5 asks the host whether model-made position ids pack sequences. 4.x asks nothing: it always
    builds the packed-sequence mask, and its users' runs use that mask, so the pre-hook would change their kernels."""
    return _major_version() >= 5


def graph_safe_attention(module: nn.Module) -> list[str]:
    """Switch every HF model in ``module`` whose attention is ``"sdpa"`` to :data:`SDPA_GRAPH_SAFE`.

    Returns the names (as ``module.named_modules()`` gives them; ``""`` for ``module`` itself) of the models
    switched. Models with another attention implementation are left alone. Call it before training (e.g. in
    ``configure_model``) when graphs are captured by other means than this package's callback or strategy, and
    for an eager reference run that should use the same kernels as the graphed one; :func:`restore_attention`
    undoes it.
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
    if switched and _packing_check_exists():
        for m in _innermost_models(module):
            if m.config._attn_implementation == SDPA_GRAPH_SAFE and not hasattr(m, _HOOKS):
                setattr(m, _HOOKS, (m.register_forward_pre_hook(_ones_for_no_mask, with_kwargs=True),
                                    m.register_forward_hook(_forward_done, with_kwargs=True, always_call=True)))
    return switched


def restore_attention(module: nn.Module, switched: list[str]) -> None:
    """Put the models that :func:`graph_safe_attention` switched (its return value) back to ``"sdpa"``."""
    models = dict(module.named_modules())
    for name in switched:
        m = models.get(name)
        if m is not None and m.config._attn_implementation == SDPA_GRAPH_SAFE:
            m.set_attn_implementation("sdpa")
    for m in module.modules():
        for handle in m.__dict__.pop(_HOOKS, ()):
            handle.remove()


# ---------------------------------------------------------------------------------------------------------------
# Mixture-of-experts layers
# ---------------------------------------------------------------------------------------------------------------

#: the experts' weight tensors a graph-safe forward casts (HF's experts layouts: gated, ungated, down)
_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


class _CastExperts:
    """An experts module as HF's experts functions read it, with its weight tensors cast to the compute dtype.

    Every other attribute (the routing layout flags, the gate, the activation, biases) is the module's own.
    """

    def __init__(self, experts: nn.Module, dtype: Optional[torch.dtype]) -> None:
        self._experts = experts
        if dtype is not None:
            for name in _EXPERT_WEIGHTS:
                w = getattr(experts, name, None)
                if isinstance(w, torch.Tensor) and w.dtype != dtype:
                    setattr(self, name, w.to(dtype))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._experts, name)


def _compute_dtype(experts: nn.Module, hidden: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run the experts' GEMMs in: the autocast dtype where autocast is on, else the
    weights' own."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    w = next(getattr(experts, n) for n in _EXPERT_WEIGHTS if isinstance(getattr(experts, n, None), torch.Tensor))
    return w.dtype


def _grouped_gemm_captures(device: torch.device, dtype: torch.dtype) -> bool:
    """On a CUDA GPU torch's grouped GEMM reads its offsets on the device only in BF16 (SM80+); other dtypes copy
    them to the host. On the CPU (no graphs; CPU tests replay the step) its kernel reads them where they lie."""
    has_op = hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
    if device.type == "cpu":
        return has_op
    # asked as HF asks it, in a form torch.compile traces without a graph break (no cache wrapper)
    return (has_op and device.type == "cuda" and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device) >= (8, 0))


def graph_safe_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    """The :data:`EXPERTS_GRAPH_SAFE` implementation: HF's grouped-GEMM experts on weights in the compute dtype,
    or HF's batched-GEMM experts where no grouped GEMM captures (module docstring)."""
    from transformers.integrations import moe

    dtype = _compute_dtype(experts, hidden_states)
    forward = (moe.grouped_mm_experts_forward if _grouped_gemm_captures(hidden_states.device, dtype)
               else moe.batched_mm_experts_forward)
    return forward(_CastExperts(experts, dtype), hidden_states, top_k_index, top_k_weights)


def _experts_interface() -> Any:
    """HF's ``ExpertsInterface`` class (transformers 5), or ``None`` (4.x has none)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return None
    return ExpertsInterface


def graph_safe_experts(module: nn.Module) -> list[tuple[str, str]]:
    """Switch every HF mixture-of-experts model in ``module`` to :data:`EXPERTS_GRAPH_SAFE` (module docstring).

    Returns ``(name, previous implementation)`` of each model switched (``name`` as ``module.named_modules()``
    gives it), for :func:`restore_experts`. Models whose experts run through a kernel library (``"deepgemm"``,
    ``"sonicmoe"``, ...) and models without an experts interface (dense models, transformers 4.x) are left alone.
    Call it before training when graphs are captured by other means than this package's callback or strategy, and
    for an eager reference run that should use the same kernels as the graphed one.
    """
    interface = _experts_interface()
    if interface is None or not has_hf_models(module):
        return []
    from transformers import PreTrainedModel

    interface.register(EXPERTS_GRAPH_SAFE, graph_safe_experts_forward)
    switched = []
    for name, m in module.named_modules():
        if not isinstance(m, PreTrainedModel) or not type(m)._can_set_experts_implementation():
            continue
        current = m.config._experts_implementation
        # an outer model switches the ones inside it, which then read as switched
        if current in ("eager", "grouped_mm", "batched_mm"):
            m.set_experts_implementation(EXPERTS_GRAPH_SAFE)
            switched.append((name, current))
    return switched


def restore_experts(module: nn.Module, switched: list[tuple[str, str]]) -> None:
    """Put the models that :func:`graph_safe_experts` switched (its return value) back to their implementation."""
    models = dict(module.named_modules())
    for name, previous in switched:
        m = models.get(name)
        if m is not None and m.config._experts_implementation == EXPERTS_GRAPH_SAFE:
            m.set_experts_implementation(previous)
