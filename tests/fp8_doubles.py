"""CPU test doubles of TransformerEngine ``Float8Tensor`` transpose-cache semantics, per API generation.

Each double is a ``torch.nn.Parameter`` subclass (so modules, optimizers and
``named_parameters()`` see it like a real TE FP8 parameter) carrying TE's private layout:
``_data`` (uint8 ``[*M, N]``, the FP8 bytes), ``_transpose`` (uint8 ``[N, *M]`` or ``None``) and
``_transpose_invalid``. Method names, signatures and behaviour follow TE's source:

===========  =====================================================================================
generation   methods (what they do)
===========  =====================================================================================
``te1.6``    TE 1.6-1.7. ``_reset_caches()`` marks invalid. ``transpose_2d(*, cache=False,
             noop_flag=None)``: ``cache=False`` returns a fresh, uncached transpose; ``cache=True``
             returns the cache without computing if it is valid, else recomputes *into the
             existing buffer* (allocating only if there is none) and marks it valid.
``te1.8``    TE 1.8-1.14. ``_reset_caches()`` marks invalid. ``transpose_2d(*, force_compute=False,
             fill_cache=False, noop_flag=None, cache=None)``: computes when forced, when the cache is
             missing or invalid, or with a noop flag; into the existing buffer; ``fill_cache`` keeps it.
``te2``      TE 2.x. ``_reset_caches()`` marks invalid (column-wise-only tensors - no ``_data`` - stay
             valid). ``_create_transpose()`` recomputes in place, allocates when there is no buffer,
             does nothing without ``_data``. ``update_usage(...)`` mimics Hopper: builds a missing
             or invalid transpose when column-wise usage is requested, drops it when not needed.
===========  =====================================================================================

So "marks invalid" (``_reset_caches``) and "recomputes in place" (the refresh methods) are
separate, as in TE, and a simulated graph (:func:`graph_read`) reads the buffer whatever the
flag says, while :func:`eager_read` does what eager TE does before a backward GEMM.

Recording when a transpose was computed: give the doubles one shared :class:`TransposeLog`.
Every reset, compute, allocation, cache hit, drop and simulated optimizer write appends a
:class:`TransposeEvent` with a global sequence number; ``log.mark("label")`` interleaves your own
markers (e.g. microbatch boundaries). Example::

    from fp8_doubles import TransposeLog, make_fp8_param, write_fp8_bytes

    log = TransposeLog()
    w = make_fp8_param("te2", (8, 4), fp8_name="w0", log=log)
    write_fp8_bytes(w, seed=1)              # 'write' then 'reset'
    log.mark("step")
    w._create_transpose()                   # 'compute'
    assert log.seqs("compute", "w0")[-1] > log.seqs("mark", "step")[-1]

TE's quantized formats, recipes and ``FusedAdam`` by name (what the pre-fit refusals key on, TE 2.20's classes and
modules): :func:`te_named_param` (a ``Float8Tensor``, ``Float8BlockwiseQTensor``, ``MXFP8Tensor`` or ``NVFP4Tensor``
parameter), :func:`te_recipe` (``DelayedScaling()``, ``MXFP8BlockScaling()``, ...), :class:`TEFusedAdam`.

(``tests/`` is on ``sys.path`` under pytest's default import mode, so ``from fp8_doubles import ...``
works from any test module below ``tests/``.)
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = [
    "GENERATIONS",
    "DOUBLE_CLASSES",
    "TEFusedAdam",
    "TE15Float8Double",
    "TE16Float8Double",
    "TE18Float8Double",
    "TE2Float8Double",
    "TransposeEvent",
    "TransposeLog",
    "WritingOptimizer",
    "eager_read",
    "expected_transpose",
    "graph_read",
    "make_fp8_module",
    "make_fp8_param",
    "quantized_fp8_param",
    "run_closure",
    "te_named_param",
    "te_recipe",
    "transpose_is_current",
    "write_fp8_bytes",
]

GENERATIONS = ("te1.6", "te1.8", "te2")


@dataclass(frozen=True)
class TransposeEvent:
    """One recorded event.

    Attributes:
        seq: global order within the log.
        tensor: the double's ``fp8_name`` (or the label of a ``mark``).
        kind: ``"reset"``, ``"compute"`` (transpose written into a cached buffer),
            ``"compute-uncached"`` (a transpose returned without caching), ``"alloc"`` (new buffer),
            ``"cache-hit"`` (cached transpose returned without computing), ``"drop"`` (buffer
            released), ``"write"`` (FP8 bytes overwritten in place) or ``"mark"``.
        ptr: ``data_ptr()`` of the transpose buffer involved, when there is one.
    """

    seq: int
    tensor: str
    kind: str
    ptr: Optional[int] = None


class TransposeLog:
    """Ordered record of transpose-cache events of one or more doubles."""

    def __init__(self) -> None:
        self.events: list[TransposeEvent] = []
        self._counter = itertools.count()

    def record(self, tensor: str, kind: str, ptr: Optional[int] = None) -> TransposeEvent:
        ev = TransposeEvent(next(self._counter), tensor, kind, ptr)
        self.events.append(ev)
        return ev

    def mark(self, label: str) -> TransposeEvent:
        """Add a user marker (``kind == "mark"``, ``tensor == label``)."""
        return self.record(label, "mark")

    def select(self, kind: Optional[str] = None, tensor: Optional[str] = None) -> list[TransposeEvent]:
        return [
            e
            for e in self.events
            if (kind is None or e.kind == kind) and (tensor is None or e.tensor == tensor)
        ]

    def kinds(self, tensor: Optional[str] = None) -> list[str]:
        """Event kinds in order (optionally of one tensor)."""
        return [e.kind for e in self.select(tensor=tensor)]

    def seqs(self, kind: str, tensor: Optional[str] = None) -> list[int]:
        """Sequence numbers of the events of ``kind`` (optionally of one tensor)."""
        return [e.seq for e in self.select(kind, tensor)]

    def count(self, kind: str, tensor: Optional[str] = None) -> int:
        return len(self.select(kind, tensor))

    def clear(self) -> None:
        self.events.clear()


class _DType:
    """TE's ``tex.DType`` member as it prints (``DType.kFloat8E4M3``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"DType.{self.name}"


_E4M3 = _DType("kFloat8E4M3")


class TeDType(enum.IntEnum):
    """TE 2.17+'s ``DType`` (``transformer_engine/pytorch/constants.py``): a Python ``IntEnum``, whose ``str()`` is its
    number on Python >= 3.11."""

    kBFloat16 = 5
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8


class _Fp8Double(torch.nn.Parameter):
    """Common state of the doubles (not itself FP8-like: it has no ``_reset_caches``)."""

    generation: str = ""

    @classmethod
    def create(
        cls,
        shape: Sequence[int] = (8, 4),
        *,
        fp8_name: str = "w",
        log: Optional[TransposeLog] = None,
        seed: int = 0,
        with_transpose: bool = True,
        rowwise: bool = True,
        realloc_on_refresh: bool = False,
        requires_grad: bool = True,
        data_dtype: torch.dtype = torch.uint8,
    ) -> _Fp8Double:
        shape = tuple(shape)
        self = cls.__new__(cls, torch.zeros(shape), requires_grad)
        self.fp8_name = fp8_name
        self.fp8_log = log if log is not None else TransposeLog()
        self.realloc_on_refresh = realloc_on_refresh
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        self._data = data.view(data_dtype) if data_dtype != torch.uint8 else data
        self._transpose = None
        self._transpose_invalid = True
        # TE's per-tensor scaling state and element format: the bytes are E4M3 values times ``1 / _scale_inv``
        self._scale_inv = torch.ones(1)
        self._fp8_dtype = TeDType.kFloat8E4M3 if self.generation == "te2" else _E4M3  # TE 2.20's shape for te2
        if with_transpose:
            buf = torch.empty(_t_shape(shape), dtype=torch.uint8)
            _fill_transpose(self._data, buf)
            self._transpose = buf
            self._transpose_invalid = False
        if not rowwise:  # column-wise-only storage: the transpose is the primary copy
            if self._transpose is None:
                raise ValueError("a column-wise-only double needs with_transpose=True")
            self._data = None
        return self

    def dequantize(self, *, dtype: torch.dtype = torch.float32) -> Tensor:
        """The value the bytes stand for: E4M3 times ``_scale_inv`` (TE's ``Float8Tensor.dequantize``)."""
        data = self._data.view(torch.uint8) if self._data.dtype != torch.uint8 else self._data
        return (data.view(torch.float8_e4m3fn).float() * self._scale_inv).to(dtype)

    # -- helpers shared by the generations --------------------------------------------------

    def _log(self, kind: str, ptr: Optional[int] = None) -> None:
        self.fp8_log.record(self.fp8_name, kind, ptr)

    def _alloc(self) -> Tensor:
        buf = torch.empty(_t_shape(tuple(self._data.shape)), dtype=torch.uint8)
        self._log("alloc", buf.data_ptr())
        return buf

    def _compute_into(self, out: Tensor) -> Tensor:
        _fill_transpose(self._data, out)
        self._log("compute", out.data_ptr())
        return out

    def _mark_invalid(self) -> None:
        self._log("reset", None if self._transpose is None else self._transpose.data_ptr())
        self._transpose_invalid = True


def _t_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[-1], *shape[:-1]) if shape else ()


def _fill_transpose(data: Tensor, out: Tensor) -> None:
    n = data.shape[-1]
    src = data.view(torch.uint8) if data.dtype != torch.uint8 else data
    out.copy_(src.reshape(-1, n).t().reshape(out.shape))


class TE16Float8Double(_Fp8Double):
    """TE 1.6-1.7 ``Float8Tensor``: ``transpose_2d(cache=...)``."""

    generation = "te1.6"

    def _reset_caches(self) -> None:
        self._mark_invalid()

    def transpose_2d(self, *, cache: bool = False, noop_flag: Optional[Tensor] = None) -> Tensor:
        assert self._data.dim() == 2, f"{self._data.dim()}-D transpose not supported."
        if not cache:
            out = torch.empty(_t_shape(tuple(self._data.shape)), dtype=torch.uint8)
            _fill_transpose(self._data, out)
            self._log("compute-uncached", out.data_ptr())
            return out
        if not self._transpose_invalid and noop_flag is None:
            assert self._transpose is not None, "Tranpose cache is empty."
            self._log("cache-hit", self._transpose.data_ptr())
            return self._transpose
        if self._transpose is None or self.realloc_on_refresh:
            self._transpose = self._alloc()
        self._compute_into(self._transpose)
        self._transpose_invalid = False
        return self._transpose


class TE18Float8Double(_Fp8Double):
    """TE 1.8-1.14 ``Float8Tensor``: ``transpose_2d(force_compute=..., fill_cache=...)``."""

    generation = "te1.8"

    def _reset_caches(self) -> None:
        self._mark_invalid()

    def transpose_2d(
        self,
        *,
        force_compute: bool = False,
        fill_cache: bool = False,
        noop_flag: Optional[Tensor] = None,
        cache: Optional[bool] = None,
    ) -> Tensor:
        if cache is not None:  # deprecated kwarg, mapped as TE does
            force_compute, fill_cache = (False, True) if cache else (True, False)
        need = force_compute or self._transpose is None or self._transpose_invalid or noop_flag is not None
        if not need:
            self._log("cache-hit", self._transpose.data_ptr())
            return self._transpose
        out = self._transpose
        if out is None or self.realloc_on_refresh:
            out = self._alloc()
        else:
            self._transpose_invalid = False
        self._compute_into(out)
        if fill_cache:
            self._transpose = out
            self._transpose_invalid = False
        return out


class TE2Float8Double(_Fp8Double):
    """TE 2.x ``Float8Tensor``: ``_create_transpose()`` and ``update_usage(...)`` (Hopper behaviour)."""

    generation = "te2"

    def _reset_caches(self) -> None:
        if self._data is None and self._transpose is not None:
            self._log("reset")
            self._transpose_invalid = False  # column-wise-only: the transpose is primary storage
            return
        self._mark_invalid()

    def _create_transpose(self) -> None:
        if self._data is None:
            return
        if self._transpose is None or self.realloc_on_refresh:
            self._transpose = self._alloc()
        self._compute_into(self._transpose)
        self._transpose_invalid = False

    def update_usage(
        self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None
    ) -> None:
        has_t = self._transpose is not None and not self._transpose_invalid
        need_t = has_t if columnwise_usage is None else columnwise_usage
        if need_t and not has_t:
            if self._data is None:
                raise RuntimeError("FP8 data is required to generate FP8 data transpose")
            self._create_transpose()
        if not need_t and self._transpose is not None:
            self._log("drop", self._transpose.data_ptr())
            self._transpose = None
            self._transpose_invalid = True


class TE15Float8Double(_Fp8Double):
    """TE <= 1.5 shape: a transpose cache but no in-place refresh API (must be refused)."""

    generation = "te1.5"

    def _reset_caches(self) -> None:
        self._mark_invalid()


DOUBLE_CLASSES: dict[str, type[_Fp8Double]] = {
    "te1.5": TE15Float8Double,
    "te1.6": TE16Float8Double,
    "te1.8": TE18Float8Double,
    "te2": TE2Float8Double,
}


def make_fp8_param(generation: str, shape: Sequence[int] = (8, 4), **kwargs: Any) -> _Fp8Double:
    """A double of ``generation`` (``"te1.6"``, ``"te1.8"``, ``"te2"``; ``"te1.5"`` for refusal tests).

    Keyword arguments: ``fp8_name``, ``log`` (a shared :class:`TransposeLog`), ``seed`` (FP8 bytes),
    ``with_transpose`` (start with a valid cached transpose), ``rowwise`` (``False``: TE 2.x
    column-wise-only storage), ``realloc_on_refresh`` (a hypothetical TE whose refresh allocates a
    new buffer), ``requires_grad``, ``data_dtype`` (``torch.uint8`` or a float8 dtype).
    """
    return DOUBLE_CLASSES[generation].create(shape, **kwargs)


def make_fp8_module(
    generations: Iterable[str] = GENERATIONS,
    shape: Sequence[int] = (8, 4),
    *,
    log: Optional[TransposeLog] = None,
) -> torch.nn.Module:
    """A module with one FP8 double per generation (``w0``, ``w1``, ...) plus a plain ``bias``."""
    log = log if log is not None else TransposeLog()
    m = torch.nn.Module()
    for i, gen in enumerate(generations):
        m.register_parameter(f"w{i}", make_fp8_param(gen, shape, fp8_name=f"w{i}", log=log, seed=i))
    m.bias = torch.nn.Parameter(torch.zeros(shape[0]))
    m.fp8_log = log
    return m


def expected_transpose(param: Any) -> Tensor:
    """The transpose of the double's current FP8 bytes (``[N, *M]``, uint8)."""
    out = torch.empty(_t_shape(tuple(param._data.shape)), dtype=torch.uint8)
    _fill_transpose(param._data, out)
    return out


def graph_read(param: Any) -> Tensor:
    """The transpose bytes a CUDA graph captured earlier would read: the buffer, whatever the flag."""
    return param._transpose.clone()


def eager_read(param: Any) -> Tensor:
    """What eager TE of the double's generation does when a backward GEMM needs the transpose."""
    if param.generation == "te2":
        param.update_usage(columnwise_usage=True)
        return param._transpose.clone()
    if param.generation == "te1.8":
        return param.transpose_2d(fill_cache=True).clone()
    return param.transpose_2d(cache=True).clone()


def transpose_is_current(param: Any) -> bool:
    """True when the cached buffer holds exactly the transpose of the current bytes."""
    return param._transpose is not None and torch.equal(param._transpose, expected_transpose(param))


def write_fp8_bytes(
    param: Any, seed: Optional[int] = None, *, reset: bool = True, values: Optional[Tensor] = None
) -> None:
    """Simulate an optimizer writing new FP8 bytes into ``_data`` in place (same storage).

    ``reset=True`` then calls ``_reset_caches()``, as TE's ``quantize_master_weights`` does;
    ``reset=False`` is a raw byte write (e.g. an all-gather into the parameter buffer).
    """
    data = param._data.view(torch.uint8) if param._data.dtype != torch.uint8 else param._data
    if values is None:
        g = torch.Generator().manual_seed(1000 + (seed if seed is not None else param.fp8_log.count("write")))
        values = torch.randint(0, 256, tuple(data.shape), generator=g, dtype=torch.uint8)
    data.copy_(values)
    param.fp8_log.record(param.fp8_name, "write")
    if reset:
        param._reset_caches()


def run_closure(closure: Any) -> Any:
    """What torch's optimizers do with ``step(closure)`` first: the closure with gradients on (``None``: none)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class WritingOptimizer(torch.optim.Optimizer):
    """A master-weight-style optimizer whose ``step()`` writes new FP8 bytes into the doubles.

    Plain parameters get an SGD update (so a loss can go down); each FP8 double gets new bytes
    in place (seeded by the step count), followed by ``_reset_caches()`` unless ``reset=False``.
    Hooks registered with ``register_step_post_hook`` run after all of that.
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 0.1, *, reset: bool = True) -> None:
        super().__init__(params, {"lr": lr})
        self.reset = reset
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = run_closure(closure)
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                if hasattr(p, "fp8_log"):
                    write_fp8_bytes(p, seed=self.steps * 7919 + sum(map(ord, p.fp8_name)), reset=self.reset)
                elif p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


# ---------------------------------------------------------------------------------------------------------------
# TE's quantized tensor classes, recipes and FusedAdam, by name and module (TE 2.20)
# ---------------------------------------------------------------------------------------------------------------

_TE_TENSOR = "transformer_engine.pytorch.tensor"
#: TE 2.20's module of each quantized tensor class a parameter can be
TE_TENSOR_MODULES = {
    "Float8Tensor": f"{_TE_TENSOR}.float8_tensor",
    "Float8BlockwiseQTensor": f"{_TE_TENSOR}.float8_blockwise_tensor",
    "MXFP8Tensor": f"{_TE_TENSOR}.mxfp8_tensor",
    "NVFP4Tensor": f"{_TE_TENSOR}.nvfp4_tensor",
}

# TE's common base (``transformer_engine/pytorch/quantized_tensor.py``). A Parameter subclass here so modules and
# optimizers take the stand-ins like parameters; TE's parameters are its tensor subclasses flagged as parameters.
_QuantizedTensor = type("QuantizedTensor", (torch.nn.Parameter,), {"__module__": "transformer_engine.pytorch.quantized_tensor"})
_TE_CLASSES: dict[str, type] = {
    name: type(name, (_QuantizedTensor,), {"__module__": module}) for name, module in TE_TENSOR_MODULES.items()
}


def te_named_param(cls_name: str, shape: Sequence[int] = (8, 4), *, requires_grad: bool = True,
                   seed: int = 0) -> torch.nn.Parameter:
    """A float32 parameter whose class is named and placed as TE's ``cls_name`` (a key of :data:`TE_TENSOR_MODULES`).

    It computes like a plain parameter; only its class says what TE tensor it stands for.
    """
    g = torch.Generator().manual_seed(seed)
    return _TE_CLASSES[cls_name](torch.randn(tuple(shape), generator=g) * 0.1, requires_grad)


_Recipe = type("Recipe", (), {"__module__": "transformer_engine.common.recipe"})


def te_recipe(cls_name: str) -> Any:
    """An instance of a class named and placed as TE's recipe ``cls_name`` (``"MXFP8BlockScaling"``, ...)."""
    return type(cls_name, (_Recipe,), {"__module__": "transformer_engine.common.recipe"})()


class TEFusedAdam(torch.optim.Optimizer):
    """TE 2.20's ``FusedAdam`` as the refusals see it: ``capturable`` and ``master_weights`` kept as attributes (not
    in ``defaults``); with ``capturable=True`` each group's ``lr`` is a tensor on its parameters' device and the step
    count a device tensor in the group. The update is plain SGD (the checks never look at it)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, *, capturable: bool = False,
                 master_weights: bool = False) -> None:
        lr_value: Any = torch.tensor(lr, dtype=torch.float32) if capturable else lr
        super().__init__(params, {"lr": lr_value, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                  "bias_correction": True})
        self.capturable = capturable
        self.master_weights = master_weights
        if capturable:
            for group in self.param_groups:
                if group["params"]:
                    group["lr"] = group["lr"].to(device=group["params"][0].device)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = run_closure(closure)
        for group in self.param_groups:
            if self.capturable:
                group["step"] = group.get("step", torch.zeros(1, dtype=torch.int)) + 1
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad * -group["lr"])
        return loss


TEFusedAdam.__name__ = TEFusedAdam.__qualname__ = "FusedAdam"
TEFusedAdam.__module__ = "transformer_engine.pytorch.optimizers.fused_adam"


def quantized_fp8_param(values: Tensor, *, generation: str = "te2", fp8_name: str = "w",
                        log: Optional[TransposeLog] = None) -> _Fp8Double:
    """A double whose bytes are ``values`` quantized as TE's per-tensor current scaling does (E4M3, ``scale = 448 /
    amax``), its transpose current: ``dequantize()`` gives ``values`` to FP8 precision."""
    p = make_fp8_param(generation, tuple(values.shape), fp8_name=fp8_name, log=log, with_transpose=True)
    scale = 448.0 / values.abs().amax().clamp_min(1e-12)
    q = (values.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    p._data.copy_(q.view(torch.uint8))
    p._scale_inv = scale.reciprocal().reshape(1)
    _fill_transpose(p._data, p._transpose)
    p._transpose_invalid = False
    return p

