"""Refresh the cached FP8 transposes of TransformerEngine ``Float8Tensor`` parameters.

Why: on Hopper the backward GEMMs of a TE module read each FP8 weight's cached transpose
(``_transpose``). An optimizer that writes new FP8 bytes in place (FP32 master weights written
back to the FP8 parameters, a distributed optimizer's parameter all-gather) leaves that cache
stale. Eager TE rebuilds it once ``_reset_caches()`` has flagged it; a CUDA graph captured while
the flag was clear contains no rebuild and reads the old transpose on every replay (measured on
an H200 with TE 2.20.2: input-gradient relative error 1.42 against eager).

What a refresh does, per FP8 parameter: ``_reset_caches()``, then recompute the transpose from
the current FP8 bytes **into the existing buffer** (same address, so graphs that read it see the
new values). Tensors without row-wise data (TE 2.x column-wise-only storage) and tensors without a
transpose buffer (nothing cached: e.g. Blackwell, where TE keeps none) are skipped.

How: per tensor with TE's own method (TE 1.6-1.7 ``transpose_2d(cache=True)``, 1.8-1.14
``transpose_2d(fill_cache=True, force_compute=True)``, 2.x ``_create_transpose()``); or, for TE 2.x
tensors on CUDA when Triton is available (``fused="auto"``), all of a plan's transposes in one
kernel launch (:mod:`._multi_transpose`: the same bytes, without one launch per weight), after
which the flags are set as ``_create_transpose()`` sets them.

Where it runs:

* :func:`install_fp8_refresh` is the one installer every entry point calls (the Lightning callbacks and
  strategy, the Megatron all-gather paths, the pipeline aligner). On a torch optimizer it registers an
  ``optimizer.register_step_post_hook``; for another event (megatron-core's parameter all-gather completion, a
  pipeline aligner's call after the parameter sync) it hands the refresh to an ``attach`` function of the caller. Eager
  steps run the refresh right after ``optimizer.step()``. When the optimizer step is captured
  into a CUDA graph, the hook runs once at capture and its transpose kernels become part of the
  graph right after the optimizer's kernels: every replay refreshes with no Python work.
* :func:`after_param_sync` is the hook point for optimizers that write FP8 bytes themselves
  after their parameter all-gather (Megatron-style distributed optimizers, NeMo's distributed
  Adam): call it when the all-gather has *finished*.

Not captured / not done here: amax and scale updates (TE does those), the parameter all-gather
itself, and any host synchronisation (there is none in the refresh).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor

from ..core.errors import CaptureError
from ..core.warn import warn_once
from . import _te_compat as te
from ._multi_transpose import MultiTranspose, triton_available

__all__ = [
    "Attach",
    "Fp8RefreshHandle",
    "Fp8RefreshPlan",
    "Fused",
    "ParamsOrModule",
    "after_param_sync",
    "fp8_refresh_wanted",
    "install_fp8_refresh",
    "iter_fp8_params",
    "named_fp8_params",
    "refresh_fp8_transposes",
]

ParamsOrModule = Union[torch.nn.Module, Tensor, Iterable[Union[Tensor, torch.nn.Module]]]
Fused = Union[bool, Literal["auto"]]




@functools.lru_cache(maxsize=1)
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _capturing() -> bool:
    """True while the current CUDA stream is capturing a graph."""
    return _cuda_available() and torch.cuda.is_current_stream_capturing()


# --------------------------------------------------------------------------------------------
# Finding FP8 parameters
# --------------------------------------------------------------------------------------------


def _named_tensors(params_or_module: ParamsOrModule) -> Iterator[tuple[str, Any]]:
    if isinstance(params_or_module, torch.nn.Module):
        yield from params_or_module.named_parameters()
    elif isinstance(params_or_module, Tensor):
        yield "tensor", params_or_module
    elif isinstance(params_or_module, Iterable) and not isinstance(params_or_module, (str, bytes)):
        for i, item in enumerate(params_or_module):
            if isinstance(item, torch.nn.Module):
                for name, p in item.named_parameters():
                    yield f"[{i}].{name}", p
            elif isinstance(item, Tensor):
                yield f"[{i}]", item
            else:
                raise TypeError(
                    f"params_or_module[{i}] is a {type(item).__name__}; pass a torch.nn.Module, a tensor, or an "
                    "iterable of tensors/modules (e.g. model.parameters() or a list of model chunks)."
                )
    else:
        raise TypeError(
            f"expected a torch.nn.Module, a tensor or an iterable of them, got {type(params_or_module).__name__}"
        )


def named_fp8_params(params_or_module: ParamsOrModule) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` of every FP8 parameter (duplicates removed, order kept).

    Raises:
        UnsupportedFp8ApiError: a tensor has a TE transpose cache but no refresh API we know
            (TransformerEngine < 1.6): silently skipping it would leave graphs stale.
    """
    out: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    for name, t in _named_tensors(params_or_module):
        if id(t) in seen:
            continue
        seen.add(id(t))
        if te.is_fp8_tensor(t):
            out.append((name, t))
        elif te.looks_like_fp8_tensor(t):
            raise te.unsupported_api_error(t, name)
    return out


def iter_fp8_params(params_or_module: ParamsOrModule) -> Iterator[Tensor]:
    """Every FP8 (``Float8Tensor``-like) parameter in ``params_or_module``, each once."""
    for _, t in named_fp8_params(params_or_module):
        yield t


def fp8_refresh_wanted(mode: Union[bool, str], params_or_module: ParamsOrModule) -> bool:
    """Resolve a ``fp8_refresh`` option (``True``/``False``/``"auto"``) for a model.

    ``"auto"``: refresh when the model has FP8 parameters. ``True``: they are required.

    Raises:
        ValueError: bad ``mode``, or ``mode=True`` and the model has no FP8 parameter.
    """
    _check_mode(mode, "")
    if mode is False:
        return False
    has = next(iter_fp8_params(params_or_module), None) is not None
    if mode is True and not has:
        raise ValueError(_no_fp8_message("fp8_refresh=True"))
    return has


def _check_mode(mode: Any, owner: str) -> None:
    if mode not in (True, False, "auto") or (isinstance(mode, int) and not isinstance(mode, bool)):
        where = f"{owner}: fp8_refresh={mode!r}" if owner else f"fp8_refresh={mode!r}"
        raise ValueError(f"{where} is invalid: use True, False or 'auto'.")


def _no_fp8_message(what: str) -> str:
    hint = (
        "transformer_engine is not installed (pip install 'nemo_cudagraph_plugin[te]')"
        if not te.te_installed()
        else "create the model under te.quantized_model_init(...) (te.fp8_model_init on TE < 2.8) so its weights are "
        "Float8Tensor parameters"
    )
    return f"{what}: no TransformerEngine Float8Tensor parameter found; {hint}, or turn the FP8 refresh off."


# --------------------------------------------------------------------------------------------
# The refresh
# --------------------------------------------------------------------------------------------


class Fp8RefreshPlan:
    """The FP8 parameters of a model and how to refresh each, collected once.

    Collecting once keeps the per-step eager work to one small loop (and it is zero per step
    under graph replay). Build a new plan if parameters are replaced (e.g. a new model).

    Args:
        params_or_module: a module, a tensor, or an iterable of tensors/modules.
        require_stable_address: if a refresh would leave the transpose at a new address, raise
            :class:`CaptureError` (a graph would keep reading the old buffer). ``None``: only
            while a CUDA graph is capturing; outside a capture warn once instead.
        fused: how TE 2.x transposes are recomputed. ``"auto"``: all of them in one kernel launch
            when Triton is available on CUDA, else TE's ``_create_transpose()`` per tensor.
            ``True``: always batched (one ``copy_`` per tensor where Triton is missing). ``False``:
            always TE's method per tensor. The bytes written are the same either way. The batched
            kernel is set up at the first refresh outside a graph capture (a refresh first run
            inside a capture uses TE's method); the plan keeps each set-up alive, since graphs that
            captured it read its metadata.
    """

    def __init__(
        self,
        params_or_module: ParamsOrModule,
        *,
        require_stable_address: Optional[bool] = None,
        fused: Fused = "auto",
    ) -> None:
        if fused not in (True, False, "auto"):
            raise ValueError(f"fused={fused!r} is invalid: use True, False or 'auto'.")
        self.require_stable_address = require_stable_address
        self._entries: list[tuple[str, Tensor, te.Generation]] = []
        for name, t in named_fp8_params(params_or_module):
            gen = te.api_generation(t)
            assert gen is not None  # named_fp8_params only returns known generations
            self._entries.append((name, t, gen))
        if self._entries:  # a model without FP8 parameters needs no TE at all
            version = te.check_te_version()
            for gen in {g for _, _, g in self._entries}:
                te.warn_if_generation_mismatch(gen, version)
        self._fused_mode = fused
        self.fused = fused is True or (fused == "auto" and triton_available())
        self._multi: dict[tuple, MultiTranspose] = {}
        self.last_skipped: dict[str, str] = {}
        self.last_fused = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def params(self) -> list[Tensor]:
        """The FP8 parameters this plan refreshes."""
        return [t for _, t, _ in self._entries]

    @property
    def names(self) -> list[str]:
        """Their names (``named_parameters`` names for a module)."""
        return [n for n, _, _ in self._entries]

    def refresh(self) -> int:
        """Refresh every planned transpose in place; capturable. Returns how many were refreshed.

        Captured (when the current stream is capturing): one transpose kernel per refreshed
        tensor, or one in all for the fused TE 2.x batch. Not captured: the Python checks and the
        ``_reset_caches()`` / valid-flag updates, which happen once at capture (the flag is then
        clear, which is correct: the graph refreshes).
        """
        capturing = _capturing()
        strict = capturing if self.require_stable_address is None else self.require_stable_address
        skipped: dict[str, str] = {}
        batch: list[tuple[Tensor, Tensor, Tensor]] = []
        n = 0
        with torch.no_grad():
            for name, t, gen in self._entries:
                checked = _checked_buffers(name, t, gen)
                if isinstance(checked, str):
                    skipped[name] = checked
                    continue
                data, buf = checked
                if (
                    self.fused
                    and gen == "te2"
                    and data.element_size() == 1
                    and data.is_contiguous()
                    and buf.is_contiguous()
                ):
                    batch.append((t, data, buf))
                    continue
                _recompute(name, t, gen, buf, strict=strict, capturing=capturing)
                n += 1
            self.last_fused = self._refresh_batch(batch, capturing) if batch else 0
            n += len(batch)
        self.last_skipped = skipped
        return n

    def _refresh_batch(self, batch: list[tuple[Tensor, Tensor, Tensor]], capturing: bool) -> int:
        """TE 2.x tensors in one launch. Returns how many went through the batched kernel."""
        key = tuple((d.data_ptr(), b.data_ptr(), d.numel() // d.shape[-1], d.shape[-1]) for _, d, b in batch)
        multi = self._multi.get(key)
        for t, _, _ in batch:
            te.reset_caches(t)
        if multi is None and not capturing:
            try:
                multi = MultiTranspose([(d, b) for _, d, b in batch])
                multi.run()  # the first launch compiles the kernel: outside any capture
            except Exception as exc:
                if self._fused_mode is True:
                    raise
                # "auto" must never stop training: TE's per-tensor method writes the same bytes.
                warn_once(
                    "fused-failed",
                    f"The one-launch FP8 transpose refresh failed to set up ({type(exc).__name__}: {exc}); "
                    "using TransformerEngine's per-tensor _create_transpose() instead (said once).",
                    RuntimeWarning,
                )
                self.fused = False
                multi = None
            else:
                self._multi[key] = multi
                for t, _, _ in batch:
                    te.mark_transpose_valid(t)
                return len(batch)
        if multi is None:  # first seen inside a capture (no host copy allowed there), or set-up failed
            for t, _, _ in batch:
                te.recompute_transpose(t, "te2")  # in place: the buffer exists (checked)
            return 0
        multi.run()
        for t, _, _ in batch:
            te.mark_transpose_valid(t)
        return len(batch)


def _checked_buffers(name: str, t: Any, gen: te.Generation) -> Union[str, tuple[Tensor, Tensor]]:
    """``(data, transpose buffer)`` of a tensor that can be refreshed, else why it is skipped."""
    data = te.rowwise_data(t)
    if data is None:
        # TE 2.x column-wise-only storage: the "transpose" *is* the data; nothing to derive it from.
        warn_once(
            "columnwise-only",
            f"FP8 parameter {name} has no row-wise data (TE column-wise-only storage), so its transpose cannot be "
            "recomputed and is left as is; such tensors are skipped by refresh_fp8_transposes (said once).",
            RuntimeWarning,
        )
        return "no row-wise data"
    buf = te.transpose_buffer(t)
    if buf is None:
        # Nothing cached (e.g. Blackwell, or dropped by TE): no stale copy can exist. Flag it for eager TE.
        te.reset_caches(t)
        return "no transpose cache"
    if gen != "te2" and data.dim() != 2:
        warn_once(
            f"not-2d-{gen}",
            f"FP8 parameter {name} has {data.dim()} dimensions; TransformerEngine 1.x transposes only 2-D FP8 "
            "tensors, so it is skipped (said once).",
            RuntimeWarning,
        )
        return "not 2-D (TE 1.x)"
    _check_buffer_fits(name, data, buf)
    return data, buf


def _recompute(name: str, t: Any, gen: te.Generation, buf: Tensor, *, strict: bool, capturing: bool) -> None:
    """``_reset_caches()`` and TE's own in-place recompute of one tensor."""
    ptr = buf.data_ptr()
    te.reset_caches(t)
    te.recompute_transpose(t, gen)
    new = te.transpose_buffer(t)
    if new is None or new.data_ptr() != ptr:
        _moved(name, strict=strict, capturing=capturing)


def _check_buffer_fits(name: str, data: Tensor, buf: Tensor) -> None:
    # The TE kernels write M*N bytes into ``out`` without checking its size: refuse a mismatch here.
    n_cols = data.shape[-1] if data.dim() else 1
    if (
        buf.numel() != data.numel()
        or buf.element_size() != data.element_size()
        or (buf.dim() and buf.shape[0] != n_cols)
    ):
        raise RuntimeError(
            f"FP8 parameter {name}: cached transpose has shape {tuple(buf.shape)} ({buf.dtype}) but the FP8 data has "
            f"shape {tuple(data.shape)} ({data.dtype}); recomputing into it would write out of bounds. Something "
            "replaced the parameter's data without dropping its transpose; call param._reset_caches() and let "
            "TransformerEngine rebuild it eagerly (outside any CUDA graph), or rebuild the model."
        )
    if buf.device != data.device:
        raise RuntimeError(
            f"FP8 parameter {name}: data is on {data.device} but its cached transpose is on {buf.device}; move the "
            "module with .to(device) before training."
        )


def _moved(name: str, *, strict: bool, capturing: bool) -> None:
    if strict:
        where = "during CUDA graph capture" if capturing else "while CUDA graphs may be reading it"
        raise CaptureError(
            f"FP8 parameter {name}: refreshing its transpose allocated a new buffer {where}; a graph captured earlier "
            "keeps reading the old one (silently stale). This TransformerEngine does not recompute the transpose in "
            "place. Pin transformer-engine to a tested version (1.6-2.x), or run this model without CUDA graphs.",
            rule="fp8-transpose-moved",
        )
    warn_once(
        "moved",
        f"FP8 parameter {name}: the transpose refresh allocated a new buffer (fine without CUDA graphs, but graphs "
        "would read a stale copy). Said once.",
        RuntimeWarning,
    )


def refresh_fp8_transposes(
    params_or_module: ParamsOrModule, *, require_stable_address: Optional[bool] = None, fused: Fused = "auto"
) -> int:
    """``_reset_caches()`` plus an in-place transpose recompute for every FP8 parameter.

    Call it after anything that wrote FP8 bytes in place (an optimizer step, a parameter
    all-gather, a checkpoint load into existing tensors). Works with or without CUDA graphs:
    inside a capture its kernels are recorded (and replayed with the graph); outside it runs
    eagerly. No host synchronisation.

    Args:
        params_or_module: a module, a tensor, or an iterable of tensors/modules (non-FP8
            tensors are ignored).
        require_stable_address: see :class:`Fp8RefreshPlan` (default: strict only while capturing).
        fused: see :class:`Fp8RefreshPlan`. Each call builds a new plan: for a refresh after every
            step (and inside graphs) keep one plan, or use :func:`install_fp8_refresh`.

    Returns:
        The number of transposes recomputed (0 when there is no FP8 parameter).

    Raises:
        CaptureError: the transpose would move to a new buffer while graphs depend on it.
        UnsupportedFp8ApiError: TransformerEngine < 1.6 Float8Tensor parameters.
    """
    return Fp8RefreshPlan(params_or_module, require_stable_address=require_stable_address, fused=fused).refresh()


def after_param_sync(
    params_or_module: ParamsOrModule, *, require_stable_address: bool = True, fused: Fused = "auto"
) -> int:
    """Hook point for optimizers that write FP8 parameter bytes themselves after their param sync.

    Megatron-style distributed optimizers and NeMo's distributed Adam update an FP32 master
    shard, write the FP8 bytes of that shard, then all-gather the FP8 parameter buffers. Call
    this once the all-gather has **finished** (with overlapped param gather: after the wait on
    the last bucket, before the first forward that uses the weights); the refresh reads the
    gathered bytes. Captured like :func:`refresh_fp8_transposes` when called inside a graph,
    eager otherwise. ``require_stable_address`` defaults to ``True`` because graphs captured
    earlier read these buffers.

    Megatron-core's ``finish_param_sync`` already calls TE's ``post_all_gather_processing``
    (the same in-place ``_create_transpose``); calling this as well is harmless.

    Returns:
        The number of transposes recomputed.
    """
    return refresh_fp8_transposes(params_or_module, require_stable_address=require_stable_address, fused=fused)


# --------------------------------------------------------------------------------------------
# Optimizer hook
# --------------------------------------------------------------------------------------------


#: ``attach(refresh) -> detach``: makes a framework's event call ``refresh()`` (which returns how many transposes
#: it refreshed) where new FP8 bytes land, and returns the function that undoes that.
Attach = Callable[[Callable[[], int]], Callable[[], None]]


class Fp8RefreshHandle:
    """A refresh installed by :func:`install_fp8_refresh`.

    Attributes:
        plan: the :class:`Fp8RefreshPlan` run after each step (or event).
        optimizer: the optimizer whose step it follows; ``None`` for an ``attach`` event.
        calls: host-side runs of the hook (a captured step replays without coming back here).
        last_refreshed: transposes refreshed by the last host-side run.
    """

    def __init__(self, where: Union[torch.optim.Optimizer, Attach], plan: Fp8RefreshPlan) -> None:
        self.plan = plan
        self.calls = 0
        self.last_refreshed = 0
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self._detach: Optional[Callable[[], None]]
        if callable(getattr(where, "register_step_post_hook", None)):
            self.optimizer = where  # type: ignore[assignment]
            self._detach = where.register_step_post_hook(self._hook).remove  # type: ignore[union-attr]
        else:
            self._detach = where(self.run)  # type: ignore[operator]

    def run(self) -> int:
        """Refresh now (what the hook runs); returns how many transposes were refreshed."""
        self.last_refreshed = self.plan.refresh()
        self.calls += 1
        return self.last_refreshed

    def _hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.run()

    @property
    def active(self) -> bool:
        """True until :meth:`remove`."""
        return self._detach is not None

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        if self._detach is not None:
            self._detach()
            self._detach = None

    def __enter__(self) -> Fp8RefreshHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        where = "event" if self.optimizer is None else type(self.optimizer).__name__
        return f"Fp8RefreshHandle(params={len(self.plan)}, optimizer={where}, calls={self.calls}, active={self.active})"


def install_fp8_refresh(
    optimizer: Union[torch.optim.Optimizer, Attach],
    params_or_module: ParamsOrModule,
    *,
    mode: Union[bool, Literal["auto"]] = True,
    owner: str = "install_fp8_refresh",
    require_stable_address: Optional[bool] = True,
    fused: Fused = "auto",
) -> Optional[Fp8RefreshHandle]:
    """Refresh the FP8 transposes of ``params_or_module`` after every ``optimizer.step()``.

    The one installer of the refresh: the Lightning callbacks and strategy and the Megatron all-gather paths all
    call it. ``optimizer`` may instead be an ``attach(refresh) -> detach`` function (:data:`Attach`) that makes
    another framework's event (megatron-core's parameter all-gather completion) call ``refresh()``.

    ``mode``: ``True`` (the default) requires FP8 parameters; ``"auto"`` installs nothing and returns ``None``
    when ``params_or_module`` holds none; ``False`` installs nothing. ``owner`` names the caller in the error.

    Uses torch's public ``optimizer.register_step_post_hook``, so the refresh follows whatever
    the step wrote (put the FP8 write-back inside the optimizer's ``step``, as distributed
    optimizers do). Eager steps: runs eagerly after the step. Captured steps: the transpose
    kernels are recorded right after the optimizer's kernels and every replay refreshes, with no
    Python work per replay. ``params_or_module`` is needed because a master-weight optimizer
    usually holds FP32 masters, not the FP8 parameters. ``fused``: see :class:`Fp8RefreshPlan`
    (with Triton on CUDA, TE 2.x transposes are refreshed in one kernel launch).

    Returns:
        A :class:`Fp8RefreshHandle`; call ``.remove()`` to uninstall. ``None``: nothing installed (``mode``).

    Raises:
        TypeError: ``optimizer`` has no ``register_step_post_hook`` (not a ``torch.optim.Optimizer``,
            e.g. Megatron's ``MegatronOptimizer``) and is no ``attach`` function: call :func:`after_param_sync`
            after its step instead.
        ValueError: ``mode=True`` and ``params_or_module`` holds no FP8 parameter; a bad ``mode``.
    """
    _check_mode(mode, owner)
    if mode is False:
        return None
    if not callable(getattr(optimizer, "register_step_post_hook", None)) and (
        isinstance(optimizer, torch.optim.Optimizer) or not _is_attach(optimizer)
    ):
        raise TypeError(
            f"{type(optimizer).__name__} is not a torch.optim.Optimizer (no register_step_post_hook), so the FP8 "
            "refresh cannot follow its step automatically. Call nemo_cudagraph_plugin.fp8.after_param_sync(model) "
            "right after its step / parameter all-gather instead."
        )
    plan = Fp8RefreshPlan(params_or_module, require_stable_address=require_stable_address, fused=fused)
    if len(plan) == 0:
        if mode == "auto":
            return None
        raise ValueError(_no_fp8_message(owner))
    return Fp8RefreshHandle(optimizer, plan)


def _is_attach(obj: Any) -> bool:
    """A plain function or method taking the refresh (an optimizer-like object with a ``step`` is not one)."""
    return callable(obj) and not hasattr(obj, "step") and not hasattr(obj, "param_groups")
