"""The flag on a NeMo ``MegatronStrategy`` recipe: megatron-core's own CUDA graphs (the fields of
:func:`~nemo_cudagraph_plugin.integrations.megatron.apply_megatron_graph_fields` on ``model.config``), the graph-safe
RNG tracker, NaN checks, and the Megatron callbacks that FP8 primary weights or the whole-iteration graph need."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

from ..buildables import UNSET, get_attr, is_buildable, parameter_names
from ..megatron import capabilities as _capabilities
from ..megatron.graph_fields import (
    DETECT_CAPABILITIES,
    MEGATRON_GRAPH_FIELDS,
    apply_megatron_graph_fields,
    default_scope,
    per_layer_local,
    scope_names,
)
from ._editor import (
    _OUR_FP8,
    _OUR_FULL,
    _OUR_GATHER,
    Fp8Refresh,
    Mode,
    _add_our_callback,
    _callback_list,
    _config_like,
    _Editor,
    _is_ours,
    _restore_empty_callbacks,
    _set_callbacks,
)

log = logging.getLogger(__name__)


def _model_config(recipe: Any) -> Any:
    model_cfg = get_attr(get_attr(recipe, "model"), "config")
    if model_cfg is None or not is_buildable(model_cfg):
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
    current_scope = get_attr(model_cfg, "cuda_graph_scope")
    capabilities: Any = DETECT_CAPABILITIES  # read once here when per-layer graphs are asked for, else by the call below
    if per_layer_local(impl, scope, current_scope):
        capabilities = _capabilities.megatron_capabilities()
    effective, _ = default_scope(impl, scope, current_scope, None if capabilities == DETECT_CAPABILITIES else capabilities,
                                  "model.config")
    if has_fp8 and "full_iteration" not in scope_names(effective if effective is not None else current_scope):
        raise ValueError(_PER_LAYER_FP8_PARAMS)
    strategy = get_attr(trainer, "strategy")
    if not is_buildable(strategy) or "use_te_rng_tracker" not in parameter_names(strategy):
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
        if "cuda_graph_impl" in parameter_names(model_cfg):
            # megatron-core >= 0.16 turns the scope into a list, so NeMo's MegatronStep never wraps the step
            # (megatron_parallel.py:1438 compares it with the string); this callback does, per training step.
            from ..megatron.callbacks import MegatronFullIterationGraph

            _add_our_callback(trainer, editor, MegatronFullIterationGraph, _OUR_FULL,
                              "wrap each training step's forward-backward in megatron-core's FullCudaGraphWrapper "
                              "(NeMo 2.7 does so only for a string scope, which megatron-core >= 0.16 forbids)")
    else:
        ddp = get_attr(strategy, "ddp")
        if is_buildable(ddp) and get_attr(ddp, "check_for_nan_in_grad"):
            log.info("with_cuda_graph: kept trainer.strategy.ddp.check_for_nan_in_grad=True: it runs in the gradient "
                     "sync hooks, outside megatron-core's per-layer graphs")
    pp = get_attr(strategy, "pipeline_model_parallel_size") or 1
    if fp8_refresh is True or (fp8_refresh == "auto" and has_fp8 and pp > 1):
        from ..megatron.callbacks import AlignPipelineTransposes

        _add_our_callback(trainer, editor, AlignPipelineTransposes, _OUR_FP8,
                          "FP8 transposes of every model chunk current before any pipeline stage's first microbatch")
    elif fp8_refresh == "auto" and has_fp8:
        from ..megatron.callbacks import Fp8ParamGatherRefresh

        log.info("with_cuda_graph: AlignPipelineTransposes not added: pipeline size 1, so no stage waits for another")
        _add_our_callback(trainer, editor, Fp8ParamGatherRefresh, _OUR_GATHER,
                          "refresh FP8 transposes where megatron-core's all-gather completes without rebuilding "
                          "them (e.g. the forced sync of NeMo's checkpoint save)")


# Measured on an H200 with benchmarks/megatron_bed.py (megatron-core 0.16.1, TransformerEngine 2.20.2).
_PER_LAYER_FP8_PARAMS = (
    "with_cuda_graph(recipe): this recipe keeps FP8 primary weights (trainer.plugins fp8 with fp8_param_gather / "
    "fp8_params, or model.config.fp8_param), and megatron-core's per-layer CUDA graphs fail on them: the first "
    "replay copies a Float8Tensor input into the graph's static buffer (megatron/core/transformer/cuda_graphs.py:587, "
    "`cudagraph_input.copy_(user_input)`) and CUDA reports 'invalid argument' (megatron-core 0.16.1 with "
    "TransformerEngine 2.20.2). Use with_cuda_graph(recipe, scope=['full_iteration']) — one graph per training step, "
    "measured bitwise equal to eager over 120 steps with FP8 primary weights and the distributed optimizer in this "
    "project's megatron-core test bed — or turn FP8 primary weights off."
)


def _megatron_nan_checks_off(strategy: Any, editor: _Editor) -> None:
    ddp = get_attr(strategy, "ddp")
    why = "reads the gradient norm on the host, which cannot run inside the full-iteration graph"
    if is_buildable(ddp):
        for name in ("check_for_nan_in_grad", "check_for_large_grads"):
            if name in parameter_names(ddp) and get_attr(ddp, name):
                editor.set(ddp, "trainer.strategy.ddp", name, False, why)
    elif ddp in (None, "megatron"):
        # MegatronStrategy builds DistributedDataParallelConfig(check_for_nan_in_grad=True) for "megatron".
        from megatron.core.distributed import DistributedDataParallelConfig

        editor.set(strategy, "trainer.strategy", "ddp",
                   _config_like(strategy, DistributedDataParallelConfig, check_for_nan_in_grad=False), why)


def _has_fp8_params(recipe: Any, trainer: Any, model_cfg: Any) -> bool:
    plugins = get_attr(trainer, "plugins")
    for plugin in plugins if isinstance(plugins, list) else [plugins]:
        if is_buildable(plugin) and get_attr(plugin, "fp8") and (
            get_attr(plugin, "fp8_param_gather") or get_attr(plugin, "fp8_params")
        ):
            return True
    if get_attr(model_cfg, "fp8") and get_attr(model_cfg, "fp8_param"):
        return True
    ddp = get_attr(get_attr(trainer, "strategy"), "ddp")
    return bool(is_buildable(ddp) and get_attr(ddp, "fp8_param_gather"))


def _megatron_off(recipe: Any, trainer: Any, editor: _Editor) -> None:
    fallback = editor.fallback
    model_cfg = _model_config(recipe)
    fields = parameter_names(model_cfg)
    offs = {"cuda_graph_impl": "none", "enable_cuda_graph": False, "external_cuda_graph": False}
    for name in (*MEGATRON_GRAPH_FIELDS, "gradient_accumulation_fusion"):
        if name in fields:
            editor.restore(model_cfg, "model.config", name, offs.get(name, UNSET), why="CUDA graphs off")
    strategy = get_attr(trainer, "strategy")
    editor.restore(strategy, "trainer.strategy", "use_te_rng_tracker")
    for key in [k for k in editor.record if k.startswith("trainer.strategy.ddp.")]:
        editor.restore(get_attr(strategy, "ddp"), "trainer.strategy.ddp", key.rsplit(".", 1)[1])
    editor.restore(strategy, "trainer.strategy", "ddp")
    if fallback and get_attr(strategy, "use_te_rng_tracker"):
        log.info("with_cuda_graph(enabled=False): left trainer.strategy.use_te_rng_tracker=True and the NaN-check "
                 "settings as they are: the recipe carries no record of their values before with_cuda_graph "
                 "(it was serialized or copied with copy.copy since)")
    for key, name in ((_OUR_FP8, "AlignPipelineTransposes"), (_OUR_GATHER, "Fp8ParamGatherRefresh"),
                      (_OUR_FULL, "MegatronFullIterationGraph")):
        if editor.record.pop(key, None) or fallback:
            _set_callbacks(trainer, editor, None, lambda c, n=name: _is_ours(c, n), f"{name} removed")
    _restore_empty_callbacks(trainer, editor)
