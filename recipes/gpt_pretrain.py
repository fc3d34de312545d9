"""``gpt-pretrain``: pre-train a small GPT with Lightning, with the whole training step in CUDA graphs.

    python -m recipes.gpt_pretrain --compare                          # eager vs graphed, table + PNG + JSON
    python -m recipes.gpt_pretrain --preset small --steps 300         # one run (graphed when a GPU is present)
    python -m recipes.gpt_pretrain --data my.txt --strategy strategy  # your text (byte-level tokens)

Data: the embedded public-domain corpus (``recipes/data``) unless ``--data`` names a text file (byte-level
tokens; ``.gz`` is decompressed) or a token file (``.pt``: 1-D integer tensor, ``.npy``: 1-D integer array).

Without a CUDA GPU every step runs eagerly. ``--steps`` then defaults to 50 instead of 200 (``--compare`` takes
a minute or less on two cores), and a run with the plugin attached is labelled ``eager+plugin``, not ``graphed``:
the table, the PNG and ``results.json`` say that no step was replayed and why, and print no speedup. A run is
called ``graphed`` only when the plugin replayed at least one step.

Timing: per-step wall times come from CUDA events (GPU) or ``perf_counter`` (CPU) recorded in
``on_train_batch_end``; the only explicit host syncs are at the start and end of the timed window, which skips
the first ``--timing-skip`` steps (the plugin's warm-up and capture). ms/step is the window's mean on a GPU and
the median of its steps on a CPU, where single start-up steps can take ten times a steady one. Per-step losses are copied into a
device buffer and read once after training. Note that Lightning itself converts progress-bar metrics
(``train_loss``) to Python floats after every step, in both modes.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    # The help answers before torch and Lightning are imported (seconds on a small machine).
    from recipes.pretrain_cli import build_parser

    build_parser().parse_args()  # prints the help and exits

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar

from recipes.gpt import (
    GPTDataModule,
    GPTLightningModule,
    TransformerEngineUnavailable,
    _import_te,
    get_config,
)
from recipes.pretrain_cli import (  # noqa: F401 - presets_table: the command line's names, re-exported here
    CPU_DEFAULT_STEPS,
    GPU_DEFAULT_STEPS,
    build_parser,
    presets_table,
)

NO_GPU_MESSAGE = "No CUDA GPU found: training eagerly on CPU (CUDA graphs need a GPU)."
# Label of a run that had the plugin attached but replayed no step: it trained eagerly, so it is not "graphed".
NOT_REPLAYED_MODE = "eager+plugin"


class RecipeError(ValueError):
    """Bad command-line input; the message says what to change."""


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` and resolve the device-dependent defaults; :class:`RecipeError` on bad combinations."""
    args = build_parser().parse_args(argv)
    args.has_cuda = torch.cuda.is_available()
    args.cuda_graph_explicit = args.cuda_graph is not None
    if args.cuda_graph is None:
        args.cuda_graph = args.has_cuda
    if args.precision is None:
        args.precision = "bf16-mixed" if args.has_cuda else "32-true"
    args.precision_note = None
    if not args.has_cuda and args.precision in ("16-mixed", "16"):
        # Lightning has no fp16 autocast on a CPU and trains bf16-mixed instead: label the run with what it trains.
        args.precision_note = f"--precision {args.precision} on a CPU trains bf16-mixed (no fp16 autocast on a CPU)."
        args.precision = "bf16-mixed"
    args.steps_defaulted = args.steps is None
    if args.steps is None:
        args.steps = GPU_DEFAULT_STEPS if args.has_cuda else CPU_DEFAULT_STEPS
    if args.lr_warmup_steps is None:
        args.lr_warmup_steps = min(100, args.steps // 10)
    if args.timing_skip is None:
        args.timing_skip = args.graph_warmup_steps + 2
    args.timing_skip = min(args.timing_skip, args.steps - 1)
    if not 0.0 <= args.dropout < 1.0:
        raise RecipeError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.lr <= 0:
        raise RecipeError(f"--lr must be > 0, got {args.lr}")
    if args.grad_clip < 0:
        raise RecipeError(f"--grad-clip must be >= 0, got {args.grad_clip}")
    if args.compare and args.devices > 1:
        raise RecipeError("--compare runs both modes in one process; use --devices 1")
    if args.devices > 1 and not args.has_cuda:
        raise RecipeError(f"--devices {args.devices} needs as many GPUs; this machine has none")
    if args.has_cuda and args.devices > torch.cuda.device_count():
        raise RecipeError(f"--devices {args.devices} but only {torch.cuda.device_count()} GPU(s) are visible")
    args.config = get_config(args.preset, seq_len=args.seq_len, batch_size=args.batch_size, dropout=args.dropout)
    return args


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------


class StepTimer(Callback):
    """Per-step loss and time without per-step host syncs; a synced wall-clock window for steps/s.

    Steps ``[skip, last]`` form the timed window: ``torch.cuda.synchronize()`` runs once when step ``skip``
    starts and once when the last step ends. Per-step times come from CUDA events (read after training) or
    ``perf_counter`` on CPU; losses are copied into a preallocated device buffer (one async copy per step).
    """

    def __init__(self, skip_steps: int = 0) -> None:
        self.skip = skip_steps
        self.count = 0
        self.t0: float | None = None
        self.t1: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        n = max(1, int(trainer.max_steps))
        self.n = n
        self.cuda = pl_module.device.type == "cuda"
        self.count, self.t0, self.t1 = 0, None, None
        self._losses = torch.full((n,), float("nan"), dtype=torch.float32, device=pl_module.device)
        if self.cuda:
            self._marks: list[Any] = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        else:
            self._marks = [0.0] * (n + 1)

    def _mark(self, index: int) -> None:
        if self.cuda:
            self._marks[index].record()
        else:
            self._marks[index] = time.perf_counter()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.count == 0:
            self._mark(0)
        if self.count == self.skip:
            self._sync()
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.count >= self.n:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            # Copy now: under graph replay the step's output tensor is overwritten by the next replay.
            self._losses[self.count].copy_(loss.detach().reshape(()), non_blocking=True)
        self.count += 1
        self._mark(self.count)
        if self.count == self.n:
            self._sync()
            self.t1 = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.t1 is None:  # stopped early (e.g. by a NaN guard)
            self._sync()
            self.t1 = time.perf_counter()

    # -- read after training ------------------------------------------------------------------------------------
    @property
    def measured_steps(self) -> int:
        return max(0, self.count - self.skip) if self.t0 is not None else 0

    @property
    def window_s(self) -> float:
        if self.t0 is None or self.t1 is None:
            return float("nan")
        return self.t1 - self.t0

    def ms_per_step(self) -> float:
        """Time per step of the timed window: on a GPU its synced wall time over its steps; on a CPU the median
        of its steps' times, because a CPU process's first steps (allocator, thread pools, lazy imports) can each
        take seconds, so two runs' means would differ by what start-up fell inside their windows."""
        measured = self.measured_steps
        if not measured:
            return float("nan")
        if self.cuda:
            return self.window_s / measured * 1e3
        return statistics.median(self.step_ms()[self.count - measured:self.count])

    def losses(self) -> list[float]:
        return self._losses[: self.count].cpu().tolist()

    def step_ms(self) -> list[float]:
        if self.cuda:
            self._sync()
            return [self._marks[i].elapsed_time(self._marks[i + 1]) for i in range(self.count)]
        return [(self._marks[i + 1] - self._marks[i]) * 1e3 for i in range(self.count)]


@dataclasses.dataclass
class RunResult:
    """One training run's numbers (one row of the summary table)."""

    mode: str
    steps: int
    measured_steps: int
    ms_per_step: float
    steps_per_s: float
    tokens_per_s: float
    capture_time_s: float | None
    peak_mem_bytes: int | None
    final_loss: float
    val_loss: float | None
    wall_s: float
    losses: list[float]
    step_ms: list[float]
    graph_stats: dict[str, Any] | None = None
    graph_summary: str | None = None
    speedup: float | None = None
    #: what was asked for: "eager" (no plugin) or "graphed" (plugin attached); ``mode`` says what happened
    requested: str = ""
    #: why a run with the plugin attached replayed no step (``None`` when it replayed, or had no plugin)
    not_graphed_reason: str | None = None

    @property
    def replays(self) -> int | None:
        """Steps that ran as a graph replay (``None`` without the plugin)."""
        return None if self.graph_stats is None else int(self.graph_stats.get("replays", 0))

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "replayed": self.replays}


# ---------------------------------------------------------------------------------------------------------------
# Building and running
# ---------------------------------------------------------------------------------------------------------------


def _say(message: str) -> None:
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(message, flush=True)


def make_cuda_graph_plugin(args: argparse.Namespace) -> tuple[Callback | None, Any | None, Any]:
    """``(callback, strategy, plugin)``: exactly one of the first two is set; ``plugin`` owns ``.stats``."""
    try:
        from nemo_cudagraph_plugin import CudaGraphCallback, CudaGraphStrategy
    except ImportError as exc:
        raise RecipeError(
            f"--cuda-graph needs nemo_cudagraph_plugin.CudaGraphCallback/CudaGraphStrategy ({exc}); "
            "install the package or pass --no-cuda-graph"
        ) from exc
    if args.strategy == "strategy":
        inner = "ddp" if args.devices > 1 else None
        strategy = CudaGraphStrategy(inner=inner, warmup_steps=args.graph_warmup_steps)
        return None, strategy, strategy
    callback = CudaGraphCallback(warmup_steps=args.graph_warmup_steps)
    return callback, None, callback


def make_fp8_callback() -> Callback:
    try:
        from nemo_cudagraph_plugin.lightning.fp8_callback import Fp8TransposeRefresh
    except ImportError as exc:
        raise RecipeError(
            f"--fp8 needs nemo_cudagraph_plugin.lightning.fp8_callback.Fp8TransposeRefresh ({exc})"
        ) from exc
    return Fp8TransposeRefresh()


def not_replayed_reason(plugin: Any, stats: Mapping[str, Any] | None, *, has_cuda: bool) -> str:
    """Why a run with ``plugin`` attached replayed no step, in the plugin's own words where it gives them."""
    try:
        reason = getattr(plugin, "eager_reason", None)  # e.g. "no CUDA device is available"
    except Exception:  # the plugin never bound (e.g. fit stopped early): fall back to its counters
        reason = None
    if reason:
        return str(reason)
    reasons = (stats or {}).get("eager_reasons") or {}
    if reasons:
        return ", ".join(str(k) for k in sorted(reasons))
    return "no CUDA device" if not has_cuda else "the plugin replayed no step (see its stats line)"


def label_run(result: RunResult, plugin: Any, *, has_cuda: bool) -> RunResult:
    """Name ``result`` by what happened: a run with the plugin attached is ``graphed`` only if it replayed."""
    if result.requested == "graphed" and not result.replays:
        result.mode = NOT_REPLAYED_MODE
        result.not_graphed_reason = not_replayed_reason(plugin, result.graph_stats, has_cuda=has_cuda)
    return result


def assign_speedups(results: Sequence[RunResult]) -> str | None:
    """Set ``speedup`` (eager ms/step over graphed ms/step) where a graphed run replayed; else say why not.

    Returns ``None`` when speedups were set or no comparison was asked for, else the sentence to print in
    place of a speedup (e.g. both runs trained eagerly on a CPU: their time difference is noise).
    """
    for r in results:
        r.speedup = None
    eager = next((r for r in results if r.requested == "eager"), None)
    with_plugin = [r for r in results if r.requested == "graphed"]
    if eager is None or not with_plugin:
        return None
    graphed = [r for r in with_plugin if r.replays]
    if not graphed:
        reason = "; ".join(dict.fromkeys(r.not_graphed_reason or "unknown" for r in with_plugin))
        return (f"no speedup: no step was replayed ({reason}), so both runs trained eagerly and the difference "
                "in their step times is noise")
    if math.isnan(eager.ms_per_step):
        return "no speedup: the eager run has no timed step (raise --steps above --timing-skip)"
    eager.speedup = 1.0
    for r in graphed:
        if r.ms_per_step and not math.isnan(r.ms_per_step):
            r.speedup = eager.ms_per_step / r.ms_per_step
    return None


def _stats_dict(plugin: Any) -> dict[str, Any] | None:
    stats = getattr(plugin, "stats", None)
    if stats is None:
        return None
    as_dict = getattr(stats, "as_dict", None)
    return dict(as_dict()) if callable(as_dict) else dict(vars(stats))


def build_datamodule(args: argparse.Namespace) -> GPTDataModule:
    cfg = args.config
    return GPTDataModule(
        args.data, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=args.seed,
        train_samples=args.steps * cfg.batch_size * args.devices, vocab_size=args.vocab_size,
        val_samples=args.val_batches * cfg.batch_size * args.devices or None,
    )


def run_training(args: argparse.Namespace, *, cuda_graph: bool) -> RunResult:
    """One full ``Trainer.fit`` from ``args.seed``, with the plugin attached if ``cuda_graph``.

    Returns its :class:`RunResult`, labelled ``graphed`` only if the plugin replayed a step (else
    ``eager+plugin`` with the reason) and ``eager`` without the plugin.
    """
    mode = "graphed" if cuda_graph else "eager"
    pl.seed_everything(args.seed, workers=True, verbose=False)
    dm = build_datamodule(args)
    cfg = args.config.replace(vocab_size=dm.vocab_size)
    module = GPTLightningModule(
        cfg, lr=args.lr, weight_decay=args.weight_decay, warmup_steps=args.lr_warmup_steps,
        max_steps=args.steps if args.lr_schedule == "cosine" else None, fp8=args.fp8,
    )
    timer = StepTimer(skip_steps=args.timing_skip)
    callbacks: list[Callback] = [timer]
    strategy: Any = "ddp" if args.devices > 1 else "auto"
    plugin = None
    if cuda_graph:
        callback, graph_strategy, plugin = make_cuda_graph_plugin(args)
        if callback is not None:
            callbacks.append(callback)
        if graph_strategy is not None:
            strategy = graph_strategy
    if args.fp8 and not cuda_graph:
        # Graphed runs: CudaGraphCallback/Strategy(fp8_refresh="auto") already refreshes after each step.
        callbacks.append(make_fp8_callback())
    if args.log_every:
        callbacks.append(TQDMProgressBar(refresh_rate=args.log_every))
    use_val = args.val_batches > 0 and dm.val_dataset is not None
    trainer = pl.Trainer(
        accelerator="gpu" if args.has_cuda else "cpu", devices=args.devices, strategy=strategy,
        precision=args.precision, max_steps=args.steps, max_epochs=-1,
        gradient_clip_val=args.grad_clip or None, callbacks=callbacks,
        limit_val_batches=args.val_batches if use_val else 0, num_sanity_val_steps=0,
        enable_progress_bar=bool(args.log_every), enable_model_summary=False, enable_checkpointing=False,
        logger=False, default_root_dir=args.out,
    )
    if args.has_cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if args.has_cuda else None

    losses = timer.losses()
    step_ms = timer.step_ms()
    measured = timer.measured_steps
    ms = timer.ms_per_step()
    tokens_per_step = cfg.batch_size * cfg.seq_len * args.devices
    stats = _stats_dict(plugin) if plugin is not None else None
    summary = getattr(getattr(plugin, "stats", None), "summary", None)
    # no capture happened: "-" in the table rather than a capture time of 0.000 s
    capture = float(stats["capture_time_s"]) if stats and stats.get("captures") and "capture_time_s" in stats else None
    val = trainer.callback_metrics.get("val_loss")
    result = RunResult(
        mode=mode, requested=mode, steps=timer.count, measured_steps=measured, ms_per_step=ms,
        steps_per_s=1e3 / ms if measured else float("nan"),
        tokens_per_s=tokens_per_step * 1e3 / ms if measured else float("nan"),
        capture_time_s=capture, peak_mem_bytes=peak,
        final_loss=losses[-1] if losses else float("nan"),
        val_loss=float(val) if val is not None else None,
        wall_s=wall, losses=losses, step_ms=step_ms, graph_stats=stats,
        graph_summary=summary() if callable(summary) else None,
    )
    return label_run(result, plugin, has_cuda=args.has_cuda)


# ---------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{unit}"


def format_summary(results: Sequence[RunResult]) -> str:
    """The final summary table (one row per mode)."""
    header = ("mode", "steps", "replayed", "steps/s", "ms/step", "tokens/s", "speedup", "capture s", "peak mem",
              "final loss", "val loss")
    rows = [header]
    for r in results:
        peak = None if r.peak_mem_bytes is None else r.peak_mem_bytes / 2**30
        rows.append((
            r.mode, str(r.steps), "-" if r.replays is None else str(r.replays), _fmt(r.steps_per_s, ".2f"), _fmt(r.ms_per_step, ".2f"),
            _fmt(r.tokens_per_s, ",.0f"), _fmt(r.speedup, ".2f", "x"), _fmt(r.capture_time_s, ".3f"),
            _fmt(peak, ".2f", " GiB"), _fmt(r.final_loss, ".4f"), _fmt(r.val_loss, ".4f"),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def loss_parity(a: RunResult, b: RunResult) -> float:
    """Largest per-step |loss difference| between two runs (NaN if none comparable)."""
    diffs = [abs(x - y) for x, y in zip(a.losses, b.losses) if not (math.isnan(x) or math.isnan(y))]
    return max(diffs) if diffs else float("nan")


def compare_title(results: Sequence[RunResult], *, preset: str, device: str) -> str:
    """The PNG's title: "eager vs CUDA-graphed" only when the second run replayed graphs."""
    modes = " vs ".join(dict.fromkeys(r.mode for r in results))
    if any(r.mode == "graphed" for r in results):
        modes = modes.replace("graphed", "CUDA-graphed")
    title = f"gpt-pretrain --preset {preset}: {modes} ({device})"
    reasons = [r.not_graphed_reason for r in results if r.not_graphed_reason]
    if reasons:
        title += f"\nno step was replayed ({reasons[0]}): both runs trained eagerly, no speedup"
    return title


def plot_labels(results: Sequence[RunResult]) -> list[tuple[str, str]]:
    """Per run, its legend labels in the loss panel and in the step-time panel (mode, replays, ms/step)."""
    labels = []
    for r in results:
        replayed = "" if r.replays is None else f"{r.replays} replayed, "
        labels.append((r.mode, f"{r.mode} ({replayed}{_fmt(r.ms_per_step, '.2f')} ms/step timed)"))
    return labels


def plot_compare(results: Sequence[RunResult], path: Path, *, skip: int, title: str) -> Path | None:
    """Loss curves and per-step times of each run in one PNG; ``None`` (with a message) without matplotlib.

    The title and the legend labels are also written into the PNG's text chunks (``Title``, ``Description``),
    so what the picture claims can be read back without looking at it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _say("matplotlib is not installed, so no plot was written: pip install matplotlib "
             "(or nemo_cudagraph_plugin[plot])")
        return None
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(12, 4.8))
    labels = plot_labels(results)
    for n, (r, (loss_label, time_label)) in enumerate(zip(results, labels)):
        # the first run wide and faint, later ones thin on top, so identical curves stay visible
        style = {"linewidth": 2.6, "alpha": 0.55} if n == 0 and len(results) > 1 else {"linewidth": 1.1}
        ax_loss.plot(range(1, len(r.losses) + 1), r.losses, label=loss_label, **style)
        ax_time.plot(range(1, len(r.step_ms) + 1), r.step_ms, label=time_label, **style)
    ax_loss.set(xlabel="step", ylabel="train loss", title="Training loss")
    ax_time.set(xlabel="step", ylabel="step time (ms, log)", title="Step time", yscale="log")
    if skip:
        what = "warm-up, capture" if any(r.replays for r in results) else "warm-up"
        ax_time.axvspan(0.5, skip + 0.5, color="grey", alpha=0.15, label=f"untimed ({what})")
    for ax in (ax_loss, ax_time):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    legend = "; ".join(t for _, t in labels)
    fig.savefig(path, dpi=110, metadata={"Title": title, "Description": f"legend: {legend}"})
    plt.close(fig)
    return path


def _json_safe(obj: Any) -> Any:
    """NaN/inf become ``null`` (strict JSON); everything else passes through."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def _describe(args: argparse.Namespace, dm: GPTDataModule) -> str:
    cfg = args.config.replace(vocab_size=dm.vocab_size)
    device = torch.cuda.get_device_name() if args.has_cuda else "CPU"
    return (
        f"GPT {args.preset}{' (FP8/TE)' if args.fp8 else ''}: {cfg.num_params() / 1e6:.1f}M params, "
        f"{cfg.n_layer} layers, d={cfg.n_embd}, heads={cfg.n_head}, seq={cfg.seq_len}, batch={cfg.batch_size}, "
        f"vocab={cfg.vocab_size} | data: {dm.source}, {dm.tokens.numel():,} tokens "
        f"({dm.train_tokens.numel():,} train / {dm.val_tokens.numel():,} val) | {device}, {args.precision}, "
        f"{args.steps} steps, seed {args.seed}"
    )


def _preflight(args: argparse.Namespace) -> GPTDataModule:
    """Every check that can fail on user input, before any training starts."""
    if args.fp8:
        _import_te()  # fail fast with TE's install hint
        if not args.has_cuda:
            raise TransformerEngineUnavailable("--fp8 needs a CUDA GPU with FP8 support; none is visible")
        if (args.config.batch_size * args.config.seq_len) % 16:
            raise RecipeError("--fp8 needs batch size x sequence length divisible by 16")
        make_fp8_callback()
    if args.cuda_graph or args.compare:
        make_cuda_graph_plugin(args)  # import check only; each run builds its own
    return build_datamodule(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gpt-pretrain``; returns the process exit code (2: bad input, message on stderr)."""
    try:
        args = parse_args(argv)
        dm = _preflight(args)
    except (RecipeError, TransformerEngineUnavailable, FileNotFoundError, ValueError) as exc:
        print(f"gpt-pretrain: error: {exc}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    if args.has_cuda:
        torch.set_float32_matmul_precision("high")
    else:
        _say(NO_GPU_MESSAGE)
        if args.precision_note:
            _say(args.precision_note)
        if args.steps_defaulted:
            _say(f"CPU: {CPU_DEFAULT_STEPS} steps by default ({GPU_DEFAULT_STEPS} on a GPU); change it with --steps N.")
        if args.compare:
            _say(f"--compare on CPU: the second run has the plugin attached; without a GPU it replays no step, so it "
                 f"is labelled {NOT_REPLAYED_MODE!r} and no speedup is measured.")
    out = Path(args.out)
    args.config = args.config.replace(vocab_size=dm.vocab_size)
    _say(_describe(args, dm))
    del dm

    if args.compare:
        results = [run_training(args, cuda_graph=False), run_training(args, cuda_graph=True)]
    else:
        results = [run_training(args, cuda_graph=args.cuda_graph)]

    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return 0
    speedup_note = assign_speedups(results)
    _say("")
    _say(format_summary(results))
    skip_note = f"timed over steps {args.timing_skip + 1}-{args.steps}" if args.timing_skip else "all steps timed"
    if not args.has_cuda:
        skip_note += ", ms/step the median step"
    _say(f"({skip_note}; replayed = steps run as a CUDA-graph replay; tokens/s counts batch x seq_len x devices)")
    for r in results:
        if r.not_graphed_reason:
            _say(f"{r.mode}: the plugin was attached but no step was replayed: {r.not_graphed_reason}")
    if speedup_note:
        _say(speedup_note)
    for r in results:
        if r.graph_summary:
            _say(f"{r.mode} stats: {r.graph_summary}")
    second = results[-1]
    report: dict[str, Any] = {
        "preset": args.preset, "config": args.config.as_dict(), "fp8": args.fp8, "strategy": args.strategy,
        "precision": args.precision, "devices": args.devices, "seed": args.seed, "steps": args.steps,
        "timing_skip": args.timing_skip, "data": args.data or "embedded",
        "device": torch.cuda.get_device_name() if args.has_cuda else "cpu",
        # the run with the plugin attached (the second one under --compare): did it replay, and how often
        "mode": second.mode, "replayed": second.replays, "not_graphed_reason": second.not_graphed_reason,
        "runs": [r.as_dict() for r in results],
    }
    if args.compare:
        parity = loss_parity(results[0], results[1])
        report["max_abs_loss_diff"] = parity
        report["speedup"] = results[1].speedup
        report["speedup_note"] = speedup_note
        _say(f"loss parity: max |{results[0].mode} - {results[1].mode}| over "
             f"{min(len(results[0].losses), len(results[1].losses))} steps = {parity:.3g}")
        png = plot_compare(results, out / "compare.png", skip=args.timing_skip,
                           title=compare_title(results, preset=args.preset, device=report["device"]))
        if png is not None:
            report["png"] = str(png)
            _say(f"plot: {png}")
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "results.json"
    json_path.write_text(json.dumps(_json_safe(report), indent=2, allow_nan=False) + "\n")
    _say(f"results: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
