"""The flag as a recipe-factory argument (:func:`with_cuda_graph_arg`), an argparse option, and the command line
``python -m nemo_cudagraph_plugin.integrations.nemo RECIPE [--cuda-graph] [--check] [--yaml PATH]``."""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, Optional

from ..buildables import get_attr, parameter_names
from ..megatron.graph_fields import MEGATRON_IMPLS
from .flag import with_cuda_graph

__all__ = ["add_cuda_graph_argument", "check_on_cpu", "main", "with_cuda_graph_arg"]


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
                        help="turn CUDA graphs on in the recipe (nemo_cudagraph_plugin.integrations.nemo.with_cuda_graph)")
    return parser


# The modules a recipe needs that come with NeMo (a bare "No module named 'nemo'" says nothing of which to install).
_NEMO_MODULES = ("nemo", "nemo_run", "fiddle", "megatron", "modelopt")
NEMO_INSTALL_HINT = (
    "This command builds NeMo 2 recipes: install NeMo with pip install 'nemo_cudagraph_plugin[nemo]' "
    "(nemo-toolkit 2.7.3, megatron-core 0.16.1, nemo_run and nvidia-modelopt, the versions the flag is tested with; "
    "ci/stages.sh's NEMO_PINS lists the full set the CI installs)."
)


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
    model_cfg = get_attr(get_attr(checked, "model"), "config")
    if model_cfg is not None and "apply_rope_fusion" in parameter_names(model_cfg):
        try:
            importlib.import_module("transformer_engine")
        except ImportError:
            model_cfg.apply_rope_fusion = False
    trainer = fdl.build(checked.trainer)
    model = fdl.build(checked.model)
    trainer.strategy.connect(model)
    return model


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m nemo_cudagraph_plugin.integrations.nemo RECIPE [--cuda-graph] [--check] [--yaml PATH]``."""
    p = argparse.ArgumentParser(
        prog="python -m nemo_cudagraph_plugin.integrations.nemo",
        description="Build a NeMo 2 pretraining recipe, optionally with CUDA graphs, and print or check it.",
    )
    p.add_argument("recipe", help="a nemo.collections.llm recipe name (llama3_8b) or module:factory")
    add_cuda_graph_argument(p)
    p.add_argument("--name", default="cuda_graph_recipe")
    p.add_argument("--dir", default=None, help="log/checkpoint folder of the recipe")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--num-gpus-per-node", type=int, default=8)
    p.add_argument("--impl", default="local", choices=MEGATRON_IMPLS, help="Megatron cuda_graph_impl")
    p.add_argument("--scope", default=None, help="Megatron cuda_graph_scope, comma separated (default: the flag's, per megatron-core: "
                   "full_iteration on 0.16.1, the whole layer where per-layer graphs are safe)")
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
        print(f"nemo_cudagraph_plugin.integrations.nemo: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in _NEMO_MODULES:
            print(NEMO_INSTALL_HINT, file=sys.stderr)
        return 2
    return 0


# nemo_run.Plugin subclass, created on first access so that importing this module never imports nemo_run.
