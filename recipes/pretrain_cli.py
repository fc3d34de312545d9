"""The ``gpt-pretrain`` command line's arguments, without torch: ``python -m recipes.gpt_pretrain --help`` answers
from here before torch and Lightning are imported (:mod:`recipes.gpt_pretrain` re-exports every name)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from recipes.gpt_config import PRESETS

__all__ = ["CPU_DEFAULT_STEPS", "GPU_DEFAULT_STEPS", "build_parser", "presets_table"]

GPU_DEFAULT_STEPS = 200
# Two cores run the tiny preset at 0.12-0.5 s/step (idle to busy): --compare (two runs) takes 20-60 s.
CPU_DEFAULT_STEPS = 50


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


class _DeprecatedAlias(argparse.Action):
    """An old flag spelling: stores into the new flag's ``dest`` and says once, on stderr, what to type instead."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"gpt-pretrain: {option_string} is deprecated, use {self.new} (same meaning)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def presets_table(vocab_size: int = 256) -> str:
    """The presets' sizes, one line each (parameter counts with ``vocab_size`` tokens, tied head counted once)."""
    rows = [("preset", "layers", "d_model", "heads", "seq", "batch", "params")]
    for name, cfg in PRESETS.items():
        n = cfg.replace(vocab_size=vocab_size).num_params()
        rows.append((name, str(cfg.n_layer), str(cfg.n_embd), str(cfg.n_head), str(cfg.seq_len),
                     str(cfg.batch_size), f"{n / 1e6:.1f}M"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  " + "  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]) for r in rows
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpt-pretrain",
        description="Pre-train a small GPT with Lightning; the whole training step runs in CUDA graphs\n"
        "(nemo_cudagraph_plugin) when a GPU is present. Without one every step runs eagerly, and says so.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "presets (--preset NAME; --seq-len and --batch-size override seq and batch; params counted with\n"
            "the embedded corpus' 256 byte tokens):\n"
            f"{presets_table()}\n\n"
            f"--steps defaults to {GPU_DEFAULT_STEPS} on a GPU and {CPU_DEFAULT_STEPS} on a CPU-only machine, "
            "where every step runs eagerly\n(--compare then takes a minute or less on two cores)."
        ),
    )
    g = p.add_argument_group("CUDA graphs")
    g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the training step in CUDA graphs (default: on when a GPU is present)")
    g.add_argument("--strategy", choices=("callback", "strategy"), default="callback",
                   help="attach the plugin as CudaGraphCallback or as CudaGraphStrategy (default: %(default)s)")
    g.add_argument("--graph-warmup-steps", type=_positive_int, default=3, metavar="N",
                   help="eager steps before the first CUDA-graph capture (the plugin's warmup_steps; "
                   "default: %(default)s). Not the learning-rate warm-up: see --lr-warmup-steps")
    g.add_argument("--graph-warmup", dest="graph_warmup_steps", type=_positive_int, new="--graph-warmup-steps",
                   action=_DeprecatedAlias)
    g.add_argument("--compare", action="store_true",
                   help="run eager, then with the plugin, from the same seed; print both, write a PNG and JSON")
    g.add_argument("--timing-skip", type=_non_negative_int, default=None,
                   help="steps left out of the timing (default: graph warm-up + 2, covering the capture)")
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="model size preset, see the table below (default: %(default)s)")
    m.add_argument("--fp8", action="store_true",
                   help="TransformerEngine layers with FP8 primary weights (needs TE and an FP8 GPU)")
    m.add_argument("--dropout", type=float, default=0.0, help="dropout probability (default: %(default)s)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=_positive_int, default=None,
                   help=f"optimizer steps (default: {GPU_DEFAULT_STEPS} on a GPU, {CPU_DEFAULT_STEPS} on CPU)")
    t.add_argument("--batch-size", type=_positive_int, default=None, help="micro-batch per device (default: preset)")
    t.add_argument("--seq-len", type=_positive_int, default=None, help="sequence length (default: preset)")
    t.add_argument("--seed", type=int, default=1234, help="seed of weights and data order (default: %(default)s)")
    t.add_argument("--lr", type=float, default=6e-4, help="peak learning rate of AdamW (default: %(default)s)")
    t.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default: %(default)s)")
    t.add_argument("--lr-warmup-steps", type=_non_negative_int, default=None, metavar="N",
                   help="steps of linear learning-rate warm-up (default: steps // 10, at most 100). "
                   "Not the CUDA-graph warm-up: see --graph-warmup-steps")
    t.add_argument("--warmup-steps", dest="lr_warmup_steps", type=_non_negative_int, new="--lr-warmup-steps",
                   action=_DeprecatedAlias)
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
