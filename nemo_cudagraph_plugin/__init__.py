"""nemo_cudagraph_plugin: whole-step CUDA graphs for Lightning/NeMo LLM training.

Public entry points::

    from nemo_cudagraph_plugin import CudaGraphCallback, CudaGraphStrategy
    from nemo_cudagraph_plugin import refresh_fp8_transposes, verify_fp8_transposes  # TE FP8 care
    from nemo_cudagraph_plugin import align_fp8_transposes                            # pipeline stages
"""

from __future__ import annotations

from typing import Any

from .core.config import CaptureConfig, CaptureStats
from .core.errors import CaptureError, NonFiniteError, ParityError

__version__ = "0.1.0"

# Names resolved lazily: importing the package (e.g. for the Megatron-core hooks) imports neither
# Lightning nor TransformerEngine until one of these is used.
_LAZY = {
    "CudaGraphCallback": ".lightning.callback",
    "CudaGraphStrategy": ".lightning.strategy",
    "refresh_fp8_transposes": ".fp8",
    "verify_fp8_transposes": ".fp8",
    "install_fp8_refresh": ".fp8",
    "after_param_sync": ".fp8",
    "Fp8TransposeRefresh": ".lightning.fp8_callback",
    "align_fp8_transposes": ".fp8.pipeline",
    "MicrobatchTimer": ".diagnostics",
    "AlignPipelineTransposes": ".integrations.megatron.callbacks",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'nemo_cudagraph_plugin' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod, __name__), name)


__all__ = [
    "CaptureConfig",
    "CaptureError",
    "CaptureStats",
    "NonFiniteError",
    "ParityError",
    "__version__",
    *_LAZY,
]
