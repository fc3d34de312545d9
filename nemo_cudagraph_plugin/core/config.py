"""Options and counters shared by every entry point (callback, strategy, recipes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Union

__all__ = ["CaptureConfig", "CaptureStats"]

NanGuardMode = Union[bool, Literal["loss", "full"]]


@dataclass
class CaptureConfig:
    """What to capture and how careful to be.

    Args:
        enabled: ``False`` trains eagerly and changes nothing (one warning).
        warmup_steps: eager steps before the first capture. They create optimizer state and
            gradients outside the graph pool and let cuBLAS/cuDNN pick their kernels. At least 1.
            Each later input signature gets one eager step before its own capture.
        max_graphs: graphs kept at once (one per input signature and accumulation phase).
        on_cache_full: ``"eager"`` runs steps of new signatures eagerly once ``max_graphs`` graphs
            exist (counted in ``stats.eager_reasons``); ``"evict"`` drops the least recently used
            graph and captures the new one.
        on_capture_error: ``"raise"`` stops with a :class:`CaptureError` naming your file:line;
            ``"eager"`` warns once and trains eagerly from then on.
        nan_guard: ``True``/``"full"``: device-side finite check of the loss and of every
            parameter's gradient norm each step; ``"loss"``: the loss only (free); ``False``: off.
            Read on the host every ``nan_check_every`` steps and at epoch end.
        nan_check_every: steps between host reads of the NaN flag (each read is one sync).
        nan_action: ``"raise"`` stops with :class:`NonFiniteError` naming the parameter;
            ``"skip"`` skips the optimizer update on the device (fused Adam/AdamW/SGD ``found_inf``)
            and reports how many steps were skipped.
        verify_steps: the first N graphed steps are also run eagerly from the same state and
            compared (loss, gradient norm, parameters); a mismatch raises :class:`ParityError`.
        verify_rtol: relative tolerance of that comparison (0.0 = bitwise).
        sync_check: run the last warm-up step with ``torch.cuda.set_sync_debug_mode("error")`` so a
            host sync in the step is reported at your line before capture is attempted.
        fp8_refresh: ``"auto"`` refreshes FP8 weight transposes after every optimizer step when
            the model has TransformerEngine ``Float8Tensor`` parameters; ``True`` requires them;
            ``False`` never.
        align_pp_transposes: pipeline-parallel training with FP8 primary weights: refresh every FP8
            transpose of every model chunk on every rank right after the optimizer step (captured into
            the step graph), so no stage computes one inside its first microbatch. Implies
            ``fp8_refresh=True``. For Megatron-core loops use ``nemo_cudagraph_plugin.megatron``.
    """

    enabled: bool = True
    warmup_steps: int = 3
    max_graphs: int = 8
    on_cache_full: Literal["eager", "evict"] = "eager"
    on_capture_error: Literal["raise", "eager"] = "raise"
    nan_guard: NanGuardMode = True
    nan_check_every: int = 50
    nan_action: Literal["raise", "skip"] = "raise"
    verify_steps: int = 0
    verify_rtol: float = 0.0
    sync_check: bool = True
    fp8_refresh: Union[bool, Literal["auto"]] = "auto"
    align_pp_transposes: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, value: Any, want: str) -> ValueError:
            return ValueError(f"CaptureConfig.{name}={value!r} is invalid: {want}.")

        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 1:
            raise bad(
                "warmup_steps",
                self.warmup_steps,
                "use an int >= 1 (optimizer state and gradients must be created by an eager step)",
            )
        if not isinstance(self.max_graphs, int) or self.max_graphs < 1:
            raise bad("max_graphs", self.max_graphs, "use an int >= 1")
        if self.on_cache_full not in ("eager", "evict"):
            raise bad("on_cache_full", self.on_cache_full, "use 'eager' or 'evict'")
        if self.on_capture_error not in ("raise", "eager"):
            raise bad("on_capture_error", self.on_capture_error, "use 'raise' or 'eager'")
        if self.nan_guard not in (True, False, "loss", "full"):
            raise bad("nan_guard", self.nan_guard, "use True, False, 'loss' or 'full'")
        if not isinstance(self.nan_check_every, int) or self.nan_check_every < 1:
            raise bad("nan_check_every", self.nan_check_every, "use an int >= 1")
        if self.nan_action not in ("raise", "skip"):
            raise bad("nan_action", self.nan_action, "use 'raise' or 'skip'")
        if not isinstance(self.verify_steps, int) or self.verify_steps < 0:
            raise bad("verify_steps", self.verify_steps, "use an int >= 0")
        if not (self.verify_rtol >= 0.0):
            raise bad("verify_rtol", self.verify_rtol, "use a float >= 0")
        if self.fp8_refresh not in (True, False, "auto"):
            raise bad("fp8_refresh", self.fp8_refresh, "use True, False or 'auto'")
        if self.align_pp_transposes:
            if self.fp8_refresh is False:
                raise bad("fp8_refresh", False, "align_pp_transposes=True needs the FP8 refresh; drop fp8_refresh=False")
            self.fp8_refresh = True

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> CaptureConfig:
        """Build from a mapping that may hold other names too (e.g. an ``__init__``'s ``locals()``)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in names})

    @property
    def nan_mode(self) -> str:
        """``"off"``, ``"loss"`` or ``"full"``."""
        if self.nan_guard is False:
            return "off"
        return "full" if self.nan_guard in (True, "full") else "loss"


@dataclass
class CaptureStats:
    """Counters of what the engine did; read them after ``fit`` (``callback.stats``)."""

    warmup_steps: int = 0
    captures: int = 0
    replays: int = 0
    eager_steps: int = 0
    eager_reasons: dict[str, int] = field(default_factory=dict)
    capture_time_s: float = 0.0
    graphs: int = 0
    recaptures: int = 0
    verified_steps: int = 0
    skipped_steps: int = 0

    def count_eager(self, reason: str) -> None:
        self.eager_steps += 1
        self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.eager_reasons.items())) or "none"
        return (
            f"{self.replays} graphed steps, {self.warmup_steps} warm-up steps, {self.eager_steps} other eager steps"
            f" ({reasons}); {self.captures} captures ({self.recaptures} re-captures) in {self.capture_time_s:.3f} s;"
            f" {self.graphs} graphs live"
        )
