"""The NeMo 2 recipe flag: :func:`with_cuda_graph` (see :mod:`nemo_cudagraph_plugin.integrations.nemo`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

from ...core.config import option_names
from ..buildables import get_attr, is_buildable, mro_names
from ._editor import Fp8Refresh, Mode, _Editor, _is_megatron_strategy
from ._lightning_recipe import _lightning_off, _lightning_on
from ._megatron_recipe import _megatron_off, _megatron_on

__all__ = ["CAPTURE_OPTIONS", "with_cuda_graph"]

log = logging.getLogger(__name__)

#: Options of CudaGraphCallback / CudaGraphStrategy (our whole-step capture engine).
# The capture options the flag passes through (CaptureConfig is their one definition); `enabled` is the flag's own
# argument and pipeline alignment is the flag's decision (fp8_refresh / AlignPipelineTransposes).
CAPTURE_OPTIONS = tuple(n for n in option_names() if n not in ("enabled", "align_pp_transposes"))


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
        enabled: ``False`` undoes a previous call (see :mod:`nemo_cudagraph_plugin.integrations.nemo` for what is restored).
        mode: ``"callback"`` (append ``CudaGraphCallback``), ``"strategy"`` (wrap the strategy in
            ``CudaGraphStrategy``), ``"auto"`` (callback, or update our strategy if it is already there).
            Under ``MegatronStrategy`` only ``"auto"`` is accepted: Megatron's own graphs are configured.
        impl, scope: Megatron-core's ``cuda_graph_impl`` and ``cuda_graph_scope`` (``MegatronStrategy`` only);
            ``scope=["full_iteration"]`` captures the whole training step (see :mod:`nemo_cudagraph_plugin.integrations.nemo`).
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
    if _is_megatron_strategy(get_attr(trainer, "strategy")):
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
    if not is_buildable(recipe):
        raise ValueError(
            f"with_cuda_graph needs a nemo_run.Partial/Config recipe (a fiddle buildable), got {type(recipe).__name__}."
        )
    trainer = get_attr(recipe, "trainer")
    if trainer is None or not is_buildable(trainer) or "Trainer" not in mro_names(trainer):
        raise ValueError(
            "with_cuda_graph needs recipe.trainer to be a Config(Trainer, ...) (a Lightning/NeMo Trainer config); "
            f"got {trainer!r}."
        )
    return trainer
