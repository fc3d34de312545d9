"""FP8 (TransformerEngine ``Float8Tensor``) care, with or without CUDA graphs.

After an optimizer writes new FP8 bytes in place, each FP8 weight's cached transpose (read by
the backward GEMMs on Hopper) is stale. Eager TE rebuilds it; a CUDA graph does not.

* :func:`refresh_fp8_transposes` - ``_reset_caches()`` + in-place transpose recompute, per TE
  API generation (1.6-1.7, 1.8-1.14, 2.x), detected from the tensor's methods; on TE 2.x with
  Triton, all transposes in one kernel launch (:class:`Fp8RefreshPlan`, ``fused``).
* :func:`install_fp8_refresh` - run that after every ``optimizer.step()`` (torch step post-hook):
  captured into the step graph when the step is captured, eager otherwise.
* :func:`after_param_sync` - the hook point for optimizers that write FP8 bytes after their
  parameter all-gather (Megatron-style distributed optimizers, NeMo's distributed Adam).
* :func:`verify_fp8_transposes` - debug check, byte for byte.
* :func:`is_te_module`, :func:`has_te_modules`, :func:`fp8_scaling_state` - a TE module, TE modules in a model,
  and the scaling state TE's own kernels update (snapshotted around ``verify_steps``).
* :mod:`.hazards` - RNG tracker, ``is_first_microbatch`` and delayed-scaling checks for capture.
* :class:`MasterWeightAdamW` - AdamW on FP32 master weights that writes the FP8 weights from them in place after
  each update: what FP8 primary weights need to train right, and capturable whole.
* :mod:`.formats` - FP8 weights a fit cannot train right (a format the GPU does not run, an optimizer without FP32
  master weights), for the refusals before the first step.

Importing this package never imports TransformerEngine; FP8 tensors are found by duck typing.
"""

from ._te_compat import (
    UnsupportedFp8ApiError,
    check_te_version,
    fp8_scaling_state,
    has_te_modules,
    is_te_module,
    te_installed,
    te_version,
)
from .hazards import (
    FirstMicrobatchCheck,
    check_delayed_scaling_registered,
    graph_safe_rng_generators,
    register_rng_generators,
)
from .master import MasterWeightAdamW
from .refresh import (
    Fp8RefreshHandle,
    Fp8RefreshPlan,
    after_param_sync,
    fp8_refresh_wanted,
    install_fp8_refresh,
    iter_fp8_params,
    named_fp8_params,
    refresh_fp8_transposes,
)
from .verify import Fp8VerifyReport, StaleTransposeError, verify_fp8_transposes

__all__ = [
    "FirstMicrobatchCheck",
    "MasterWeightAdamW",
    "Fp8RefreshHandle",
    "Fp8RefreshPlan",
    "Fp8VerifyReport",
    "StaleTransposeError",
    "UnsupportedFp8ApiError",
    "after_param_sync",
    "check_delayed_scaling_registered",
    "check_te_version",
    "fp8_refresh_wanted",
    "fp8_scaling_state",
    "graph_safe_rng_generators",
    "has_te_modules",
    "is_te_module",
    "install_fp8_refresh",
    "iter_fp8_params",
    "named_fp8_params",
    "refresh_fp8_transposes",
    "register_rng_generators",
    "te_installed",
    "te_version",
    "verify_fp8_transposes",
]
