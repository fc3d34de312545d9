"""Framework-free core: capture engine, static buffers, graph cache, RNG, optimizer prep, NaN guard."""

from ._torch_compat import compiled_runs_under_modes, compiled_submodule, compiled_with_cuda_graphs
from .adapter import StepAdapter, StepFunctions
from .buffers import StaticInputs, flatten, signature_of, unflatten
from .config import CaptureConfig, CaptureStats
from .engine import CaptureEngine, GraphEntry
from .errors import CaptureError, NonFiniteError, ParityError
from .graph_cache import GraphCache
from .nan_guard import NanGuard, NanPolicy
from .optim import OptimizerPrep, check_optimizer_supported, portable_optimizer_state
from .rng import GeneratorRegistry

__all__ = [
    "CaptureConfig",
    "CaptureEngine",
    "CaptureError",
    "CaptureStats",
    "GeneratorRegistry",
    "GraphCache",
    "GraphEntry",
    "NanGuard",
    "NanPolicy",
    "NonFiniteError",
    "OptimizerPrep",
    "ParityError",
    "StaticInputs",
    "StepAdapter",
    "StepFunctions",
    "check_optimizer_supported",
    "compiled_runs_under_modes",
    "compiled_submodule",
    "compiled_with_cuda_graphs",
    "flatten",
    "portable_optimizer_state",
    "signature_of",
    "unflatten",
]
