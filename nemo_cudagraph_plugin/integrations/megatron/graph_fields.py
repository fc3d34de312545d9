"""Megatron-core's CUDA-graph fields on a model config: planned for the installed megatron-core's field set, and
applied with the MoE, per-layer parity and fused-wgrad rules.

One code path for NeMo recipes (a fiddle ``Config`` of the model config, edited by
:func:`nemo_cudagraph_plugin.integrations.nemo.with_cuda_graph`) and Megatron-core loops (a ``TransformerConfig``
instance). Nothing here is captured; it decides what megatron-core captures. Megatron is not imported (the
installed megatron-core is read through :mod:`.capabilities` only when a decision needs it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from ..buildables import UNSET, get_attr, is_buildable, is_unset, parameter_names, same_value
from . import capabilities as _capabilities

__all__ = [
    "DETECT_CAPABILITIES",
    "MEGATRON_GRAPH_FIELDS",
    "MEGATRON_IMPLS",
    "Change",
    "MegatronGraphSetup",
    "apply_megatron_graph_fields",
    "default_scope",
    "per_layer_local",
    "plan_megatron_graph_fields",
    "scope_names",
]

log = logging.getLogger(__name__)


MEGATRON_IMPLS = ("local", "transformer_engine")


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
        :func:`nemo_cudagraph_plugin.integrations.megatron.full_iteration_forward_backward` in a Megatron loop) and turn
        Megatron DDP's host-side NaN checks off.

    Raises:
        ValueError: a combination the installed megatron-core or NeMo cannot run, with what to change.
    """
    if impl not in MEGATRON_IMPLS:
        raise ValueError(f"impl={impl!r} is not a Megatron CUDA graph implementation; use one of {MEGATRON_IMPLS}.")
    new_scope = None if scope is None else scope_names(scope)
    effective_scope = new_scope if new_scope is not None else scope_names(current.get("cuda_graph_scope"))
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
    changed = {k: v for k, v in updates.items() if not _field_equal(k, current.get(k, UNSET), v)}
    return changed, full_iteration


def _field_equal(name: str, a: Any, b: Any) -> bool:
    if name == "cuda_graph_scope" and not is_unset(a):
        # "full", [] and None all mean "the whole layer"; enums and strings compare by name.
        return scope_names(a) == scope_names(b)
    return same_value(a, b)


def scope_names(scope: Any) -> list[str]:
    """Normalise a ``cuda_graph_scope`` value (a comma-separated str, an enum, a list of either, ``None``) to a list
    of names; ``[]`` is megatron's "whole layer" (its old spelling ``"full"`` included)."""
    if scope is None:
        return []
    items = scope if isinstance(scope, (list, tuple)) else [scope]
    out = []
    for s in items:
        for part in (s.split(",") if isinstance(s, str) else [s]):
            name = str(getattr(part, "name", part)).strip()
            if name:
                out.append(name)
    return [] if out == ["full"] else out


MEGATRON_GRAPH_FIELDS = ("cuda_graph_impl", "enable_cuda_graph", "external_cuda_graph", "cuda_graph_scope",
                          "cuda_graph_warmup_steps")
DETECT_CAPABILITIES = "detect"


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
    if is_buildable(config):
        return parameter_names(config)
    if dataclasses.is_dataclass(config):
        return {f.name for f in dataclasses.fields(config)}
    return set(getattr(config, "__dict__", {}))


def _dropless_moe(config: Any, fields: set[str]) -> Optional[str]:
    """Why an MoE config's token dispatcher cannot be captured (it is dropless); ``None`` for a dense or a
    drop-and-pad MoE config."""
    experts = get_attr(config, "num_moe_experts") if "num_moe_experts" in fields else None
    if not isinstance(experts, int) or experts <= 1:
        return None
    capacity = get_attr(config, "moe_expert_capacity_factor")
    padded = bool(get_attr(config, "moe_pad_expert_input_to_capacity"))
    if capacity is not None and padded:
        return None
    return (
        f"this MoE config is dropless (moe_expert_capacity_factor={capacity!r}, moe_pad_expert_input_to_capacity="
        f"{padded}): its {get_attr(config, 'moe_token_dispatcher_type')!r} token dispatcher reads per-expert token counts "
        "on the host, which cannot run inside a CUDA graph capture"
    )


def _moe_scope(config: Any, fields: set[str], impl: str, requested: list[str],
               explicit: bool) -> tuple[Optional[list[str]], list[str]]:
    """For an MoE config: the scope to use instead of ``requested`` (``None``: keep it) and notes.

    megatron-core checks a graphed MoE dispatcher only when ``moe`` is listed explicitly
    (transformer_config.py: 'moe cuda graph is only supported with drop-padding MoE'); the default whole-layer
    scope also captures a dropless token dispatcher, which reads token counts on the host: the capture fails.
    """
    experts = get_attr(config, "num_moe_experts") if "num_moe_experts" in fields else None
    if not isinstance(experts, int) or experts <= 1:
        return None, []
    capacity = get_attr(config, "moe_expert_capacity_factor")
    dispatcher = get_attr(config, "moe_token_dispatcher_type")
    fp8_padding = bool(get_attr(config, "moe_router_padding_for_fp8"))
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


def per_layer_local(impl: str, scope: Optional[Sequence[str]], current_scope: Any) -> bool:
    """Would megatron-core's own per-layer graphs (``impl="local"``, not the whole iteration) be configured?"""
    names = scope_names(scope) if scope is not None else scope_names(current_scope)
    return impl == "local" and "full_iteration" not in names


def default_scope(impl: str, scope: Optional[Sequence[str]], current_scope: Any, capabilities: Any,
                   path: str) -> tuple[Optional[Sequence[str]], Optional[str]]:
    """The scope to configure and, when per-layer graphs are refused on this megatron-core, why.

    No scope given (the flag's default): ``["full_iteration"]`` where per-layer graphs are refused. A per-layer
    scope the user gave there: ``ValueError`` with the reason and what to use instead.
    """
    if not per_layer_local(impl, scope, current_scope):
        return scope, None
    refused = _capabilities.per_layer_refusal(capabilities)
    if refused is None:
        return scope, None
    if scope is not None:
        raise ValueError(
            f"{path}.cuda_graph_scope={scope_names(scope)!r} with cuda_graph_impl='local' (per-layer graphs): "
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
    capabilities: Any = DETECT_CAPABILITIES,
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
      the chosen graphs (:func:`nemo_cudagraph_plugin.integrations.megatron.fused_wgrad_graph_safety`, Megatron-LM #1279);
    * ``use_te_rng_tracker=True`` (``rng_tracker=True``; NeMo recipes set it on the strategy instead).

    Per-layer graphs (``impl="local"`` without ``"full_iteration"``) on a megatron-core whose forward capture hands
    buffers TransformerEngine saved for the backward back to its reuse pool (megatron-core 0.16.1,
    :func:`nemo_cudagraph_plugin.integrations.megatron.per_layer_refusal`) were measured not to reproduce eager training: with
    ``scope=None`` the whole-iteration graph is configured instead (logged, WARNING); a per-layer ``scope`` raises
    ``ValueError``. With ``capabilities=None`` (megatron-core unreadable) per-layer graphs stay, with a warning.

    A plain ``TransformerConfig`` has converted its scope in ``__post_init__`` already: call
    ``config.__post_init__()`` after this, as NeMo's ``MegatronStrategy.connect()`` does.

    Args:
        config: a megatron-core ``TransformerConfig`` (or a fiddle ``Config`` of one, or any object with the
            fields as attributes).
        impl, scope, warmup_steps: see :func:`with_cuda_graph`.
        rng_tracker: also set ``use_te_rng_tracker=True`` on this config.
        capabilities: a :class:`~nemo_cudagraph_plugin.integrations.megatron.MegatronCapabilities`, ``None`` (unknown), or
            ``"detect"`` (read the installed megatron-core, only when fused wgrad accumulation is on).
        set_field: ``set_field(name, value, why)`` instead of ``setattr`` (the flag records undo values).
        path: how the config is named in the log (``"model.config"`` for recipes).

    Raises:
        ValueError: a combination megatron-core or NeMo cannot run; the message says what to change.
    """
    fields = _config_fields(config)
    current = {name: get_attr(config, name) for name in MEGATRON_GRAPH_FIELDS if name in fields}
    gaf = "gradient_accumulation_fusion" in fields and get_attr(config, "gradient_accumulation_fusion") is True
    if capabilities == DETECT_CAPABILITIES and (gaf or per_layer_local(impl, scope, current.get("cuda_graph_scope"))):
        capabilities = _capabilities.megatron_capabilities()
    known = None if capabilities == DETECT_CAPABILITIES else capabilities
    explicit = scope is not None
    scope, refused = default_scope(impl, scope, current.get("cuda_graph_scope"), known, path)
    requested = scope_names(scope) if scope is not None else scope_names(current.get("cuda_graph_scope"))
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
        safe, reason = _capabilities.fused_wgrad_graph_safety(impl=impl, full_iteration=full_iteration, capabilities=known)
        if not safe:
            updates["gradient_accumulation_fusion"] = False
            whys["gradient_accumulation_fusion"] = f"fused wgrad accumulation is not graph-safe here: {reason}"
            notes.append(f"{path}.gradient_accumulation_fusion turned off: {reason}.")
    if not full_iteration and impl == "local":
        note = _capabilities.per_layer_parity_note(known)
        if note is not None:
            notes.append(note)
    if rng_tracker and "use_te_rng_tracker" in fields and get_attr(config, "use_te_rng_tracker") is not True:
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
            old = get_attr(config, name, UNSET)
            setattr(config, name, updates[name])
            change = Change(f"{path}.{name}", old, updates[name], whys[name])
            changes.append(change)
            log.info("with_cuda_graph: %s", change)
    final_scope = scope_names(updates.get("cuda_graph_scope", current.get("cuda_graph_scope")))
    return MegatronGraphSetup(changes=changes, full_iteration=full_iteration, scope=final_scope, notes=notes)

