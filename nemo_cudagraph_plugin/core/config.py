"""Options and counters shared by every entry point (callback, strategy, recipes).

:class:`CaptureConfig` is the one definition of the options: their names, types, defaults and
checks. ``CudaGraphCallback`` and ``CudaGraphStrategy`` take the same keywords; their typed
signatures are generated from this dataclass (:func:`with_capture_options`), and their errors name
the class and argument the user typed (``CudaGraphCallback(warmup_steps=0) is invalid: ...``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Literal, Optional, TypeVar, Union, get_type_hints

__all__ = ["CaptureConfig", "CaptureStats", "PartialStats", "with_capture_options"]

NanGuardMode = Union[bool, Literal["loss", "full"]]


@dataclass
class CaptureConfig:
    """What to capture and how careful to be.

    Args:
        enabled: ``False`` trains eagerly and changes nothing (one warning).
        warmup_steps: eager steps before the first capture. They create optimizer state and
            gradients outside the graph pool and let cuBLAS/cuDNN pick their kernels. At least 1.
            Each later input signature gets one eager step before its own capture.
        max_graphs: graphs kept at once (one per input signature and step key: accumulation
            phase, ``accumulate_grad_batches``, clipping, precision).
        on_cache_full: ``"eager"`` runs steps of new signatures eagerly once ``max_graphs`` graphs
            exist (counted in ``stats.eager_reasons``); ``"evict"`` drops the least recently used
            graph and captures the new one.
        on_capture_error: ``"raise"`` stops with a :class:`CaptureError` naming your file:line;
            ``"eager"`` warns once and trains eagerly from then on.
        nan_guard: ``True``/``"full"``: device-side NaN/Inf detection that names the parameter. Without
            clipping (one process, ``nan_action="raise"``) it watches the loss and reads the parameters at
            the first non-finite loss only (one small kernel per step); with Lightning's clipping by norm it
            reads the per-parameter norms clipping computes; otherwise it reads every gradient (before
            clipping) each step. ``"loss"``: the loss only (free); ``False``: off. Read every
            ``nan_check_every`` steps (queued, no host sync) and at epoch end.
        nan_check_every: steps between reads of the NaN flags. Each read is queued (a pinned copy and an
            event) and reported by the first later step that finds it written, usually one or two steps
            later; the reads at epoch and fit end wait (one sync each).
        nan_action: ``"raise"`` stops with :class:`NonFiniteError` naming the parameter;
            ``"skip"`` skips the optimizer update on the device (fused Adam/AdamW/SGD ``found_inf``)
            and reports how many steps were skipped; it needs the NaN guard (not ``nan_guard=False``).
        verify_steps: the first N graphed steps are also run eagerly from the same state and
            compared (loss, gradient norm, parameters); a mismatch raises :class:`ParityError`.
            Verification leaves training as an unverified run would (every state the step
            writes is restored before the graph's step runs). Partial graphs (``scope``): the
            first N steps of that tier whose graphs all replay, run eagerly with its graphs set aside.
        verify_rtol: relative tolerance of that comparison (0.0 = bitwise).
        sync_check: run the last warm-up step with ``torch.cuda.set_sync_debug_mode("error")`` so a
            host sync in the step is reported at your line before capture is attempted.
        fp8_refresh: ``"auto"`` refreshes FP8 weight transposes after every optimizer step when
            the model has TransformerEngine ``Float8Tensor`` parameters; ``True`` requires them;
            ``False`` never.
        align_pp_transposes: pipeline-parallel training with FP8 primary weights: refresh every FP8
            transpose of every model chunk on every rank right after the optimizer step (captured into
            the step graph), so no stage computes one inside its first microbatch. Implies
            ``fp8_refresh=True``. For Megatron-core loops use ``nemo_cudagraph_plugin.integrations.megatron``.
        memsets_as_kernels: each captured graph's memset nodes (torch's split reductions and cuDNN's attention
            zero their buffers with ``cudaMemsetAsync``) become fill kernels that write the same bytes. In a
            replay the GPU idles 3-4.5 µs after a memset before the next kernel starts, against ~0.5 µs between
            kernels (H200): 129 µs per step of a 12-layer GPT. Needs a CUDA driver >= 12.3 and torch >= 2.8
            (``CUDAGraph(keep_graph=True)``); elsewhere graphs keep their memsets. ``False``: keep them.
        io_in_graph: each captured graph copies the batch into its input buffers and its outputs into this step's
            fresh memory itself, with copy kernel nodes before its first and after its last node whose addresses are
            set before each replay, instead of a launch of its own before and after the replay: 9 µs less device time
            per step on an H200 (the GPU idles between launches) and one torch operation less on the host each. For
            contiguous batch tensors and outputs on the GPU; same requirements as ``memsets_as_kernels``; elsewhere
            the copies are launches around the replay. ``False``: always launches.
        hf_attention: ``"graph_safe"``: Hugging Face models in the module whose attention is ``"sdpa"`` are switched,
            before the first step, to the same SDPA attention with a mask builder that does not read the
            ``attention_mask`` on the host (HF asks the host whether a batch pads anything, which no graph can
            capture): padded batches then train as graphs, exactly as with ``"sdpa"``
            (:mod:`nemo_cudagraph_plugin.hf`). Applied only when the step is graphed. ``"as_is"``: leave them.
        hf_experts: ``"graph_safe"``: Hugging Face mixture-of-experts models (transformers 5: Mixtral, Qwen2-MoE,
            Qwen3-MoE, DeepSeek-V3, ...) whose experts run HF's ``"eager"``, ``"grouped_mm"`` or ``"batched_mm"``
            implementation are switched, before the first step, to HF's grouped-GEMM experts on weights cast to the
            autocast dtype (as autocast runs an ``nn.Linear``), whose offsets stay on the device: every token routed,
            no capacity. Where no grouped GEMM captures (``32-true``) HF's batched-GEMM experts run. Applied only
            when the step is graphed, given back after ``fit`` (:mod:`nemo_cudagraph_plugin.hf`). ``"as_is"``: leave
            them (the FP32 grouped GEMM of ``bf16-mixed`` and the ``"eager"`` experts read the host and are refused).
        fast_adam: a captured capturable ``torch.optim.Adam``/``AdamW`` step computes its bias corrections once per
            param group instead of once per parameter, and divides by them with one multi-tensor kernel each instead
            of one kernel per parameter (torch's capturable update falls back to those, about 1.2 ms of an 8 ms
            compiled HF Llama 156 M step on an H200); where Triton runs, the update's last five operations are one
            kernel that reads the parameters and moments once (eight passes over them fewer, no parameter-sized
            temporary). The same operations on the same numbers, rounded as torch rounds them: the same bits. For
            float32 parameters on one GPU, multi-tensor (not fused) groups without amsgrad/maximize, torch 2.11 -
            2.13 (:mod:`nemo_cudagraph_plugin.core.adam_step`); elsewhere an Adam/AdamW's own step is captured and
            the end-of-fit summary says why (other optimizers are not concerned). Eager steps always run torch's
            step. ``False``: torch's own capturable update is captured. Not used where ``optimizer_math="eager"``
            captures the user's own update.
        optimizer_math: ``"eager"``: a ``torch.optim.Adam``/``AdamW`` (multi-tensor or for-loop, ``amsgrad``,
            ``maximize``, weight decay, float ``lr``, or a tensor ``lr`` with the for-loop update torch runs for it;
            float32 or BFloat16 parameters; Triton on CUDA) or
            ``torch.optim.SGD`` (multi-tensor or for-loop, momentum, dampening, Nesterov, weight decay, ``maximize``,
            float ``lr``; float32 or BFloat16 parameters; Triton on CUDA) keeps its own settings and its own
            non-capturable update is captured, with the scalars its Python computes on the host (Adam's bias
            corrections, step size and decay factor; the ``lr`` of both) read from the device as the same float64
            numbers and rounded where torch's kernels round them (:mod:`nemo_cudagraph_plugin.core.user_adam`,
            :mod:`nemo_cudagraph_plugin.core.user_sgd`); a fused Adam/AdamW keeps torch's own fused update, its float
            ``lr`` set in the graph's kernel arguments before each replay
            (:mod:`nemo_cudagraph_plugin.core.user_fused_adam`). Other optimizers and settings (fused SGD, fused and
            non-fused groups mixed, tensor betas, a tensor ``lr`` of SGD, ``nan_action="skip"`` with a non-fused
            optimizer) get the capturable preparation; ``stats.optimizer_math`` says why and, after a verified step,
            ``stats.optimizer_math_gap`` by how much.
            ``"capturable"``: always the capturable preparation (``capturable=True``, ``lr`` a float32 device tensor,
            bias corrections computed on the device in float32): bitwise equal to eager training with that
            preparation, about 1e-4 relative from your own run.
        scope: what is graphed. ``"step"``: the whole step, or (a step that cannot be captured whole)
            ``on_capture_error``'s refusal or eager training. ``"modules"``: partial graphs always: the forward and
            backward of the largest submodules that capture are graphs (static inputs and outputs, an
            ``autograd.Function`` replaying them), found by the plugin on any ``nn.Module``; the code between them
            (the islands, each with the capture error that made it one), the loss outside modules and the optimizer
            side of the step (zero-grad, clipping, the optimizer step) run eagerly, as you wrote them
            (:mod:`nemo_cudagraph_plugin.core.partial`); ``stats.partial`` reports what was graphed. ``"auto"``: the
            whole step where it captures, else partial graphs from the step whose capture failed on (the default; one
            warning names the line that kept the step from one graph).
            Under DDP (``CudaGraphStrategy("ddp")``) and for models with TransformerEngine modules ``"modules"`` is
            refused and ``"auto"`` is ``"step"`` (not proven there: TE's hazard checks cover whole steps).
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
    memsets_as_kernels: bool = True
    io_in_graph: bool = True
    hf_attention: Literal["graph_safe", "as_is"] = "graph_safe"
    hf_experts: Literal["graph_safe", "as_is"] = "graph_safe"
    fast_adam: bool = True
    optimizer_math: Literal["eager", "capturable"] = "eager"
    scope: Literal["step", "modules", "auto"] = "auto"

    def __post_init__(self) -> None:
        _check(self, "CaptureConfig")

    @classmethod
    def build(cls, config: Optional[CaptureConfig], options: Mapping[str, Any], owner: str) -> CaptureConfig:
        """The config an entry point was given: ``config`` (copied) with ``options`` applied.

        Errors name ``owner`` (the class the user called) and the argument they typed.
        """
        names = option_names()
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(
                f"{owner}() got an unexpected option {unknown[0]!r}; the options are: {', '.join(names)}."
            )
        if config is not None and not isinstance(config, CaptureConfig):
            raise TypeError(f"{owner}(config=...) must be a CaptureConfig, got {type(config).__name__}.")
        base = asdict(config) if config is not None else {}
        merged = cls.__new__(cls)
        for f in fields(cls):
            value = options.get(f.name, base.get(f.name, f.default))
            setattr(merged, f.name, value)
        _check(merged, owner, typed=set(options))
        return merged

    @property
    def nan_mode(self) -> str:
        """The NaN guard: ``"off"``, ``"loss"`` or ``"full"`` (the one reading of ``nan_guard``)."""
        if self.nan_guard is False:
            return "off"
        return "full" if self.nan_guard in (True, "full") else "loss"

    @property
    def nan_skips(self) -> bool:
        """Non-finite updates are skipped on the device (``nan_action="skip"``) instead of raising."""
        return self.nan_action == "skip"


def option_names() -> list[str]:
    """The option names, in declaration order."""
    return [f.name for f in fields(CaptureConfig)]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# name -> (is the value valid?, what to use instead). The one definition of each option's check.
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "enabled": (lambda v: isinstance(v, bool), "use True or False"),
    "warmup_steps": (
        lambda v: _is_int(v) and v >= 1,
        "use an int >= 1 (optimizer state and gradients must be created by an eager step)",
    ),
    "max_graphs": (lambda v: _is_int(v) and v >= 1, "use an int >= 1"),
    "on_cache_full": (lambda v: v in ("eager", "evict"), "use 'eager' or 'evict'"),
    "on_capture_error": (lambda v: v in ("raise", "eager"), "use 'raise' or 'eager'"),
    "nan_guard": (lambda v: v in (True, False, "loss", "full") and not _is_int(v), "use True, False, 'loss' or 'full'"),
    "nan_check_every": (lambda v: _is_int(v) and v >= 1, "use an int >= 1"),
    "nan_action": (lambda v: v in ("raise", "skip"), "use 'raise' or 'skip'"),
    "verify_steps": (lambda v: _is_int(v) and v >= 0, "use an int >= 0"),
    "verify_rtol": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0.0, "use a float >= 0"),
    "sync_check": (lambda v: isinstance(v, bool), "use True or False"),
    "fp8_refresh": (lambda v: v in (True, False, "auto") and not _is_int(v), "use True, False or 'auto'"),
    "align_pp_transposes": (lambda v: isinstance(v, bool), "use True or False"),
    "memsets_as_kernels": (lambda v: isinstance(v, bool), "use True or False"),
    "io_in_graph": (lambda v: isinstance(v, bool), "use True or False"),
    "hf_attention": (lambda v: v in ("graph_safe", "as_is"), "use 'graph_safe' or 'as_is'"),
    "hf_experts": (lambda v: v in ("graph_safe", "as_is"), "use 'graph_safe' or 'as_is'"),
    "fast_adam": (lambda v: isinstance(v, bool), "use True or False"),
    "optimizer_math": (lambda v: v in ("eager", "capturable"), "use 'eager' or 'capturable'"),
    "scope": (
        lambda v: v in ("step", "modules", "auto"),
        "use 'step' (the whole step or nothing), 'modules' (graphs of the submodules that capture) or 'auto' "
        "(the whole step where it captures, else 'modules')",
    ),
}


def _check(cfg: CaptureConfig, owner: str, typed: Optional[set[str]] = None) -> None:
    """Validate every option; the error shows the call as the user wrote it."""

    def bad(name: str, want: str) -> ValueError:
        return ValueError(f"{owner}({name}={getattr(cfg, name)!r}) is invalid: {want}.")

    for name in option_names():
        ok, want = _RULES[name]
        if not ok(getattr(cfg, name)):
            raise bad(name, want)
    if cfg.align_pp_transposes:
        if cfg.fp8_refresh is False:
            raise bad("fp8_refresh", "align_pp_transposes=True needs the FP8 refresh; drop fp8_refresh=False")
        cfg.fp8_refresh = True
    if cfg.nan_action == "skip" and cfg.scope == "modules":
        # The partial tier's optimizer graph does not read the guard's verdict (found_inf): nothing would be skipped.
        raise bad("nan_action", "scope='modules' graphs the optimizer step without the NaN guard's verdict, so no "
                  "update would be skipped; use nan_action='raise'")
    if cfg.nan_action == "skip" and cfg.nan_guard is False:
        # The guard's gradient check is what finds the updates to skip.
        raise bad("nan_guard", "nan_action='skip' needs the NaN guard to find the bad updates; drop nan_guard=False")


F = TypeVar("F", bound=Callable[..., Any])


def with_capture_options(init: F) -> F:
    """Give ``init(self, <leading params>, config=None, **options)`` the typed keyword signature of
    every :class:`CaptureConfig` option (for IDEs' runtime help, ``inspect.signature``, nemo_run /
    fiddle configs and YAML), generated from the dataclass so the options are written once.
    """
    sig = inspect.signature(init)
    lead = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    hints = get_type_hints(CaptureConfig)
    opts = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in fields(CaptureConfig)
        if f.default is not MISSING
    ]
    init.__signature__ = sig.replace(parameters=[*lead, *opts])  # type: ignore[attr-defined]
    init.__annotations__ = {**{k: v for k, v in init.__annotations__.items() if k != "options"},
                            **{p.name: p.annotation for p in opts}}
    return init


@dataclass
class PartialStats:
    """What the partial tier graphed (``scope="modules"``, or ``"auto"`` where the whole step did not capture)."""

    #: the submodules whose forward and backward are graphs (dotted names, ``""`` for the root)
    graphed: list[str] = field(default_factory=list)
    #: the eager islands: module name -> why it is not a graph (the capture error, with the file:line that caused it)
    islands: dict[str, str] = field(default_factory=dict)
    #: modules the step calls, and how many of them run inside a graph (a graphed module and everything it contains)
    modules_called: int = 0
    modules_graphed: int = 0
    #: operators the dispatcher saw in one eager step, and in one step with every graph replayed (outside graphs)
    ops_step: int = 0
    ops_outside: Optional[int] = None
    #: per island, the host time of its own code (its submodules' calls left out) in that step, milliseconds
    island_host_ms: dict[str, float] = field(default_factory=dict)
    #: forward+backward graph pairs captured, and replayed (per module call)
    captures: int = 0
    replays: int = 0
    #: module calls run eagerly though their module is graphed: the reason -> count
    eager_calls: dict[str, int] = field(default_factory=dict)
    #: what happens to the optimizer side of the step: "graphed: ..." or "eager: <why>"
    optimizer: str = "eager: zero-grad, clipping, the NaN guard and the optimizer step run eagerly every step"
    #: the optimizer side's graphs: captured, replayed (one per step), captured again (a gradient replaced)
    optimizer_captures: int = 0
    optimizer_replays: int = 0
    optimizer_recaptures: int = 0
    #: steps whose update ran eagerly because a parameter got no gradient in them (a module not called): eager
    #: ``zero_grad(set_to_none=True)`` leaves it ``None`` and the optimizer skips it; a graph would step it
    optimizer_eager_untouched: int = 0
    #: parameters whose gradient a graph adds into ``.grad`` (autograd launches nothing for them), and the parameters
    #: of graphed modules whose gradient autograd accumulates for good: name -> why (tied, a hook on it, a gradient
    #: from outside its module too)
    grads_in_graphs: int = 0
    grads_outside: dict[str, str] = field(default_factory=dict)
    #: ``torch.compile``d modules whose compiled code is not one graph (a host read inside it), split open: their
    #: own code runs uncompiled and each submodule is compiled alone with the same settings (graphed where it captures)
    compiled_apart: list[str] = field(default_factory=list)

    @property
    def op_coverage(self) -> Optional[float]:
        """Share of the step's operators (kernel launches as the dispatcher sees them) run inside graphs; ``None``
        until measured."""
        if not self.ops_step or self.ops_outside is None or not self.graphed:
            return None
        return max(0.0, 1.0 - self.ops_outside / self.ops_step)

    def summary(self) -> str:
        cov = self.op_coverage
        host = self.island_host_ms

        def island(n: str, why: str) -> str:
            took = f" ({host[n]:.2f} ms/step on the host)" if n in host else ""
            return f"{n or '<root>'}{took}: {why}"

        islands = "; ".join(island(n, why) for n, why in self.islands.items()) or "none"
        return (
            f"partial graphs: {len(self.graphed)} graphed modules ({', '.join(n or '<root>' for n in self.graphed)}),"
            f" {self.modules_graphed}/{self.modules_called} modules inside graphs"
            + (f", {cov:.1%} of the step's operators" if cov is not None else "")
            + f"; {self.captures} captures, {self.replays} module replays"
            + f"; {self.grads_in_graphs} parameters' gradients accumulated inside graphs"
            + (f" ({len(self.grads_outside)} by autograd: {', '.join(list(self.grads_outside)[:3])}"
               f"{', ...' if len(self.grads_outside) > 3 else ''})" if self.grads_outside else "")
            + f"; islands: {islands};"
            + (" compiled apart (their compiled code not one graph): "
               f"{', '.join(n or '<root>' for n in self.compiled_apart)};" if self.compiled_apart else "")
            + f" optimizer side {self.optimizer.split(':')[0]}"
            + (f" ({self.optimizer_eager_untouched} steps eager: parameters without a gradient in them)"
               if self.optimizer_eager_untouched else "")
        )


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
    #: memset nodes of the captured graphs rewritten as fill kernels (option ``memsets_as_kernels``)
    memsets_rewritten: int = 0
    #: captures whose graph copies the batch in and its outputs out with its own nodes (option ``io_in_graph``)
    graphs_with_io_nodes: int = 0
    #: the device's peak allocated memory (``torch.cuda.max_memory_allocated``) just before the first capture: what
    #: the model, its optimizer state and the eager warm-up steps needed (0 on CPU)
    peak_eager_bytes: int = 0
    #: the device's peak allocated memory at the end of fit: the graphs, their memory pool and static buffers added
    peak_bytes: int = 0
    #: why ``fast_adam=True`` left the optimizer's own step in the graphs ("" when it did not, or was not asked for)
    fast_adam_unused: str = ""
    #: why the graphed optimizer update is not your optimizer's own eager update ("" when it is)
    optimizer_math: str = ""
    #: where it is not, by how much, measured by the first ``verify_steps`` comparison (the step run once more with your
    #: optimizer's own settings): ``(max |graphed - yours|, that over the parameter's largest |yours|)`` of the
    #: parameters after that step; ``None``: not measured
    optimizer_math_gap: Optional[tuple[float, float]] = None
    #: the partial tier's graphs and islands (``None``: the partial tier did not run)
    partial: Optional[PartialStats] = None

    @property
    def peak_over_eager(self) -> Optional[float]:
        """Peak memory of the graphed run over that of its eager warm-up steps (``None`` when nothing was captured)."""
        return self.peak_bytes / self.peak_eager_bytes if self.peak_eager_bytes and self.peak_bytes else None

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
            + (f"; peak memory {self.peak_bytes / 2**30:.2f} GiB, {self.peak_over_eager:.3f}x the eager warm-up's"
               f" {self.peak_eager_bytes / 2**30:.2f} GiB" if self.peak_over_eager is not None else "")
            + (f"; fast_adam unused: {self.fast_adam_unused}" if self.fast_adam_unused else "")
            + (f"; {self.optimizer_math_text()}" if self.optimizer_math else "")
            + (f"; {self.partial.summary()}" if self.partial is not None else "")
        )

    def optimizer_math_text(self) -> str:
        """That the graphed optimizer math differs from your eager step, why, and by how much (``""`` where it does
        not): the end-of-fit summary's words."""
        if not self.optimizer_math:
            return ""
        text = f"optimizer math differs from your eager step: {self.optimizer_math}"
        if self.optimizer_math_gap is None:
            return text + " (verify_steps >= 1 measures by how much)"
        gap_abs, gap_rel = self.optimizer_math_gap
        return (text + f"; after one verified step the parameters differ from your own step's by up to {gap_abs:.3g}"
                f" ({gap_rel:.3g} of the parameter's largest magnitude)")
