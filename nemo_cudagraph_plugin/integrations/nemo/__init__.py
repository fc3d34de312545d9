"""NeMo 2 recipe flag: turn CUDA graphs on in a ``nemo_run`` recipe, consistently.

Four ways in, one implementation (:func:`with_cuda_graph`)::

    from nemo.collections import llm
    from nemo_cudagraph_plugin.integrations.nemo import CudaGraphPlugin, with_cuda_graph, with_cuda_graph_arg

    recipe = with_cuda_graph(llm.llama3_8b.pretrain_recipe(name="x", num_gpus_per_node=8))   # 1. a function
    run.run(recipe, executor=executor, plugins=[CudaGraphPlugin()])                          # 2. a nemo_run.Plugin
    pretrain = with_cuda_graph_arg(llm.llama3_8b.pretrain_recipe)                            # 3. a factory argument
    recipe = pretrain(name="x", cuda_graph=True)
    # 4. the command line: python -m nemo_cudagraph_plugin.integrations.nemo llama3_8b --cuda-graph --check

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
    :class:`~nemo_cudagraph_plugin.integrations.megatron.MegatronFullIterationGraph`, which wraps each
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
    logged, and ``full_iteration`` is refused (:func:`~nemo_cudagraph_plugin.integrations.megatron.apply_megatron_graph_fields`);
  - where megatron-core's forward capture returns buffers TransformerEngine saved for the backward to its reuse pool
    (megatron-core 0.16; an untested megatron-core is treated the same, with a warning), its per-layer graphs were measured not to reproduce
    eager training while the whole-iteration graph was bitwise equal to eager: there the flag's default is
    ``scope=["full_iteration"]`` (logged with the reason) and a per-layer ``scope`` is refused (``ValueError``);
  - TE's fused wgrad accumulation (``gradient_accumulation_fusion``) is turned off where the installed
    megatron-core's graph replay does not restore ``grad_added_to_main_grad`` (Megatron-LM #1279; 0.16.1 does);
  - FP8 primary weights (``fp8_param_gather``/``fp8_params``/``fp8_param``): megatron-core >= 0.16 rebuilds the
    transposes itself when each parameter all-gather completes. The flag appends
    :class:`~nemo_cudagraph_plugin.integrations.megatron.Fp8ParamGatherRefresh` (pipeline size 1), which
    refreshes only where megatron-core does not (the forced sync of NeMo's checkpoint save, older megatron-core),
    or :class:`~nemo_cudagraph_plugin.integrations.megatron.AlignPipelineTransposes` (pipeline size > 1,
    or ``fp8_refresh=True``), which does the same for Megatron chunks. Neither forces an all-gather;
  - does not apply: our capture engine, its parity checks (``verify_steps``) and its device-side NaN guard
    (they belong to the captured step); passing their options raises ``ValueError``.

* **Any other Lightning strategy** (single device, ``"ddp"``, ``DDPStrategy``): appends
  ``Config(CudaGraphCallback, **options)`` to ``trainer.callbacks`` (``mode="callback"``, the default) or
  swaps ``trainer.strategy`` for ``Config(CudaGraphStrategy, inner=<the old strategy>, **options)``
  (``mode="strategy"``). ``trainer.detect_anomaly=True`` (a host check after every backward op, which
  cannot run inside a graph) is turned off.

Every change is logged (loggers under ``nemo_cudagraph_plugin.integrations``, INFO) as ``path: old -> new (why)``.
Calling it again is harmless (nothing changes; new options update our callback). ``enabled=False`` undoes
it: it restores exactly the values it changed while the recipe object carries its record (in-place edits
and ``copy.deepcopy``/pickle keep it). After a serialization round trip (YAML, nemo_run's JSON) the record
is gone; then ``enabled=False`` turns CUDA graphs off (our callback/strategy removed, Megatron's graph
fields off) and leaves ``use_te_rng_tracker`` and NaN-check settings as they are, saying so in the log.

This package imports neither NeMo nor ``nemo_run`` at import time; it edits any ``fiddle`` tree
(``nemo_run.Config``/``Partial`` are ``fiddle`` classes) and recognises NeMo classes by name.

One concern per module: :mod:`.flag` (:func:`with_cuda_graph`), :mod:`._editor` (the recorded, logged edits),
:mod:`._lightning_recipe` and :mod:`._megatron_recipe` (the two kinds of recipe), :mod:`.cli` (factory argument and
command line), :mod:`.plugin` (``CudaGraphPlugin``).
"""

from __future__ import annotations

from typing import Any

from .cli import add_cuda_graph_argument, check_on_cpu, main, with_cuda_graph_arg
from .flag import CAPTURE_OPTIONS, with_cuda_graph

__all__ = [
    "CAPTURE_OPTIONS",
    "CudaGraphPlugin",  # noqa: F822  (made on first access by the module __getattr__ below)
    "add_cuda_graph_argument",
    "check_on_cpu",
    "main",
    "with_cuda_graph",
    "with_cuda_graph_arg",
]


def __getattr__(name: str) -> Any:
    if name == "CudaGraphPlugin":  # a nemo_run.Plugin subclass: nemo_run is imported on first access only
        from . import plugin

        return plugin.CudaGraphPlugin
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
