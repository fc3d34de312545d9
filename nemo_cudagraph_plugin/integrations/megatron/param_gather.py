"""FP8 transposes refreshed on the parameter all-gather completion path, only where megatron-core does not.

megatron-core >= 0.16 with a TransformerEngine that has ``post_all_gather_processing`` rebuilds the transposes
itself when each bucket's all-gather completes; :func:`install_param_gather_refresh` fills only the gaps (the
forced sync of NeMo's checkpoint save, older megatron-core). No forced sync, so an overlapped all-gather stays
overlapped. Inside a whole-iteration graph megatron-core's own all-gather and rebuild are captured with the step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Optional

from torch import Tensor

from ...fp8 import install_fp8_refresh
from ...fp8.pipeline import ModelChunks
from . import capabilities as _capabilities
from .capabilities import MegatronCapabilities
from .param_sync import _as_chunk_list

__all__ = ["ParamGatherRefresh", "find_megatron_ddp", "install_param_gather_refresh"]


def find_megatron_ddp(chunk: Any) -> Optional[Any]:
    """The Megatron-core ``DistributedDataParallel`` in ``chunk`` (the chunk itself, or its ``.module`` up to
    three levels down, as in NeMo's ``MegatronParallel``); ``None`` if there is none."""
    obj = chunk
    for _ in range(4):
        if obj is None:
            return None
        if hasattr(obj, "bucket_groups") and hasattr(obj, "ddp_config") and callable(
            getattr(obj, "start_param_sync", None)
        ):
            return obj
        obj = getattr(obj, "module", None)
    return None


def _bucket_params(group: Any) -> list[Tensor]:
    out: list[Tensor] = []
    seen: set[int] = set()
    for bucket in getattr(group, "buckets", ()):
        params = getattr(bucket, "params_list", None) or list(getattr(bucket, "params", ()))
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class ParamGatherRefresh:
    """Refresh FP8 transposes when a Megatron parameter all-gather completes, where megatron-core does not.

    Built by :func:`install_param_gather_refresh`. Per Megatron DDP chunk it wraps (instance attributes, undone
    by :meth:`remove`):

    * each bucket group's ``finish_param_sync`` (the forward pre-hook's wait on an overlapped all-gather):
      refreshes that group's FP8 parameters after the wait, **only** when megatron-core does not rebuild there
      itself (``MegatronCapabilities.megatron_rebuilds("overlapped")`` false: older megatron-core, or a
      TransformerEngine without ``post_all_gather_processing``);
    * the chunk's ``start_param_sync``: after a *forced* sync of an overlapping chunk (NeMo's
      ``save_checkpoint`` -> ``force_param_sync()``, ``disable_forward_pre_hook()``, ...) it refreshes the
      chunk's FP8 parameters, which megatron-core 0.16.1 does not; after a synchronous all-gather
      (``overlap_param_gather=False``) only when megatron-core does not.

    Nothing is forced: an overlapped all-gather stays overlapped, and the refresh runs where the bytes land.
    Inside a whole-iteration graph the finish-path refresh is captured with the step (it replays every step);
    the forced path runs eagerly between steps.

    Attributes: ``refreshed`` (Counter path -> parameters refreshed by host-side calls), ``calls`` (Counter
    path -> calls that refreshed), ``paths`` (the paths hooked), ``plans`` (how many bucket groups hold FP8
    parameters).
    """

    def __init__(
        self,
        model_chunks: ModelChunks,
        *,
        capabilities: Optional[MegatronCapabilities] = None,
        fused: Any = "auto",
    ) -> None:
        chunks = _as_chunk_list(model_chunks)
        ddps = [find_megatron_ddp(c) for c in chunks]
        missing = [i for i, d in enumerate(ddps) if d is None]
        if missing:
            raise TypeError(
                f"model chunk(s) {missing} are not Megatron-core DistributedDataParallel modules (no bucket_groups / "
                "start_param_sync): the all-gather completion path exists only there. Pass Megatron's list of "
                "DDP-wrapped chunks (NeMo: trainer.strategy.model)."
            )
        caps = capabilities if capabilities is not None else _capabilities.megatron_capabilities()
        self.capabilities = caps
        rebuilds = (lambda path: caps.megatron_rebuilds(path)) if caps is not None else (lambda path: False)
        self.paths: set[str] = set()
        if not rebuilds("overlapped"):
            self.paths.add("overlapped")
        if not rebuilds("sync"):
            self.paths.add("sync")
        if not rebuilds("forced"):
            self.paths.add("forced")
        self.refreshed: Counter = Counter()
        self.calls: Counter = Counter()
        self.plans = 0
        self._handles: list[Any] = []  # Fp8RefreshHandle per hooked path, from the one installer
        for ddp in ddps:
            self._install(ddp, fused)

    def _install(self, ddp: Any, fused: Any) -> None:
        def install(attach: Callable[..., Any], params: list) -> Any:
            # mode="auto": no FP8 parameter here, nothing can go stale, nothing is wrapped
            handle = install_fp8_refresh(attach, params, mode="auto", require_stable_address=None, fused=fused)
            if handle is not None:
                self._handles.append(handle)
            return handle

        groups = list(getattr(ddp, "bucket_groups", ())) + list(getattr(ddp, "expert_parallel_bucket_groups", ()))
        cfg = ddp.ddp_config
        overlap = bool(getattr(cfg, "overlap_param_gather", False))
        if overlap and "overlapped" in self.paths:
            for group in groups:
                if install(self._on_finish(group), _bucket_params(group)) is not None:
                    self.plans += 1
        if (overlap and "forced" in self.paths) or (not overlap and "sync" in self.paths):
            install(self._on_start(ddp, overlap), [p for g in groups for p in _bucket_params(g)])

    @staticmethod
    def _wrap(obj: Any, name: str, wrapper: Callable[..., Any]) -> Callable[[], None]:
        wrapper.__nemo_cudagraph_wrapped__ = getattr(obj, name)  # type: ignore[attr-defined]
        setattr(obj, name, wrapper)

        def undo() -> None:
            if obj.__dict__.get(name) is wrapper:
                delattr(obj, name)

        return undo

    def _count(self, n: int, path: str) -> int:
        if n:
            self.refreshed[path] += n
            self.calls[path] += 1
        return n

    def _on_finish(self, group: Any) -> Callable[[Callable[[], int]], Callable[[], None]]:
        def attach(refresh: Callable[[], int]) -> Callable[[], None]:
            original = group.finish_param_sync

            def finish_param_sync(*args: Any, **kwargs: Any) -> Any:
                # Completes an all-gather if one is in flight, or dispatches-and-waits if none was dispatched yet.
                completing = getattr(group, "param_gather_handle", None) is not None or not getattr(
                    group, "param_gather_dispatched", True
                )
                out = original(*args, **kwargs)
                if completing:
                    self._count(refresh(), "overlapped")
                return out

            return self._wrap(group, "finish_param_sync", finish_param_sync)

        return attach

    def _on_start(self, ddp: Any, overlap: bool) -> Callable[[Callable[[], int]], Callable[[], None]]:
        def attach(refresh: Callable[[], int]) -> Callable[[], None]:
            original = ddp.start_param_sync

            def start_param_sync(*args: Any, force_sync: bool = False, **kwargs: Any) -> Any:
                out = original(*args, force_sync=force_sync, **kwargs)
                if overlap and force_sync:
                    self._count(refresh(), "forced")  # megatron-core waited or gathered, and rebuilt nothing
                elif not overlap and not getattr(ddp, "overlap_param_gather_with_optimizer_step", False):
                    self._count(refresh(), "sync")
                return out

            return self._wrap(ddp, "start_param_sync", start_param_sync)

        return attach

    def remove(self) -> None:
        """Undo every wrapper (idempotent)."""
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def summary(self) -> str:
        if self.capabilities is None:
            basis = "megatron-core not importable: every completion path is hooked"
        else:
            basis = (f"megatron-core {self.capabilities.version} rebuilds after overlapped/sync/forced all-gathers: "
                     f"{self.capabilities.megatron_rebuilds('overlapped')}/{self.capabilities.megatron_rebuilds('sync')}"
                     f"/{self.capabilities.megatron_rebuilds('forced')}")
        return f"ParamGatherRefresh: hooked {sorted(self.paths)} ({basis}); refreshed {dict(self.refreshed)}"


def install_param_gather_refresh(
    model_chunks: ModelChunks,
    *,
    capabilities: Optional[MegatronCapabilities] = None,
    fused: Any = "auto",
) -> ParamGatherRefresh:
    """Refresh FP8 transposes on megatron-core's all-gather completion path, only where it does not itself.

    Use it instead of forcing the all-gather after the optimizer step (:func:`make_param_sync_hook`): with
    ``overlap_param_gather=True`` the all-gather keeps overlapping the first forward. See
    :class:`ParamGatherRefresh` for the paths. Returns the handle; ``.remove()`` uninstalls. Chunks without
    FP8 parameters get no wrapper.

    Raises:
        TypeError: a chunk is not a Megatron-core ``DistributedDataParallel`` (or a wrapper of one).
    """
    return ParamGatherRefresh(model_chunks, capabilities=capabilities, fused=fused)
