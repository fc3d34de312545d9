"""``CudaGraphPlugin``: a ``nemo_run.Plugin`` that applies the flag to a task, made on first access so that
importing this module never imports nemo_run."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Union

from ..buildables import is_buildable
from .flag import with_cuda_graph

__all__ = ["CudaGraphPlugin"]  # noqa: F822  (made on first access by the module __getattr__ below)

log = logging.getLogger(__name__)

_PLUGIN_CLASS: Optional[type] = None  # made once, on first access


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
            if not is_buildable(task):
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
