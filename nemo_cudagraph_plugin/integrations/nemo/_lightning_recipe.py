"""The flag on a recipe with any Lightning strategy but ``MegatronStrategy``: our whole-step capture engine
(``CudaGraphCallback`` or ``CudaGraphStrategy``)."""

from __future__ import annotations

from typing import Any

from ..buildables import explicit_arg, get_attr, is_buildable, is_unset, mro_names
from ..megatron.graph_fields import Change
from ._editor import (
    _OUR_CALLBACK,
    _OUR_STRATEGY,
    Fp8Refresh,
    Mode,
    _callback_list,
    _config_like,
    _Editor,
    _is_ours,
    _name,
    _restore_empty_callbacks,
    _set_callbacks,
)


def _lightning_on(recipe: Any, trainer: Any, editor: _Editor, mode: Mode, fp8_refresh: Fp8Refresh,
                  options: dict[str, Any]) -> None:
    from ...lightning.callback import CudaGraphCallback
    from ...lightning.strategy import CudaGraphStrategy

    opts = dict(options)
    if fp8_refresh != "auto":
        opts["fp8_refresh"] = fp8_refresh
    _refuse_megatron_graphs_under_capture(recipe)
    strategy = get_attr(trainer, "strategy")
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
        editor.record.setdefault("trainer.strategy", explicit_arg(trainer, "strategy"))
        trainer.strategy = _config_like(trainer, CudaGraphStrategy, inner=inner, **opts)
        editor._log(Change("trainer.strategy", _describe(strategy), f"CudaGraphStrategy(inner={_describe(inner)})",
                           "CudaGraphStrategy captures the whole training step"))
    if get_attr(trainer, "detect_anomaly") is True:
        editor.set(trainer, "trainer", "detect_anomaly", False,
                   "anomaly detection checks every backward op on the host, which cannot run inside a CUDA graph")


def _lightning_off(recipe: Any, trainer: Any, editor: _Editor) -> None:
    strategy = get_attr(trainer, "strategy")
    if _is_ours(strategy, "CudaGraphStrategy"):
        if editor.fallback or "trainer.strategy" in editor.record:  # we wrapped it: unwrap
            inner = get_attr(strategy, "inner")
            original = editor.record.pop("trainer.strategy", "<none>")
            if is_unset(original):
                if "strategy" in trainer.__dict__["__arguments__"]:
                    delattr(trainer, "strategy")
            else:
                trainer.strategy = inner if (isinstance(original, str) and original == "<none>") else original
            editor._log(Change("trainer.strategy", "CudaGraphStrategy(...)", _describe(get_attr(trainer, "strategy")),
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
    names = mro_names(strategy)
    if "DDPStrategy" in names or "SingleDeviceStrategy" in names:
        return strategy
    raise ValueError(
        f"CudaGraphStrategy cannot wrap {_describe(strategy)}: only single-device and DDP strategies are "
        "supported; use mode='callback' or change the strategy."
    )


def _describe(obj: Any) -> str:
    return f"Config({_name(obj)})" if is_buildable(obj) else repr(obj)


def _refuse_megatron_graphs_under_capture(recipe: Any) -> None:
    model_cfg = get_attr(get_attr(recipe, "model"), "config")
    if model_cfg is None or not is_buildable(model_cfg):
        return
    on = [n for n in ("enable_cuda_graph", "external_cuda_graph") if get_attr(model_cfg, n) is True]
    impl = get_attr(model_cfg, "cuda_graph_impl")
    if impl not in (None, "none"):
        on.append(f"cuda_graph_impl={impl!r}")
    if on:
        raise ValueError(
            f"model.config turns Megatron's own CUDA graphs on ({', '.join(on)}) while this is not a MegatronStrategy "
            "recipe; our whole-step capture would capture those graphs' kernels a second time. Turn Megatron's "
            "graphs off in model.config or drop the flag."
        )


# -- MegatronStrategy: Megatron's own graphs + FP8 care
