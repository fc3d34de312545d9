"""NeMo 2 recipe flag: turn CUDA graphs on in a ``nemo_run`` recipe, consistently.

Four ways in, one implementation (:func:`with_cuda_graph`)::

    from nemo.collections import llm
    from nemo_cudagraph_plugin.nemo import CudaGraphPlugin, with_cuda_graph, with_cuda_graph_arg

    recipe = with_cuda_graph(llm.llama3_8b.pretrain_recipe(name="x", num_gpus_per_node=8))   # 1. a function
    run.run(recipe, executor=executor, plugins=[CudaGraphPlugin()])                          # 2. a nemo_run.Plugin
    pretrain = with_cuda_graph_arg(llm.llama3_8b.pretrain_recipe)                            # 3. a factory argument
    recipe = pretrain(name="x", cuda_graph=True)
    # 4. the command line: python -m nemo_cudagraph_plugin.nemo llama3_8b --cuda-graph --check

What the flag does depends on who drives the training step:

* **NeMo ``MegatronStrategy``** (every ``nemo.collections.llm`` recipe). The step is Megatron's pipeline
  schedule (a ``dataloader_iter`` training step), not Lightning's optimizer closure, so this plugin's
  whole-step capture does **not** apply and is never added. What the flag does there:

  - makes Megatron-core's *own* CUDA graphs (per transformer layer, captured and replayed by megatron-core)
    consistent for the installed megatron-core: ``model.config.cuda_graph_impl="local"`` where the config
    has that field (then ``enable_cuda_graph`` and ``external_cuda_graph`` stay ``False``: megatron-core
    >= 0.16 refuses both together, and NeMo's ``MegatronStrategy.connect()`` re-runs that check), else
    ``enable_cuda_graph=True``; and ``trainer.strategy.use_te_rng_tracker=True`` (the graph-safe RNG tracker;
    the strategy's value overwrites the model config's in ``connect()``, so it is set on the strategy);
  - ``scope=["full_iteration"]``: one CUDA graph per training step. With megatron-core >= 0.16 it sets
    ``cuda_graph_impl="local"``, ``cuda_graph_scope=["full_iteration"]`` and appends
    :class:`~nemo_cudagraph_plugin.lightning.pipeline_callback.MegatronFullIterationGraph`, which wraps each
    training step in megatron-core's ``FullCudaGraphWrapper`` through NeMo's ``on_megatron_step_start`` event.
    NeMo 2.7's ``MegatronStep`` does that itself only when ``enable_cuda_graph`` is true and the scope *equals the
    string* ``"full_iteration"`` (``nemo/lightning/megatron_parallel.py:1436-1441``), which megatron-core >= 0.16
    makes impossible (the scope becomes a list of enums, ``enable_cuda_graph`` is refused with
    ``cuda_graph_impl``). Older megatron-core: ``enable_cuda_graph=True`` and the string scope (NeMo's own path);
  - NaN checks: Megatron DDP's ``check_for_nan_in_grad``/``check_for_large_grads`` read the gradient norm on the
    host in the gradient-sync hooks. With per-layer graphs those hooks run *outside* the graphs (megatron-core
    captures each layer's backward with ``torch.autograd.grad(inputs=...)``, which fires no
    gradient-accumulation hook), so they are kept. With the whole-iteration graph they would run inside it; there
    they are turned off;
  - MoE: on a dropless MoE config the default whole-layer scope would capture the host-syncing token dispatcher
    (megatron-core only checks that when ``moe`` is listed explicitly): the scope is restricted with the reason
    logged, and ``full_iteration`` is refused (:func:`apply_megatron_graph_fields`);
  - where megatron-core's forward capture returns buffers TransformerEngine saved for the backward to its reuse pool
    (megatron-core 0.16.1, found in its code with file:line), its per-layer graphs were measured not to reproduce
    eager training while the whole-iteration graph was bitwise equal to eager: there the flag's default is
    ``scope=["full_iteration"]`` (logged with the reason) and a per-layer ``scope`` is refused (``ValueError``);
  - TE's fused wgrad accumulation (``gradient_accumulation_fusion``) is turned off where the installed
    megatron-core's graph replay does not restore ``grad_added_to_main_grad`` (Megatron-LM #1279; 0.16.1 does);
  - FP8 primary weights (``fp8_param_gather``/``fp8_params``/``fp8_param``): megatron-core >= 0.16 rebuilds the
    transposes itself when each parameter all-gather completes. The flag appends
    :class:`~nemo_cudagraph_plugin.lightning.pipeline_callback.Fp8ParamGatherRefresh` (pipeline size 1), which
    refreshes only where megatron-core does not (the forced sync of NeMo's checkpoint save, older megatron-core),
    or :class:`~nemo_cudagraph_plugin.lightning.pipeline_callback.AlignPipelineTransposes` (pipeline size > 1,
    or ``fp8_refresh=True``), which does the same for Megatron chunks. Neither forces an all-gather;
  - does not apply: our capture engine, its parity checks (``verify_steps``) and its device-side NaN guard
    (they belong to the captured step); passing their options raises ``ValueError``.

* **Any other Lightning strategy** (single device, ``"ddp"``, ``DDPStrategy``): appends
  ``Config(CudaGraphCallback, **options)`` to ``trainer.callbacks`` (``mode="callback"``, the default) or
  swaps ``trainer.strategy`` for ``Config(CudaGraphStrategy, inner=<the old strategy>, **options)``
  (``mode="strategy"``). ``trainer.detect_anomaly=True`` (a host check after every backward op, which
  cannot run inside a graph) is turned off.

Every change is logged (logger ``nemo_cudagraph_plugin.nemo``, INFO) as ``path: old -> new (why)``.
Calling it again is harmless (nothing changes; new options update our callback). ``enabled=False`` undoes
it: it restores exactly the values it changed while the recipe object carries its record (in-place edits
and ``copy.deepcopy``/pickle keep it). After a serialization round trip (YAML, nemo_run's JSON) the record
is gone; then ``enabled=False`` turns CUDA graphs off (our callback/strategy removed, Megatron's graph
fields off) and leaves ``use_te_rng_tracker`` and NaN-check settings as they are, saying so in the log.

This module imports neither NeMo nor ``nemo_run`` at import time; it edits any ``fiddle`` tree
(``nemo_run.Config``/``Partial`` are ``fiddle`` classes) and recognises NeMo classes by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Optional, Union

from .core.config import option_names

__all__ = [
    "CAPTURE_OPTIONS",
    "Change",
    "CudaGraphPlugin",  # noqa: F822  (made on first access by the module __getattr__ below)
    "MegatronGraphSetup",
    "add_cuda_graph_argument",
    "apply_megatron_graph_fields",
    "check_on_cpu",
    "main",
    "plan_megatron_graph_fields",
    "with_cuda_graph",
    "with_cuda_graph_arg",
]

log = logging.getLogger(__name__)

Mode = Literal["auto", "callback", "strategy"]
Fp8Refresh = Union[bool, Literal["auto"]]

#: Options of CudaGraphCallback / CudaGraphStrategy (our whole-step capture engine).
# The capture options the flag passes through (CaptureConfig is their one definition); `enabled` is the flag's own
# argument and pipeline alignment is the flag's decision (fp8_refresh / AlignPipelineTransposes).
CAPTURE_OPTIONS = tuple(n for n in option_names() if n not in ("enabled", "align_pp_transposes"))
MEGATRON_IMPLS = ("local", "transformer_engine")
_RECORD = "__nemo_cudagraph_record__"  # attribute on the recipe root: values before the flag, for undo
_UNSET = "<unset>"  # the record's marker for "the argument was not set explicitly"


@dataclasses.dataclass(frozen=True)
class Change:
    """One field the flag sets: ``path`` (e.g. ``"model.config.cuda_graph_impl"``), old and new value, why."""

    path: str
    old: Any
    new: Any
    why: str

    def __str__(self) -> str:
        return f"{self.path}: {self.old!r} -> {self.new!r} ({self.why})"


# ------------------------------------------------------------------------------------------------------------
# Pure planning (no fiddle, no NeMo): which Megatron fields to set for a given config shape
# ------------------------------------------------------------------------------------------------------------


def plan_megatron_graph_fields(
    current: Mapping[str, Any],
    *,
    impl: str = "local",
    scope: Optional[Sequence[str]] = None,
    warmup_steps: Optional[int] = None,
) -> tuple[dict[str, Any], bool]:
    """Megatron-core CUDA-graph fields to set on a model config, for the config's own field set.

    Args:
        current: the config's CUDA-graph related fields that *exist* in the installed megatron-core,
            mapped to their current values (fields absent from the mapping are taken not to exist).
        impl: ``"local"`` (megatron-core's own per-layer graphs) or ``"transformer_engine"``.
        scope: ``cuda_graph_scope`` names (e.g. ``["attn"]``); ``None`` keeps the config's scope.
        warmup_steps: ``cuda_graph_warmup_steps``; ``None`` keeps the config's value.

    Returns:
        ``(updates, full_iteration)``: the fields to set (only those whose value changes) and whether the
        resulting scope is a full-iteration graph. A full-iteration scope captures nothing by itself: the
        caller must also wrap the step (``MegatronFullIterationGraph`` under NeMo, or
        :func:`nemo_cudagraph_plugin.megatron.full_iteration_forward_backward` in a Megatron loop) and turn
        Megatron DDP's host-side NaN checks off.

    Raises:
        ValueError: a combination the installed megatron-core or NeMo cannot run, with what to change.
    """
    if impl not in MEGATRON_IMPLS:
        raise ValueError(f"impl={impl!r} is not a Megatron CUDA graph implementation; use one of {MEGATRON_IMPLS}.")
    new_scope = None if scope is None else _scope_names(scope)
    effective_scope = new_scope if new_scope is not None else _scope_names(current.get("cuda_graph_scope"))
    full_iteration = "full_iteration" in effective_scope
    updates: dict[str, Any] = {}
    if full_iteration and effective_scope != ["full_iteration"]:
        raise ValueError(
            f"cuda_graph_scope={effective_scope}: 'full_iteration' captures the whole step and cannot be combined "
            "with per-layer scopes; use scope=['full_iteration'] alone, or per-layer scopes without it."
        )
    if "cuda_graph_impl" in current:
        if full_iteration and impl != "local":
            raise ValueError(
                "cuda_graph_scope='full_iteration' needs impl='local' (megatron-core refuses it with "
                "cuda_graph_impl='transformer_engine')."
            )
        updates["cuda_graph_impl"] = impl
        # megatron-core >= 0.16 asserts "Do not use enable_cuda_graph or external_cuda_graph with
        # cuda_graph_impl" in __post_init__, which MegatronStrategy.connect() runs a second time.
        for deprecated in ("enable_cuda_graph", "external_cuda_graph"):
            if deprecated in current:
                updates[deprecated] = False
    elif "enable_cuda_graph" in current:
        if impl != "local":
            raise ValueError(
                f"impl={impl!r} needs a megatron-core with cuda_graph_impl; this one only has enable_cuda_graph "
                "(megatron-core's local per-layer graphs). Use impl='local' or upgrade megatron-core."
            )
        updates["enable_cuda_graph"] = True
        if current.get("external_cuda_graph"):
            updates["external_cuda_graph"] = False
    else:
        raise ValueError(
            "the model config has neither cuda_graph_impl nor enable_cuda_graph: it is not a megatron-core "
            "TransformerConfig with CUDA graph support (megatron-core too old, or not a Megatron model)."
        )
    if new_scope is not None:
        if "cuda_graph_scope" not in current:
            raise ValueError("scope= was given but this megatron-core's config has no cuda_graph_scope field.")
        # Strings (not megatron's enum) so the recipe stays YAML/JSON serializable; __post_init__ converts. A
        # non-empty scope is one comma-separated string (megatron-core splits it): nemo_run 0.11's YAML loader
        # turns a list inside a config into the list's repr, which megatron-core then rejects.
        if "cuda_graph_impl" in current:
            updates["cuda_graph_scope"] = ",".join(new_scope) if new_scope else []  # [] is megatron's "whole layer"
        elif full_iteration:
            # NeMo 2.7's MegatronStep engages FullCudaGraphWrapper only for the *string* "full_iteration"
            # (nemo/lightning/megatron_parallel.py:1438), which such a megatron-core keeps as a string.
            updates["cuda_graph_scope"] = "full_iteration"
        else:
            updates["cuda_graph_scope"] = list(new_scope) if new_scope else "full"
    if warmup_steps is not None:
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps={warmup_steps!r}: use an int >= 1.")
        if "cuda_graph_warmup_steps" not in current:
            raise ValueError("warmup_steps= was given but this megatron-core's config has no cuda_graph_warmup_steps.")
        updates["cuda_graph_warmup_steps"] = warmup_steps
    changed = {k: v for k, v in updates.items() if not _field_equal(k, current.get(k, _UNSET), v)}
    return changed, full_iteration


def _scope_names(scope: Any) -> list[str]:
    """Normalise a cuda_graph_scope value (str, enum, list of either, None) to a list of names."""
    if scope is None:
        return []
    items = scope.split(",") if isinstance(scope, str) else ([scope] if not isinstance(scope, (list, tuple)) else scope)
    names = [getattr(s, "name", s) for s in items]
    names = [str(n).strip() for n in names if str(n).strip()]
    return [] if names == ["full"] else names  # "full" is megatron's old spelling of "whole layer"


def _is_unset(value: Any) -> bool:
    # Compared by value: the record may have been pickled or deep-copied.
    return isinstance(value, str) and value == _UNSET


def _same(a: Any, b: Any) -> bool:
    if _is_unset(a) or _is_unset(b):
        return _is_unset(a) and _is_unset(b)
    return type(a) is type(b) and a == b


def _field_equal(name: str, a: Any, b: Any) -> bool:
    if name == "cuda_graph_scope" and not _is_unset(a):
        # "full", [] and None all mean "the whole layer"; enums and strings compare by name.
        return _scope_names(a) == _scope_names(b)
    return _same(a, b)


# ------------------------------------------------------------------------------------------------------------
# One code path for recipes and plain configs: the fields on a TransformerConfig(-like) object
# ------------------------------------------------------------------------------------------------------------

_MEGATRON_GRAPH_FIELDS = ("cuda_graph_impl", "enable_cuda_graph", "external_cuda_graph", "cuda_graph_scope",
                          "cuda_graph_warmup_steps")
_DETECT = "detect"


@dataclasses.dataclass
class MegatronGraphSetup:
    """What :func:`apply_megatron_graph_fields` did to one model config.

    Attributes:
        changes: the fields set, with old/new values and why (also logged).
        full_iteration: the scope is the whole-iteration graph (the caller must wrap the step and turn host-side
            NaN checks off; see :func:`plan_megatron_graph_fields`).
        scope: the resulting ``cuda_graph_scope`` names (``[]`` = the whole layer).
        notes: warnings said to the user (MoE scope restrictions, fused wgrad accumulation turned off, ...).
    """

    changes: list[Change]
    full_iteration: bool
    scope: list[str]
    notes: list[str]


def _config_fields(config: Any) -> set[str]:
    if _is_buildable(config):
        return _params(config)
    if dataclasses.is_dataclass(config):
        return {f.name for f in dataclasses.fields(config)}
    return set(getattr(config, "__dict__", {}))


def _dropless_moe(config: Any, fields: set[str]) -> Optional[str]:
    """Why an MoE config's token dispatcher cannot be captured (it is dropless); ``None`` for a dense or a
    drop-and-pad MoE config."""
    experts = _get(config, "num_moe_experts") if "num_moe_experts" in fields else None
    if not isinstance(experts, int) or experts <= 1:
        return None
    capacity = _get(config, "moe_expert_capacity_factor")
    padded = bool(_get(config, "moe_pad_expert_input_to_capacity"))
    if capacity is not None and padded:
        return None
    return (
        f"this MoE config is dropless (moe_expert_capacity_factor={capacity!r}, moe_pad_expert_input_to_capacity="
        f"{padded}): its {_get(config, 'moe_token_dispatcher_type')!r} token dispatcher reads per-expert token counts "
        "on the host, which cannot run inside a CUDA graph capture"
    )


def _moe_scope(config: Any, fields: set[str], impl: str, requested: list[str],
               explicit: bool) -> tuple[Optional[list[str]], list[str]]:
    """For an MoE config: the scope to use instead of ``requested`` (``None``: keep it) and notes.

    megatron-core checks a graphed MoE dispatcher only when ``moe`` is listed explicitly
    (transformer_config.py: 'moe cuda graph is only supported with drop-padding MoE'); the default whole-layer
    scope also captures a dropless token dispatcher, which reads token counts on the host: the capture fails.
    """
    experts = _get(config, "num_moe_experts") if "num_moe_experts" in fields else None
    if not isinstance(experts, int) or experts <= 1:
        return None, []
    capacity = _get(config, "moe_expert_capacity_factor")
    dispatcher = _get(config, "moe_token_dispatcher_type")
    fp8_padding = bool(_get(config, "moe_router_padding_for_fp8"))
    why_dropless = _dropless_moe(config, fields)
    dropless = why_dropless is not None
    if "full_iteration" in requested:
        if dropless:
            raise ValueError(
                f"cuda_graph_scope='full_iteration' on an MoE model: {why_dropless}, and the whole-iteration graph "
                "captures it. Use drop-and-pad MoE (moe_expert_capacity_factor=<float> and "
                "moe_pad_expert_input_to_capacity=True), or the per-layer graphs (scope=None: the flag then graphs "
                "the MoE router and leaves the experts eager)."
            )
        return None, []
    if explicit or not dropless:
        if explicit and impl == "local" and requested == ["attn"]:
            return None, ["MoE config with impl='local' and scope=['attn']: megatron-core's MoE layers build no "
                          "graph manager for 'attn' (MoETransformerLayer.create_mcore_cudagraph_manager), so only "
                          "dense layers are graphed."]
        return None, []
    # The default (whole layer) on a dropless MoE config: restrict to what megatron-core can capture.
    router_ok = impl == "transformer_engine" or not (
        dispatcher == "alltoall" and (capacity is not None or fp8_padding)
    )
    if router_ok:
        scope = ["attn", "moe_router"]
        note = (f"scope restricted to {scope} (was the whole layer): {why_dropless}. Graphed: attention (dense "
                "layers whole) and the MoE router/post-process (impl='local' adds moe_preprocess); the experts "
                "and the dispatcher run eagerly.")
    else:
        scope = ["attn"]
        note = (f"scope restricted to {scope} (was the whole layer): {why_dropless}, and with the alltoall "
                "dispatcher and a capacity factor or FP8 router padding megatron-core refuses the moe_router "
                "graph under impl='local' (it implies moe_preprocess, which syncs with the host). MoE layers run "
                "eagerly; pad to capacity to graph them.")
    return scope, [note]


def _per_layer_local(impl: str, scope: Optional[Sequence[str]], current_scope: Any) -> bool:
    """Would megatron-core's own per-layer graphs (``impl="local"``, not the whole iteration) be configured?"""
    names = _scope_names(scope) if scope is not None else _scope_names(current_scope)
    return impl == "local" and "full_iteration" not in names


def _default_scope(impl: str, scope: Optional[Sequence[str]], current_scope: Any, capabilities: Any,
                   path: str) -> tuple[Optional[Sequence[str]], Optional[str]]:
    """The scope to configure and, when per-layer graphs are refused on this megatron-core, why.

    No scope given (the flag's default): ``["full_iteration"]`` where per-layer graphs are refused. A per-layer
    scope the user gave there: ``ValueError`` with the reason and what to use instead.
    """
    if not _per_layer_local(impl, scope, current_scope):
        return scope, None
    from nemo_cudagraph_plugin.megatron import per_layer_refusal

    refused = per_layer_refusal(capabilities)
    if refused is None:
        return scope, None
    if scope is not None:
        raise ValueError(
            f"{path}.cuda_graph_scope={_scope_names(scope)!r} with cuda_graph_impl='local' (per-layer graphs): "
            f"{refused}. Use scope=['full_iteration'] (one graph per training step) or leave scope unset (the flag "
            "then chooses it); to accept the difference, set those model config fields yourself instead of using "
            "the flag."
        )
    return ["full_iteration"], refused


def apply_megatron_graph_fields(
    config: Any,
    *,
    impl: str = "local",
    scope: Optional[Sequence[str]] = None,
    warmup_steps: Optional[int] = None,
    rng_tracker: bool = True,
    capabilities: Any = _DETECT,
    set_field: Optional[Callable[[str, Any, str], None]] = None,
    path: str = "config",
) -> MegatronGraphSetup:
    """Set Megatron-core's CUDA-graph fields on one model config: the code path shared by :func:`with_cuda_graph`
    (a recipe's ``model.config``) and Megatron-core loops (a ``TransformerConfig`` instance).

    What it sets, only where the installed megatron-core's config has the field:

    * the graph fields of :func:`plan_megatron_graph_fields` (``cuda_graph_impl`` / ``enable_cuda_graph``,
      ``cuda_graph_scope``, ``cuda_graph_warmup_steps``);
    * MoE: on a dropless MoE config the default whole-layer scope is restricted (``["attn", "moe_router"]``, or
      ``["attn"]`` where megatron-core refuses the router graph), because it would capture the host-syncing token
      dispatcher; ``"full_iteration"`` on a dropless MoE config is refused. The reason is logged (WARNING);
    * ``gradient_accumulation_fusion=False`` when TransformerEngine's fused wgrad accumulation is not safe under
      the chosen graphs (:func:`nemo_cudagraph_plugin.megatron.fused_wgrad_graph_safety`, Megatron-LM #1279);
    * ``use_te_rng_tracker=True`` (``rng_tracker=True``; NeMo recipes set it on the strategy instead).

    Per-layer graphs (``impl="local"`` without ``"full_iteration"``) on a megatron-core whose forward capture hands
    buffers TransformerEngine saved for the backward back to its reuse pool (megatron-core 0.16.1,
    :func:`nemo_cudagraph_plugin.megatron.per_layer_refusal`) were measured not to reproduce eager training: with
    ``scope=None`` the whole-iteration graph is configured instead (logged, WARNING); a per-layer ``scope`` raises
    ``ValueError``. With ``capabilities=None`` (megatron-core unreadable) per-layer graphs stay, with a warning.

    A plain ``TransformerConfig`` has converted its scope in ``__post_init__`` already: call
    ``config.__post_init__()`` after this, as NeMo's ``MegatronStrategy.connect()`` does.

    Args:
        config: a megatron-core ``TransformerConfig`` (or a fiddle ``Config`` of one, or any object with the
            fields as attributes).
        impl, scope, warmup_steps: see :func:`with_cuda_graph`.
        rng_tracker: also set ``use_te_rng_tracker=True`` on this config.
        capabilities: a :class:`~nemo_cudagraph_plugin.megatron.MegatronCapabilities`, ``None`` (unknown), or
            ``"detect"`` (read the installed megatron-core, only when fused wgrad accumulation is on).
        set_field: ``set_field(name, value, why)`` instead of ``setattr`` (the flag records undo values).
        path: how the config is named in the log (``"model.config"`` for recipes).

    Raises:
        ValueError: a combination megatron-core or NeMo cannot run; the message says what to change.
    """
    fields = _config_fields(config)
    current = {name: _get(config, name) for name in _MEGATRON_GRAPH_FIELDS if name in fields}
    gaf = "gradient_accumulation_fusion" in fields and _get(config, "gradient_accumulation_fusion") is True
    if capabilities == _DETECT and (gaf or _per_layer_local(impl, scope, current.get("cuda_graph_scope"))):
        from nemo_cudagraph_plugin.megatron import megatron_capabilities

        capabilities = megatron_capabilities()
    known = None if capabilities == _DETECT else capabilities
    explicit = scope is not None
    scope, refused = _default_scope(impl, scope, current.get("cuda_graph_scope"), known, path)
    requested = _scope_names(scope) if scope is not None else _scope_names(current.get("cuda_graph_scope"))
    dropless = _dropless_moe(config, fields) if refused is not None else None
    if dropless is not None:
        raise ValueError(
            f"{path}: this MoE model can use neither of megatron-core's CUDA graphs here. Per-layer graphs: "
            f"{refused}. The whole-iteration graph: {dropless}, and it would capture that "
            "dispatcher. Use drop-and-pad MoE (moe_expert_capacity_factor=<float> and "
            "moe_pad_expert_input_to_capacity=True) for the whole-iteration graph, or set the per-layer fields "
            "yourself to accept the difference."
        )
    moe_scope, notes = _moe_scope(config, fields, impl, requested, explicit=explicit)
    if refused is not None:
        notes.insert(0, f"{path}.cuda_graph_scope set to 'full_iteration' (one graph per training step) instead of "
                        f"per-layer graphs: {refused}.")
    if moe_scope is not None:
        scope = moe_scope
    updates, full_iteration = plan_megatron_graph_fields(current, impl=impl, scope=scope, warmup_steps=warmup_steps)
    whys = {
        "cuda_graph_impl": f"megatron-core's {impl} CUDA graphs"
        + (" (whole iteration)" if full_iteration else " (per layer)"),
        "enable_cuda_graph": "megatron-core refuses it together with cuda_graph_impl"
        if "cuda_graph_impl" in current else "megatron-core's CUDA graphs (this megatron-core has no cuda_graph_impl)",
        "external_cuda_graph": "megatron-core refuses it together with cuda_graph_impl/enable_cuda_graph",
        "cuda_graph_scope": "MoE: a dropless token dispatcher cannot be captured (logged above)"
        if moe_scope is not None else "per-layer graphs do not reproduce eager training here (logged above)"
        if refused is not None else "requested scope",
        "cuda_graph_warmup_steps": "requested warm-up steps",
    }
    if gaf:
        from nemo_cudagraph_plugin.megatron import fused_wgrad_graph_safety

        safe, reason = fused_wgrad_graph_safety(impl=impl, full_iteration=full_iteration, capabilities=known)
        if not safe:
            updates["gradient_accumulation_fusion"] = False
            whys["gradient_accumulation_fusion"] = f"fused wgrad accumulation is not graph-safe here: {reason}"
            notes.append(f"{path}.gradient_accumulation_fusion turned off: {reason}.")
    if not full_iteration and impl == "local":
        from nemo_cudagraph_plugin.megatron import per_layer_parity_note

        note = per_layer_parity_note(known)
        if note is not None:
            notes.append(note)
    if rng_tracker and "use_te_rng_tracker" in fields and _get(config, "use_te_rng_tracker") is not True:
        updates["use_te_rng_tracker"] = True
        whys["use_te_rng_tracker"] = "CUDA graphs need TE's graph-safe RNG tracker"
    for note in notes:
        log.warning("with_cuda_graph: %s", note)
    changes: list[Change] = []
    order = ("enable_cuda_graph", "external_cuda_graph", "cuda_graph_impl", "cuda_graph_scope",
             "cuda_graph_warmup_steps", "gradient_accumulation_fusion", "use_te_rng_tracker")
    for name in order:
        if name not in updates:
            continue
        if set_field is not None:
            set_field(name, updates[name], whys[name])
        else:
            old = _get(config, name, _UNSET)
            setattr(config, name, updates[name])
            change = Change(f"{path}.{name}", old, updates[name], whys[name])
            changes.append(change)
            log.info("with_cuda_graph: %s", change)
    final_scope = _scope_names(updates.get("cuda_graph_scope", current.get("cuda_graph_scope")))
    return MegatronGraphSetup(changes=changes, full_iteration=full_iteration, scope=final_scope, notes=notes)


# ------------------------------------------------------------------------------------------------------------
# fiddle tree helpers (duck-typed: nemo_run.Config/Partial and fiddle.Config/Partial)
# ------------------------------------------------------------------------------------------------------------


def _is_buildable(obj: Any) -> bool:
    state = getattr(obj, "__dict__", None)
    return isinstance(state, dict) and "__fn_or_cls__" in state and "__arguments__" in state


def _target(obj: Any) -> Any:
    return obj.__dict__["__fn_or_cls__"] if _is_buildable(obj) else None


def _mro_names(obj: Any) -> tuple[str, ...]:
    target = _target(obj)
    if target is None:
        target = type(obj)
    return tuple(c.__name__ for c in getattr(target, "__mro__", ()))


def _is_megatron_strategy(strategy: Any) -> bool:
    return "MegatronStrategy" in _mro_names(strategy)


def _is_ours(obj: Any, name: str) -> bool:
    target = _target(obj)
    return target is not None and getattr(target, "__name__", "") == name and getattr(
        target, "__module__", ""
    ).startswith("nemo_cudagraph_plugin.")


def _params(obj: Any) -> set[str]:
    try:
        return set(inspect.signature(_target(obj)).parameters)
    except (TypeError, ValueError):
        return set()


def _get(obj: Any, name: str, default: Any = None) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        return default


def _explicit(obj: Any, name: str) -> Any:
    """The explicitly set value, or ``_UNSET`` (fiddle falls back to the signature default)."""
    return obj.__dict__["__arguments__"].get(name, _UNSET)


class _Editor:
    """Applies and logs changes to a recipe, keeping the before-values in the recipe's record."""

    def __init__(self, root: Any) -> None:
        self.root = root
        record = root.__dict__.get(_RECORD)
        self.record: dict[str, Any] = record if isinstance(record, dict) else {}
        # No record (never flagged, or copied/deserialized since): undo can only turn graphs off.
        self.fallback = not self.record
        self.changes: list[Change] = []

    def set(self, obj: Any, path: str, name: str, value: Any, why: str) -> None:
        old = _get(obj, name, _UNSET)
        if _same(old, value):
            return
        self.record.setdefault(f"{path}.{name}", _explicit(obj, name))
        setattr(obj, name, value)
        self._log(Change(f"{path}.{name}", old, value, why))

    def restore(self, obj: Any, path: str, name: str, off: Any = _UNSET, why: str = "restored") -> None:
        """Put back the recorded value of ``path.name``; when the recipe has no record at all, set ``off``
        (if given). A field the record does not name was not changed by the flag and is left alone."""
        key = f"{path}.{name}"
        old = _get(obj, name, _UNSET)
        if key in self.record:
            value = self.record.pop(key)
            if _is_unset(value):
                if name in obj.__dict__["__arguments__"]:
                    delattr(obj, name)
                new = _get(obj, name, _UNSET)
            else:
                setattr(obj, name, value)
                new = value
        elif self.fallback and not _is_unset(off):
            if _same(old, off):
                return
            setattr(obj, name, off)
            new = off
            why = f"{why}; no record of the value before with_cuda_graph, so set to off"
        else:
            return
        if not _same(old, new):
            self._log(Change(key, old, new, why))

    def _log(self, change: Change) -> None:
        self.changes.append(change)
        log.info("with_cuda_graph: %s", change)

    def save(self) -> None:
        if self.record:
            object.__setattr__(self.root, _RECORD, self.record)
        elif _RECORD in self.root.__dict__:
            object.__delattr__(self.root, _RECORD)


# ------------------------------------------------------------------------------------------------------------
# The flag
# ------------------------------------------------------------------------------------------------------------


def with_cuda_graph(
    recipe: Any,
    *,
    enabled: bool = True,
    mode: Mode = "auto",
    impl: str = "local",
    scope: Optional[Sequence[str]] = None,
    fp8_refresh: Fp8Refresh = "auto",
    **options: Any,
) -> Any:
    """Turn CUDA graphs on (or, with ``enabled=False``, back off) in a NeMo 2 / nemo_run recipe, in place.

    Args:
        recipe: a ``nemo_run.Partial``/``Config`` (or any ``fiddle`` buildable) with a ``trainer`` argument
            that is a ``Config(Trainer, ...)``; for ``MegatronStrategy`` recipes also ``model.config``.
        enabled: ``False`` undoes a previous call (see the module docstring for what is restored).
        mode: ``"callback"`` (append ``CudaGraphCallback``), ``"strategy"`` (wrap the strategy in
            ``CudaGraphStrategy``), ``"auto"`` (callback, or update our strategy if it is already there).
            Under ``MegatronStrategy`` only ``"auto"`` is accepted: Megatron's own graphs are configured.
        impl, scope: Megatron-core's ``cuda_graph_impl`` and ``cuda_graph_scope`` (``MegatronStrategy`` only);
            ``scope=["full_iteration"]`` captures the whole training step (see the module docstring).
        fp8_refresh: for Lightning recipes the callback's option; under ``MegatronStrategy``: ``"auto"`` appends
            ``AlignPipelineTransposes`` when the recipe keeps FP8 primary weights and its pipeline size is > 1,
            ``Fp8ParamGatherRefresh`` when it is 1; ``True`` always ``AlignPipelineTransposes``; ``False`` neither.
        **options: options of ``CudaGraphCallback``/``CudaGraphStrategy`` (``warmup_steps``, ``nan_guard``,
            ...). Under ``MegatronStrategy`` only ``warmup_steps`` applies (as ``cuda_graph_warmup_steps``).

    Returns:
        ``recipe`` itself (edited in place), for chaining.

    Raises:
        ValueError: the recipe or the options cannot be made consistent; the message says what to change.
    """
    if mode not in ("auto", "callback", "strategy"):
        raise ValueError(f"mode={mode!r}: use 'auto', 'callback' or 'strategy'.")
    unknown = sorted(set(options) - set(CAPTURE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; CudaGraphCallback takes {list(CAPTURE_OPTIONS)}.")
    if "enabled" in options:
        raise ValueError("pass enabled= to with_cuda_graph itself.")
    trainer = _trainer_of(recipe)
    editor = _Editor(recipe)
    if _is_megatron_strategy(_get(trainer, "strategy")):
        if enabled:
            _megatron_on(recipe, trainer, editor, mode, impl, scope, fp8_refresh, options)
        else:
            _megatron_off(recipe, trainer, editor)
    else:
        if enabled:
            _lightning_on(recipe, trainer, editor, mode, fp8_refresh, options)
        else:
            _lightning_off(recipe, trainer, editor)
    editor.save()
    if not editor.changes:
        log.info("with_cuda_graph(enabled=%s): nothing to change", enabled)
    return recipe


def _trainer_of(recipe: Any) -> Any:
    if not _is_buildable(recipe):
        raise ValueError(
            f"with_cuda_graph needs a nemo_run.Partial/Config recipe (a fiddle buildable), got {type(recipe).__name__}."
        )
    trainer = _get(recipe, "trainer")
    if trainer is None or not _is_buildable(trainer) or "Trainer" not in _mro_names(trainer):
        raise ValueError(
            "with_cuda_graph needs recipe.trainer to be a Config(Trainer, ...) (a Lightning/NeMo Trainer config); "
            f"got {trainer!r}."
        )
    return trainer


def _callback_list(trainer: Any) -> list[Any]:
    callbacks = _get(trainer, "callbacks")
    if callbacks is None:
        return []
    if not isinstance(callbacks, list):
        raise ValueError(f"recipe.trainer.callbacks must be a list of callback configs, got {type(callbacks).__name__}.")
    return callbacks


def _set_callbacks(trainer: Any, editor: _Editor, add: Optional[Any], remove: Callable[[Any], bool], why: str) -> None:
    """Append ``add`` (if given) / drop the entries matching ``remove``; record the list's original state."""
    before = _callback_list(trainer)
    after = [c for c in before if not remove(c)]
    if add is None and len(after) == len(before):
        return
    if add is not None:
        after.append(add)
    editor.record.setdefault("trainer.callbacks", _explicit(trainer, "callbacks") if before == [] else "<list>")
    trainer.callbacks = after
    editor._log(Change("trainer.callbacks", [_name(c) for c in before], [_name(c) for c in after], why))


def _restore_empty_callbacks(trainer: Any, editor: _Editor) -> None:
    original = editor.record.pop("trainer.callbacks", "<list>")
    if _callback_list(trainer) == [] and not (isinstance(original, str) and original == "<list>"):
        if _is_unset(original):
            if "callbacks" in trainer.__dict__["__arguments__"]:
                delattr(trainer, "callbacks")
        else:
            trainer.callbacks = original


def _name(obj: Any) -> str:
    target = _target(obj)
    return getattr(target, "__name__", type(obj).__name__) if target is not None else type(obj).__name__


def _config_like(template: Any, target: Any, **kwargs: Any) -> Any:
    """A buildable of the same class as ``template`` (nemo_run.Config stays nemo_run.Config)."""
    cls = type(template)
    if "Partial" in cls.__name__:  # a callback/strategy must be built into an object, not a partial
        for base in cls.__mro__:
            if base.__name__ == "Config":
                cls = base
                break
    return cls(target, **kwargs)


# -- Lightning strategies: our capture engine ----------------------------------------------------------------


_OUR_CALLBACK = "trainer.callbacks[CudaGraphCallback]"
_OUR_STRATEGY = "trainer.strategy[CudaGraphStrategy]"
_OUR_FP8 = "trainer.callbacks[AlignPipelineTransposes]"
_OUR_GATHER = "trainer.callbacks[Fp8ParamGatherRefresh]"
_OUR_FULL = "trainer.callbacks[MegatronFullIterationGraph]"


def _lightning_on(recipe: Any, trainer: Any, editor: _Editor, mode: Mode, fp8_refresh: Fp8Refresh,
                  options: dict[str, Any]) -> None:
    from nemo_cudagraph_plugin.lightning.callback import CudaGraphCallback
    from nemo_cudagraph_plugin.lightning.strategy import CudaGraphStrategy

    opts = dict(options)
    if fp8_refresh != "auto":
        opts["fp8_refresh"] = fp8_refresh
    _refuse_megatron_graphs_under_capture(recipe)
    strategy = _get(trainer, "strategy")
    ours_strategy = _is_ours(strategy, "CudaGraphStrategy")
    ours_callbacks = [c for c in _callback_list(trainer) if _is_ours(c, "CudaGraphCallback")]
    if mode == "auto":
        mode = "strategy" if ours_strategy else "callback"
    if mode == "callback" and ours_strategy:
        raise ValueError(
            "recipe.trainer.strategy is already CudaGraphStrategy; mode='callback' would capture the step twice. "
            "Call with_cuda_graph(recipe, enabled=False) first, or use mode='strategy'."
        )
    if mode == "strategy" and ours_callbacks:
        raise ValueError(
            "recipe.trainer.callbacks already holds CudaGraphCallback; mode='strategy' would capture the step "
            "twice. Call with_cuda_graph(recipe, enabled=False) first, or use mode='callback'."
        )
    if mode == "callback" and ours_callbacks:  # again: only update the options
        for name, value in opts.items():
            editor.set(ours_callbacks[0], _OUR_CALLBACK, name, value, "option updated")
    elif mode == "callback":
        _set_callbacks(trainer, editor, _config_like(trainer, CudaGraphCallback, **opts), lambda c: False,
                       "CudaGraphCallback captures the whole training step")
    elif ours_strategy:  # again: only update the options
        for name, value in opts.items():
            editor.set(strategy, _OUR_STRATEGY, name, value, "option updated")
    else:
        inner = _strategy_inner(strategy)
        editor.record.setdefault("trainer.strategy", _explicit(trainer, "strategy"))
        trainer.strategy = _config_like(trainer, CudaGraphStrategy, inner=inner, **opts)
        editor._log(Change("trainer.strategy", _describe(strategy), f"CudaGraphStrategy(inner={_describe(inner)})",
                           "CudaGraphStrategy captures the whole training step"))
    if _get(trainer, "detect_anomaly") is True:
        editor.set(trainer, "trainer", "detect_anomaly", False,
                   "anomaly detection checks every backward op on the host, which cannot run inside a CUDA graph")


def _lightning_off(recipe: Any, trainer: Any, editor: _Editor) -> None:
    strategy = _get(trainer, "strategy")
    if _is_ours(strategy, "CudaGraphStrategy"):
        if editor.fallback or "trainer.strategy" in editor.record:  # we wrapped it: unwrap
            inner = _get(strategy, "inner")
            original = editor.record.pop("trainer.strategy", "<none>")
            if _is_unset(original):
                if "strategy" in trainer.__dict__["__arguments__"]:
                    delattr(trainer, "strategy")
            else:
                trainer.strategy = inner if (isinstance(original, str) and original == "<none>") else original
            editor._log(Change("trainer.strategy", "CudaGraphStrategy(...)", _describe(_get(trainer, "strategy")),
                               "CudaGraphStrategy removed"))
        else:  # it was there before the flag, which only updated its options
            for key in [k for k in editor.record if k.startswith(_OUR_STRATEGY + ".")]:
                editor.restore(strategy, _OUR_STRATEGY, key.rsplit(".", 1)[1])
    ours = [c for c in _callback_list(trainer) if _is_ours(c, "CudaGraphCallback")]
    if ours and not editor.fallback and "trainer.callbacks" not in editor.record:
        for key in [k for k in editor.record if k.startswith(_OUR_CALLBACK + ".")]:
            editor.restore(ours[0], _OUR_CALLBACK, key.rsplit(".", 1)[1])
    elif ours:
        _set_callbacks(trainer, editor, None, lambda c: _is_ours(c, "CudaGraphCallback"), "CudaGraphCallback removed")
        _restore_empty_callbacks(trainer, editor)
    editor.restore(trainer, "trainer", "detect_anomaly")
    for key in [k for k in editor.record if k.startswith((_OUR_CALLBACK, _OUR_STRATEGY))]:
        del editor.record[key]  # options of our own callback/strategy, which are gone now


def _strategy_inner(strategy: Any) -> Any:
    if strategy is None or strategy in ("auto", "single_device", "ddp"):
        return strategy
    if isinstance(strategy, str):
        raise ValueError(
            f"CudaGraphStrategy cannot wrap strategy={strategy!r}; use None/'auto' (single device), 'ddp', or a "
            "Config(DDPStrategy, ...)."
        )
    names = _mro_names(strategy)
    if "DDPStrategy" in names or "SingleDeviceStrategy" in names:
        return strategy
    raise ValueError(
        f"CudaGraphStrategy cannot wrap {_describe(strategy)}: only single-device and DDP strategies are "
        "supported; use mode='callback' or change the strategy."
    )


def _describe(obj: Any) -> str:
    return f"Config({_name(obj)})" if _is_buildable(obj) else repr(obj)


def _refuse_megatron_graphs_under_capture(recipe: Any) -> None:
    model_cfg = _get(_get(recipe, "model"), "config")
    if model_cfg is None or not _is_buildable(model_cfg):
        return
    on = [n for n in ("enable_cuda_graph", "external_cuda_graph") if _get(model_cfg, n) is True]
    impl = _get(model_cfg, "cuda_graph_impl")
    if impl not in (None, "none"):
        on.append(f"cuda_graph_impl={impl!r}")
    if on:
        raise ValueError(
            f"model.config turns Megatron's own CUDA graphs on ({', '.join(on)}) while this is not a MegatronStrategy "
            "recipe; our whole-step capture would capture those graphs' kernels a second time. Turn Megatron's "
            "graphs off in model.config or drop the flag."
        )


# -- MegatronStrategy: Megatron's own graphs + FP8 care ------------------------------------------------------

def _model_config(recipe: Any) -> Any:
    model_cfg = _get(_get(recipe, "model"), "config")
    if model_cfg is None or not _is_buildable(model_cfg):
        raise ValueError(
            "a MegatronStrategy recipe needs recipe.model.config to be a Config of a megatron-core "
            f"TransformerConfig (e.g. Config(Llama3Config8B)); got {model_cfg!r}."
        )
    return model_cfg


def _megatron_on(recipe: Any, trainer: Any, editor: _Editor, mode: Mode, impl: str,
                 scope: Optional[Sequence[str]], fp8_refresh: Fp8Refresh, options: dict[str, Any]) -> None:
    if mode != "auto":
        raise ValueError(
            f"mode={mode!r} does not apply to a MegatronStrategy recipe: its step is Megatron's pipeline schedule "
            "(a dataloader_iter training step), not Lightning's closure, so our whole-step capture cannot drive it. "
            "Leave mode='auto': the flag turns Megatron-core's own CUDA graphs on instead."
        )
    not_here = sorted(set(options) - {"warmup_steps"})
    if not_here:
        raise ValueError(
            f"option(s) {not_here} configure our whole-step capture, which does not run under MegatronStrategy. "
            "Here the flag takes impl=, scope=, warmup_steps= (Megatron's cuda_graph_warmup_steps) and fp8_refresh=."
        )
    if any(_is_ours(c, "CudaGraphCallback") for c in _callback_list(trainer)):
        raise ValueError(
            "recipe.trainer.callbacks holds CudaGraphCallback, but this is a MegatronStrategy recipe: Megatron's "
            "schedules drive the step, so the callback cannot capture it. Remove it; with_cuda_graph turns "
            "Megatron-core's own CUDA graphs on instead."
        )
    if fp8_refresh not in (True, False, "auto"):
        raise ValueError(f"fp8_refresh={fp8_refresh!r}: use True, False or 'auto'.")
    model_cfg = _model_config(recipe)
    has_fp8 = _has_fp8_params(recipe, trainer, model_cfg)
    current_scope = _get(model_cfg, "cuda_graph_scope")
    capabilities: Any = _DETECT  # read once here when per-layer graphs are asked for, else by the call below
    if _per_layer_local(impl, scope, current_scope):
        from nemo_cudagraph_plugin.megatron import megatron_capabilities

        capabilities = megatron_capabilities()
    effective, _ = _default_scope(impl, scope, current_scope, None if capabilities == _DETECT else capabilities,
                                  "model.config")
    if has_fp8 and "full_iteration" not in _scope_names(effective if effective is not None else current_scope):
        raise ValueError(_PER_LAYER_FP8_PARAMS)
    strategy = _get(trainer, "strategy")
    if not _is_buildable(strategy) or "use_te_rng_tracker" not in _params(strategy):
        raise ValueError("trainer.strategy must be a Config(MegatronStrategy, ...) with use_te_rng_tracker.")
    setup = apply_megatron_graph_fields(
        model_cfg, impl=impl, scope=scope, warmup_steps=options.get("warmup_steps"), rng_tracker=False,
        capabilities=capabilities,
        set_field=lambda name, value, why: editor.set(model_cfg, "model.config", name, value, why),
        path="model.config",
    )
    editor.set(strategy, "trainer.strategy", "use_te_rng_tracker", True,
               "CUDA graphs need TE's graph-safe RNG tracker; connect() copies this onto model.config")
    if setup.full_iteration:
        _megatron_nan_checks_off(strategy, editor)
        if "cuda_graph_impl" in _params(model_cfg):
            # megatron-core >= 0.16 turns the scope into a list, so NeMo's MegatronStep never wraps the step
            # (megatron_parallel.py:1438 compares it with the string); this callback does, per training step.
            from nemo_cudagraph_plugin.lightning.pipeline_callback import MegatronFullIterationGraph

            _add_our_callback(trainer, editor, MegatronFullIterationGraph, _OUR_FULL,
                              "wrap each training step's forward-backward in megatron-core's FullCudaGraphWrapper "
                              "(NeMo 2.7 does so only for a string scope, which megatron-core >= 0.16 forbids)")
    else:
        ddp = _get(strategy, "ddp")
        if _is_buildable(ddp) and _get(ddp, "check_for_nan_in_grad"):
            log.info("with_cuda_graph: kept trainer.strategy.ddp.check_for_nan_in_grad=True: it runs in the gradient "
                     "sync hooks, outside megatron-core's per-layer graphs")
    pp = _get(strategy, "pipeline_model_parallel_size") or 1
    if fp8_refresh is True or (fp8_refresh == "auto" and has_fp8 and pp > 1):
        from nemo_cudagraph_plugin.lightning.pipeline_callback import AlignPipelineTransposes

        _add_our_callback(trainer, editor, AlignPipelineTransposes, _OUR_FP8,
                          "FP8 transposes of every model chunk current before any pipeline stage's first microbatch")
    elif fp8_refresh == "auto" and has_fp8:
        from nemo_cudagraph_plugin.lightning.pipeline_callback import Fp8ParamGatherRefresh

        log.info("with_cuda_graph: AlignPipelineTransposes not added: pipeline size 1, so no stage waits for another")
        _add_our_callback(trainer, editor, Fp8ParamGatherRefresh, _OUR_GATHER,
                          "refresh FP8 transposes where megatron-core's all-gather completes without rebuilding "
                          "them (e.g. the forced sync of NeMo's checkpoint save)")


# Measured on an H200 (megatron-core 0.16.1, TransformerEngine 2.20.2; docs/gpu-evidence/2026-12-03-megatron-bed.md).
_PER_LAYER_FP8_PARAMS = (
    "with_cuda_graph(recipe): this recipe keeps FP8 primary weights (trainer.plugins fp8 with fp8_param_gather / "
    "fp8_params, or model.config.fp8_param), and megatron-core's per-layer CUDA graphs fail on them: the first "
    "replay copies a Float8Tensor input into the graph's static buffer (megatron/core/transformer/cuda_graphs.py:587, "
    "`cudagraph_input.copy_(user_input)`) and CUDA reports 'invalid argument' (megatron-core 0.16.1 with "
    "TransformerEngine 2.20.2). Use with_cuda_graph(recipe, scope=['full_iteration']) — one graph per training step, "
    "measured bitwise equal to eager over 120 steps with FP8 primary weights and the distributed optimizer in this "
    "project's megatron-core test bed — or turn FP8 primary weights off."
)


def _add_our_callback(trainer: Any, editor: _Editor, cls: type, key: str, why: str) -> None:
    if not any(_is_ours(c, cls.__name__) for c in _callback_list(trainer)):
        _set_callbacks(trainer, editor, _config_like(trainer, cls), lambda c: False, why)
        editor.record[key] = True


def _megatron_nan_checks_off(strategy: Any, editor: _Editor) -> None:
    ddp = _get(strategy, "ddp")
    why = "reads the gradient norm on the host, which cannot run inside the full-iteration graph"
    if _is_buildable(ddp):
        for name in ("check_for_nan_in_grad", "check_for_large_grads"):
            if name in _params(ddp) and _get(ddp, name):
                editor.set(ddp, "trainer.strategy.ddp", name, False, why)
    elif ddp in (None, "megatron"):
        # MegatronStrategy builds DistributedDataParallelConfig(check_for_nan_in_grad=True) for "megatron".
        from megatron.core.distributed import DistributedDataParallelConfig

        editor.set(strategy, "trainer.strategy", "ddp",
                   _config_like(strategy, DistributedDataParallelConfig, check_for_nan_in_grad=False), why)


def _has_fp8_params(recipe: Any, trainer: Any, model_cfg: Any) -> bool:
    plugins = _get(trainer, "plugins")
    for plugin in plugins if isinstance(plugins, list) else [plugins]:
        if _is_buildable(plugin) and _get(plugin, "fp8") and (
            _get(plugin, "fp8_param_gather") or _get(plugin, "fp8_params")
        ):
            return True
    if _get(model_cfg, "fp8") and _get(model_cfg, "fp8_param"):
        return True
    ddp = _get(_get(trainer, "strategy"), "ddp")
    return bool(_is_buildable(ddp) and _get(ddp, "fp8_param_gather"))


def _megatron_off(recipe: Any, trainer: Any, editor: _Editor) -> None:
    fallback = editor.fallback
    model_cfg = _model_config(recipe)
    fields = _params(model_cfg)
    offs = {"cuda_graph_impl": "none", "enable_cuda_graph": False, "external_cuda_graph": False}
    for name in (*_MEGATRON_GRAPH_FIELDS, "gradient_accumulation_fusion"):
        if name in fields:
            editor.restore(model_cfg, "model.config", name, offs.get(name, _UNSET), why="CUDA graphs off")
    strategy = _get(trainer, "strategy")
    editor.restore(strategy, "trainer.strategy", "use_te_rng_tracker")
    for key in [k for k in editor.record if k.startswith("trainer.strategy.ddp.")]:
        editor.restore(_get(strategy, "ddp"), "trainer.strategy.ddp", key.rsplit(".", 1)[1])
    editor.restore(strategy, "trainer.strategy", "ddp")
    if fallback and _get(strategy, "use_te_rng_tracker"):
        log.info("with_cuda_graph(enabled=False): left trainer.strategy.use_te_rng_tracker=True and the NaN-check "
                 "settings as they are: the recipe carries no record of their values before with_cuda_graph "
                 "(it was serialized or copied with copy.copy since)")
    for key, name in ((_OUR_FP8, "AlignPipelineTransposes"), (_OUR_GATHER, "Fp8ParamGatherRefresh"),
                      (_OUR_FULL, "MegatronFullIterationGraph")):
        if editor.record.pop(key, None) or fallback:
            _set_callbacks(trainer, editor, None, lambda c, n=name: _is_ours(c, n), f"{name} removed")
    _restore_empty_callbacks(trainer, editor)


# ------------------------------------------------------------------------------------------------------------
# Recipe factory argument, command line, nemo_run plugin
# ------------------------------------------------------------------------------------------------------------


def with_cuda_graph_arg(factory: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a recipe factory so that it takes ``cuda_graph: bool = False`` (keyword-only).

    ``with_cuda_graph_arg(llm.llama3_8b.pretrain_recipe)(name="x", cuda_graph=True)`` returns the factory's
    recipe with :func:`with_cuda_graph` applied; ``cuda_graph=False`` returns it untouched. The wrapper's
    signature is the factory's plus ``cuda_graph``, so nemo_run's CLI and ``inspect`` see the argument.
    """
    sig = inspect.signature(factory)
    if "cuda_graph" in sig.parameters:
        raise ValueError(f"{getattr(factory, '__qualname__', factory)} already has a 'cuda_graph' parameter.")

    @functools.wraps(factory)
    def factory_with_cuda_graph(*args: Any, cuda_graph: bool = False, **kwargs: Any) -> Any:
        recipe = factory(*args, **kwargs)
        return with_cuda_graph(recipe) if cuda_graph else recipe

    params = list(sig.parameters.values())
    extra = inspect.Parameter("cuda_graph", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool)
    var_kw = [i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD]
    params.insert(var_kw[0] if var_kw else len(params), extra)
    factory_with_cuda_graph.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return factory_with_cuda_graph


def add_cuda_graph_argument(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--cuda-graph/--no-cuda-graph`` (default off) to an argparse parser."""
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=False,
                        help="turn CUDA graphs on in the recipe (nemo_cudagraph_plugin.nemo.with_cuda_graph)")
    return parser


def _resolve_factory(name: str) -> Callable[..., Any]:
    """``llama3_8b`` -> ``nemo.collections.llm.llama3_8b.pretrain_recipe``; ``pkg.mod:fn`` -> that function."""
    if ":" in name:
        module, attr = name.split(":", 1)
        return getattr(importlib.import_module(module), attr)
    from nemo.collections import llm

    mod = getattr(llm, name, None)
    factory = getattr(mod, "pretrain_recipe", None)
    if factory is None:
        raise ValueError(
            f"nemo.collections.llm has no recipe {name!r} with pretrain_recipe (is nvidia-modelopt installed? "
            "NeMo hides its recipes without it); or pass module:function."
        )
    return factory


def check_on_cpu(recipe: Any) -> Any:
    """Build a copy of the recipe's trainer and model on the CPU and run ``trainer.strategy.connect(model)``.

    This runs the same config validation that a GPU run does first (``MegatronStrategy.connect()`` re-runs
    megatron-core's ``TransformerConfig.__post_init__`` with the strategy's parallel settings). Only the copy
    is changed for the CPU: ``accelerator="cpu"``, ``devices=1``, one node, and ``apply_rope_fusion=False``
    when TransformerEngine is missing. Returns the connected model.
    """
    import copy

    import fiddle as fdl

    checked = copy.deepcopy(recipe)
    checked.trainer.accelerator = "cpu"
    checked.trainer.devices = 1
    checked.trainer.num_nodes = 1
    model_cfg = _get(_get(checked, "model"), "config")
    if model_cfg is not None and "apply_rope_fusion" in _params(model_cfg):
        try:
            importlib.import_module("transformer_engine")
        except ImportError:
            model_cfg.apply_rope_fusion = False
    trainer = fdl.build(checked.trainer)
    model = fdl.build(checked.model)
    trainer.strategy.connect(model)
    return model


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m nemo_cudagraph_plugin.nemo RECIPE [--cuda-graph] [--check] [--yaml PATH]``."""
    p = argparse.ArgumentParser(
        prog="python -m nemo_cudagraph_plugin.nemo",
        description="Build a NeMo 2 pretraining recipe, optionally with CUDA graphs, and print or check it.",
    )
    p.add_argument("recipe", help="a nemo.collections.llm recipe name (llama3_8b) or module:factory")
    add_cuda_graph_argument(p)
    p.add_argument("--name", default="cuda_graph_recipe")
    p.add_argument("--dir", default=None, help="log/checkpoint folder of the recipe")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--num-gpus-per-node", type=int, default=8)
    p.add_argument("--impl", default="local", choices=MEGATRON_IMPLS, help="Megatron cuda_graph_impl")
    p.add_argument("--scope", default=None, help="Megatron cuda_graph_scope, comma separated (default: whole layer)")
    p.add_argument("--check", action="store_true", help="validate on the CPU with trainer.strategy.connect(model)")
    p.add_argument("--yaml", default=None, help="write the recipe as YAML here ('-' for stdout)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        factory = _resolve_factory(args.recipe)
        kwargs: dict[str, Any] = {"name": args.name, "num_nodes": args.num_nodes,
                                  "num_gpus_per_node": args.num_gpus_per_node}
        if args.dir is not None:
            kwargs["dir"] = args.dir
        recipe = factory(**kwargs)
        if args.cuda_graph:
            with_cuda_graph(recipe, impl=args.impl, scope=None if args.scope is None else args.scope.split(","))
        if args.check:
            model = check_on_cpu(recipe)
            cfg = model.config
            print(f"check: trainer.strategy.connect(model) passed; cuda_graph_impl="
                  f"{getattr(cfg, 'cuda_graph_impl', None)!r} enable_cuda_graph={getattr(cfg, 'enable_cuda_graph', None)}"
                  f" cuda_graph_scope={getattr(cfg, 'cuda_graph_scope', None)} use_te_rng_tracker={cfg.use_te_rng_tracker}")
        if args.yaml is not None:
            from nemo_run.core.serialization.yaml import YamlSerializer

            text = YamlSerializer().serialize(recipe)
            if args.yaml == "-":
                print(text)
            else:
                with open(args.yaml, "w") as f:
                    f.write(text)
    except (ValueError, ImportError, AssertionError) as exc:
        print(f"nemo_cudagraph_plugin.nemo: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


# nemo_run.Plugin subclass, created on first access so that importing this module never imports nemo_run.
_PLUGIN_CLASS: Optional[type] = None


def _make_plugin_class() -> type:
    try:
        import nemo_run as run

        base: type = run.Plugin
    except ImportError:  # nemo_run missing: same class and behaviour, a plain dataclass base
        base = object

    @dataclasses.dataclass(kw_only=True)
    class CudaGraphPlugin(base):  # type: ignore[misc,valid-type]
        """A ``nemo_run.Plugin`` that applies :func:`with_cuda_graph` to the task.

        Args:
            enabled, mode, impl, scope, fp8_refresh: as for :func:`with_cuda_graph`.
            options: ``CudaGraphCallback`` options (Lightning recipes) / ``{"warmup_steps": n}`` (Megatron).
            drop_expandable_segments: remove ``expandable_segments:True`` from the executor's
                ``PYTORCH_CUDA_ALLOC_CONF`` (NeMo's own ``PerfEnvPlugin`` drops the whole variable for CUDA
                graphs, but only when ``enable_cuda_graph`` is set, which megatron-core >= 0.16 forbids).
        """

        enabled: bool = True
        mode: str = "auto"
        impl: str = "local"
        scope: Optional[list[str]] = None
        fp8_refresh: Union[bool, str] = "auto"
        options: Optional[dict[str, Any]] = None
        drop_expandable_segments: bool = True

        def setup(self, task: Any, executor: Any) -> None:
            """Edit the task (a ``run.Partial``) and the executor's environment."""
            if not _is_buildable(task):
                log.warning("CudaGraphPlugin has no effect on a %s task (only on run.Partial recipes)",
                            type(task).__name__)
                return
            with_cuda_graph(task, enabled=self.enabled, mode=self.mode, impl=self.impl, scope=self.scope,
                            fp8_refresh=self.fp8_refresh, **(self.options or {}))
            env = getattr(executor, "env_vars", None)
            if self.enabled and self.drop_expandable_segments and isinstance(env, dict):
                conf = env.get("PYTORCH_CUDA_ALLOC_CONF")
                if conf and "expandable_segments:True" in conf.split(","):
                    kept = [p for p in conf.split(",") if p != "expandable_segments:True"]
                    if kept:
                        env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(kept)
                    else:
                        del env["PYTORCH_CUDA_ALLOC_CONF"]
                    log.info("CudaGraphPlugin: removed expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF "
                             "(CUDA graph memory pools and expandable segments do not mix)")

    CudaGraphPlugin.__module__ = __name__
    CudaGraphPlugin.__qualname__ = "CudaGraphPlugin"
    return CudaGraphPlugin


def __getattr__(name: str) -> Any:
    global _PLUGIN_CLASS
    if name == "CudaGraphPlugin":
        if _PLUGIN_CLASS is None:
            _PLUGIN_CLASS = _make_plugin_class()
        return _PLUGIN_CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(main())
