"""``gpt-pretrain``: pre-train a small GPT with Lightning, with the whole training step in CUDA graphs.

    python -m recipes.gpt_pretrain --preset small --compare          # eager vs graphed, table + PNG + JSON
    python -m recipes.gpt_pretrain --preset tiny --steps 50          # CPU: trains eagerly and says so
    python -m recipes.gpt_pretrain --data my.txt --strategy strategy # your text (byte-level tokens)

Data: the embedded public-domain corpus (``recipes/data``) unless ``--data`` names a text file (byte-level
tokens; ``.gz`` is decompressed) or a token file (``.pt``: 1-D integer tensor, ``.npy``: 1-D integer array).

Timing: per-step wall times come from CUDA events (GPU) or ``perf_counter`` (CPU) recorded in
``on_train_batch_end``; the only explicit host syncs are at the start and end of the timed window, which skips
the first ``--timing-skip`` steps (the plugin's warm-up and capture). Per-step losses are copied into a
device buffer and read once after training. Note that Lightning itself converts progress-bar metrics
(``train_loss``) to Python floats after every step, in both modes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar

from recipes.gpt import (
    PRESETS,
    GPTDataModule,
    GPTLightningModule,
    TransformerEngineUnavailable,
    _import_te,
    get_config,
)

NO_GPU_MESSAGE = "No CUDA GPU found: training eagerly on CPU (CUDA graphs need a GPU)."


class RecipeError(ValueError):
    """Bad command-line input; the message says what to change."""


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpt-pretrain",
        description="Pre-train a small GPT with Lightning; the whole training step runs in CUDA graphs "
        "(nemo_cudagraph_plugin) when a GPU is present.",
    )
    g = p.add_argument_group("CUDA graphs")
    g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the training step in CUDA graphs (default: on when a GPU is present)")
    g.add_argument("--strategy", choices=("callback", "strategy"), default="callback",
                   help="attach the plugin as CudaGraphCallback or as CudaGraphStrategy (default: %(default)s)")
    g.add_argument("--graph-warmup", type=_non_negative_int, default=3,
                   help="eager warm-up steps before the capture (plugin's warmup_steps; default: %(default)s)")
    g.add_argument("--compare", action="store_true",
                   help="run eager, then graphed, from the same seed; print both, write a PNG and JSON")
    g.add_argument("--timing-skip", type=_non_negative_int, default=None,
                   help="steps left out of the timing (default: graph warm-up + 2, covering the capture)")
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size preset (default: %(default)s)")
    m.add_argument("--fp8", action="store_true",
                   help="TransformerEngine layers with FP8 primary weights (needs TE and an FP8 GPU)")
    m.add_argument("--dropout", type=float, default=0.0, help="dropout probability (default: %(default)s)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=_positive_int, default=200, help="optimizer steps (default: %(default)s)")
    t.add_argument("--batch-size", type=_positive_int, default=None, help="micro-batch per device (default: preset)")
    t.add_argument("--seq-len", type=_positive_int, default=None, help="sequence length (default: preset)")
    t.add_argument("--seed", type=int, default=1234, help="seed of weights and data order (default: %(default)s)")
    t.add_argument("--lr", type=float, default=6e-4, help="peak learning rate of AdamW (default: %(default)s)")
    t.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default: %(default)s)")
    t.add_argument("--warmup-steps", type=_non_negative_int, default=None,
                   help="linear LR warm-up steps (default: steps // 10, at most 100)")
    t.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                   help="after warm-up: cosine decay to 0.1*lr at --steps, or constant (default: %(default)s)")
    t.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip, 0 disables (default: %(default)s)")
    t.add_argument("--precision", default=None,
                   help="Lightning precision (default: bf16-mixed on GPU, 32-true on CPU)")
    t.add_argument("--devices", type=_positive_int, default=1, help="devices (GPUs) to train on (default: %(default)s)")
    d = p.add_argument_group("data and output")
    d.add_argument("--data", default=None,
                   help="text file (byte tokens) or token file (.pt / .npy); default: the embedded corpus")
    d.add_argument("--vocab-size", type=_positive_int, default=None,
                   help="vocabulary size for a token file (default: max token id + 1)")
    d.add_argument("--val-batches", type=_non_negative_int, default=8,
                   help="validation batches after training, 0: none (default: %(default)s)")
    d.add_argument("--out", default="out/gpt_pretrain", help="folder for results.json and compare.png (default: %(default)s)")
    d.add_argument("--log-every", type=_non_negative_int, default=10,
                   help="progress-bar refresh interval in steps, 0 hides the bar (default: %(default)s)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` and resolve the device-dependent defaults; :class:`RecipeError` on bad combinations."""
    args = build_parser().parse_args(argv)
    args.has_cuda = torch.cuda.is_available()
    args.cuda_graph_explicit = args.cuda_graph is not None
    if args.cuda_graph is None:
        args.cuda_graph = args.has_cuda
    if args.precision is None:
        args.precision = "bf16-mixed" if args.has_cuda else "32-true"
    if args.warmup_steps is None:
        args.warmup_steps = min(100, args.steps // 10)
    if args.timing_skip is None:
        args.timing_skip = args.graph_warmup + 2
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

    @property
    def replays(self) -> int | None:
        """Steps that ran as a graph replay (``None`` without the plugin)."""
        return None if self.graph_stats is None else int(self.graph_stats.get("replays", 0))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
        strategy = CudaGraphStrategy(inner=inner, warmup_steps=args.graph_warmup)
        return None, strategy, strategy
    callback = CudaGraphCallback(warmup_steps=args.graph_warmup)
    return callback, None, callback


def make_fp8_callback() -> Callback:
    try:
        from nemo_cudagraph_plugin.lightning.fp8_callback import Fp8TransposeRefresh
    except ImportError as exc:
        raise RecipeError(
            f"--fp8 needs nemo_cudagraph_plugin.lightning.fp8_callback.Fp8TransposeRefresh ({exc})"
        ) from exc
    return Fp8TransposeRefresh()


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


def run_training(args: argparse.Namespace, *, cuda_graph: bool, mode: str) -> RunResult:
    """One full ``Trainer.fit`` from ``args.seed``; returns its :class:`RunResult`."""
    pl.seed_everything(args.seed, workers=True, verbose=False)
    dm = build_datamodule(args)
    cfg = args.config.replace(vocab_size=dm.vocab_size)
    module = GPTLightningModule(
        cfg, lr=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
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
    window = timer.window_s
    ms = window / measured * 1e3 if measured else float("nan")
    tokens_per_step = cfg.batch_size * cfg.seq_len * args.devices
    stats = _stats_dict(plugin) if plugin is not None else None
    summary = getattr(getattr(plugin, "stats", None), "summary", None)
    capture = float(stats["capture_time_s"]) if stats and "capture_time_s" in stats else None
    val = trainer.callback_metrics.get("val_loss")
    return RunResult(
        mode=mode, steps=timer.count, measured_steps=measured, ms_per_step=ms,
        steps_per_s=1e3 / ms if measured else float("nan"),
        tokens_per_s=tokens_per_step * 1e3 / ms if measured else float("nan"),
        capture_time_s=capture, peak_mem_bytes=peak,
        final_loss=losses[-1] if losses else float("nan"),
        val_loss=float(val) if val is not None else None,
        wall_s=wall, losses=losses, step_ms=step_ms, graph_stats=stats,
        graph_summary=summary() if callable(summary) else None,
    )


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


def plot_compare(results: Sequence[RunResult], path: Path, *, skip: int, title: str) -> Path | None:
    """Loss curves and per-step times of each run in one PNG; ``None`` (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _say("matplotlib is not installed, so no plot was written: pip install matplotlib "
             "(or nemo_cudagraph_plugin[plot])")
        return None
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for n, r in enumerate(results):
        # the first run wide and faint, later ones thin on top, so identical curves stay visible
        style = {"linewidth": 2.6, "alpha": 0.55} if n == 0 and len(results) > 1 else {"linewidth": 1.1}
        ax_loss.plot(range(1, len(r.losses) + 1), r.losses, label=r.mode, **style)
        ax_time.plot(range(1, len(r.step_ms) + 1), r.step_ms,
                     label=f"{r.mode} ({_fmt(r.ms_per_step, '.2f')} ms/step timed)", **style)
    ax_loss.set(xlabel="step", ylabel="train loss", title="Training loss")
    ax_time.set(xlabel="step", ylabel="step time (ms, log)", title="Step time", yscale="log")
    if skip:
        ax_time.axvspan(0.5, skip + 0.5, color="grey", alpha=0.15, label="untimed (warm-up, capture)")
    for ax in (ax_loss, ax_time):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
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
    out = Path(args.out)
    args.config = args.config.replace(vocab_size=dm.vocab_size)
    _say(_describe(args, dm))
    del dm

    if args.compare:
        results = [run_training(args, cuda_graph=False, mode="eager"),
                   run_training(args, cuda_graph=True, mode="graphed")]
    else:
        results = [run_training(args, cuda_graph=args.cuda_graph, mode="graphed" if args.cuda_graph else "eager")]

    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return 0
    eager = next((r for r in results if r.mode == "eager"), None)
    for r in results:
        if eager is not None and r.ms_per_step and not math.isnan(eager.ms_per_step):
            r.speedup = eager.ms_per_step / r.ms_per_step
    _say("")
    _say(format_summary(results))
    skip_note = f"timed over steps {args.timing_skip + 1}-{args.steps}" if args.timing_skip else "all steps timed"
    _say(f"({skip_note}; replayed = steps run as a CUDA-graph replay; tokens/s counts batch x seq_len x devices)")
    for r in results:
        if r.graph_summary:
            _say(f"{r.mode}: {r.graph_summary}")
    report: dict[str, Any] = {
        "preset": args.preset, "config": args.config.as_dict(), "fp8": args.fp8, "strategy": args.strategy,
        "precision": args.precision, "devices": args.devices, "seed": args.seed, "steps": args.steps,
        "timing_skip": args.timing_skip, "data": args.data or "embedded",
        "device": torch.cuda.get_device_name() if args.has_cuda else "cpu",
        "runs": [r.as_dict() for r in results],
    }
    if args.compare:
        parity = loss_parity(results[0], results[1])
        report["max_abs_loss_diff"] = parity
        report["speedup"] = results[1].speedup
        _say(f"loss parity: max |eager - graphed| over {min(len(results[0].losses), len(results[1].losses))} "
             f"steps = {parity:.3g}")
        png = plot_compare(results, out / "compare.png", skip=args.timing_skip,
                           title=f"gpt-pretrain --preset {args.preset}: eager vs CUDA-graphed "
                                 f"({report['device']})")
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
