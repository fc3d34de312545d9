"""A small GPT-style language model, its data pipeline and its LightningModule.

Shared by the ``gpt-pretrain`` recipe (:mod:`recipes.gpt_pretrain`), the benchmarks and the GPU tests, so
everything here is plain PyTorch / Lightning with no dependency on the plugin itself.

What this module guarantees about the model, so that a whole training step can be captured in a CUDA graph:

* :class:`GPT.forward` has no host synchronisation (no ``.item()``, no ``.cpu()``, no ``nonzero``, no printing
  of tensors) and no Python control flow that depends on tensor *values*; the only branches depend on shapes
  and on ``self.training``, which are fixed for a given captured graph.
* The batch has a fixed shape: the training dataloader drops the last incomplete batch and every sample is a
  window of exactly ``seq_len`` tokens.

Batch format (the one format used everywhere in this package): a ``dict`` with two ``torch.long`` tensors of
shape ``(batch, seq_len)``::

    {"input_ids": tokens[t : t + seq_len], "labels": tokens[t + 1 : t + seq_len + 1]}

FP8: :func:`build_model` with ``fp8=True`` returns :class:`TEGPT`, whose transformer blocks are
``transformer_engine.pytorch.TransformerLayer`` built under TE's FP8 primary-weight context
(``te.quantized_model_init`` on TE 2.x, ``te.fp8_model_init`` on 1.x), so the block weights *are*
``Float8Tensor`` parameters updated in place by the optimizer. TransformerEngine is imported lazily; when it is
missing, :class:`TransformerEngineUnavailable` says what to install.
"""

from __future__ import annotations

import gzip
import hashlib
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from recipes.gpt_config import PRESETS, GPTConfig, get_config

__all__ = [
    "EMBEDDED_CORPUS_NAME",
    "EMBEDDED_CORPUS_SHA256",
    "PRESETS",
    "GPT",
    "TEGPT",
    "Batch",
    "ByteTokenizer",
    "GPTConfig",
    "GPTDataModule",
    "GPTLightningModule",
    "TokenDataset",
    "TransformerEngineUnavailable",
    "build_model",
    "get_config",
    "gpt_loss",
    "load_embedded_corpus",
    "load_tokens",
    "split_tokens",
]

Batch = dict[str, torch.Tensor]
"""``{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}``."""

# ---------------------------------------------------------------------------------------------------------------
# Plain PyTorch model
# ---------------------------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, H, T, D)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _Embeddings(nn.Module):
    """Token + learned position embedding, shared by :class:`GPT` and :class:`TEGPT`."""

    def __init__(self, cfg: GPTConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd, device=device, dtype=dtype)
        self.pos = nn.Embedding(cfg.seq_len, cfg.n_embd, device=device, dtype=dtype)
        self.drop = nn.Dropout(cfg.dropout)
        # Positions as a buffer: slicing it needs no kernel launch and no host sync.
        self.register_buffer("pos_ids", torch.arange(cfg.seq_len, device=device), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.seq_len:  # shape check only (static under a captured graph)
            raise ValueError(
                f"input has {t} tokens but the model's position table holds {self.seq_len}; "
                "build the model with a larger seq_len"
            )
        return self.drop(self.tok(input_ids) + self.pos(self.pos_ids[:t]))


def _init_weights(module: nn.Module, std: float, n_layer: int) -> None:
    # GPT-2 style: N(0, std) everywhere, residual output projections scaled by 1/sqrt(2 * n_layer).
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            scale = 1.0 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 1.0
            nn.init.normal_(p, mean=0.0, std=std * scale)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


class GPT(nn.Module):
    """Decoder-only transformer: embeddings, ``n_layer`` pre-LN blocks, final LayerNorm, tied LM head.

    ``forward(input_ids: LongTensor[B, T]) -> logits: Tensor[B, T, vocab_size]``. Capturable in a CUDA graph
    (no host syncs, no value-dependent control flow); dtype follows the caller's autocast / ``.to(dtype)``.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.emb = _Embeddings(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        _init_weights(self, cfg.init_std, cfg.n_layer)
        self.head.weight = self.emb.tok.weight  # tied (after init so both names share one tensor)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in float32 (labels equal to -100 are ignored). No host sync."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


# ---------------------------------------------------------------------------------------------------------------
# FP8 model (TransformerEngine)
# ---------------------------------------------------------------------------------------------------------------


class TransformerEngineUnavailable(ImportError):
    """Raised when the FP8 model is requested but TransformerEngine (or an FP8-capable GPU) is missing."""


_TE_HINT = (
    "The FP8 model needs NVIDIA TransformerEngine with its PyTorch extension "
    "(pip install 'transformer-engine[pytorch]', or this package's [te] extra) and a CUDA GPU with FP8 "
    "support (compute capability 8.9 or newer: Ada, Hopper, Blackwell). Run without --fp8 / fp8=False "
    "to train the plain PyTorch model."
)


def _import_te() -> Any:
    """``transformer_engine.pytorch``, imported lazily, or :class:`TransformerEngineUnavailable`."""
    try:
        import transformer_engine.pytorch as te  # optional dependency
    except Exception as exc:  # ImportError, or TE's own errors when its extension does not load
        raise TransformerEngineUnavailable(f"TransformerEngine is not available ({exc}). {_TE_HINT}") from exc
    return te


def _te_version(te: Any) -> tuple[int, int]:
    import transformer_engine

    parts = str(getattr(transformer_engine, "__version__", "0.0")).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def _default_fp8_recipe(te: Any) -> Any:
    """TE's default FP8 recipe for this GPU, made once so weight init and autocast use the same object."""
    for owner in (getattr(te, "quantization", None), getattr(te, "fp8", None)):
        make = getattr(owner, "get_default_fp8_recipe", None)
        if make is not None:
            return make()
    from transformer_engine.common.recipe import DelayedScaling

    return DelayedScaling()


def _te_primary_weight_context(te: Any, recipe: Any | None) -> Any:
    """TE's FP8 primary-weight init context: ``quantized_model_init`` (2.x) or ``fp8_model_init`` (1.x)."""
    if hasattr(te, "quantized_model_init"):
        return te.quantized_model_init(enabled=True, recipe=recipe)
    if recipe is not None:
        try:
            return te.fp8_model_init(enabled=True, recipe=recipe)
        except TypeError:  # TE < 1.11: no recipe argument
            pass
    return te.fp8_model_init(enabled=True)


def _te_autocast(te: Any, recipe: Any | None) -> Any:
    """TE's FP8 autocast: ``te.autocast`` (2.x) or ``te.fp8_autocast`` (1.x)."""
    if hasattr(te, "autocast") and hasattr(te, "quantized_model_init"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


class TEGPT(nn.Module):
    """:class:`GPT` with its blocks replaced by ``te.TransformerLayer`` holding FP8 primary weights.

    Embeddings, the final LayerNorm and the tied head stay in plain PyTorch (``params_dtype``). The block
    weights are ``Float8Tensor`` parameters (built under TE's FP8 primary-weight init): after every optimizer
    step their cached transposes are stale until refreshed, which is what
    ``nemo_cudagraph_plugin.lightning.fp8_callback.Fp8TransposeRefresh`` does. ``forward`` runs the blocks
    under TE's FP8 autocast with ``recipe`` (TE's default recipe when ``None``). CUDA only.
    """

    def __init__(self, cfg: GPTConfig, *, recipe: Any | None = None,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        te = _import_te()
        if not torch.cuda.is_available():
            raise TransformerEngineUnavailable(f"no CUDA device is visible. {_TE_HINT}")
        ok, reason = _fp8_available(te)
        if not ok:
            raise TransformerEngineUnavailable(f"this GPU cannot run FP8 ({reason}). {_TE_HINT}")
        # TE's FP8 GEMMs need both GEMM dimensions divisible by 16.
        if cfg.n_embd % 16 or (cfg.mlp_ratio * cfg.n_embd) % 16:
            raise ValueError(f"FP8 needs n_embd and mlp_ratio*n_embd divisible by 16 (n_embd={cfg.n_embd})")
        self.config = cfg
        self.te_version = _te_version(te)
        recipe = _default_fp8_recipe(te) if recipe is None else recipe
        self.fp8_recipe = recipe
        device = torch.device("cuda", torch.cuda.current_device())
        self.emb = _Embeddings(cfg, device=device, dtype=params_dtype)
        std = cfg.init_std
        out_std = std / math.sqrt(2 * cfg.n_layer)
        with _te_primary_weight_context(te, recipe):
            self.blocks = nn.ModuleList(
                te.TransformerLayer(
                    cfg.n_embd,
                    cfg.mlp_ratio * cfg.n_embd,
                    cfg.n_head,
                    hidden_dropout=cfg.dropout,
                    attention_dropout=cfg.dropout,
                    init_method=lambda w: nn.init.normal_(w, 0.0, std),
                    output_layer_init_method=lambda w: nn.init.normal_(w, 0.0, out_std),
                    layer_number=i + 1,
                    self_attn_mask_type="causal",
                    fuse_qkv_params=True,
                    bias=cfg.bias,
                    activation="gelu",
                    params_dtype=params_dtype,
                    device="cuda",
                )
                for i in range(cfg.n_layer)
            )
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias, device=device, dtype=params_dtype)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False, device=device, dtype=params_dtype)
        nn.init.normal_(self.emb.tok.weight, 0.0, std)
        nn.init.normal_(self.emb.pos.weight, 0.0, std)
        self.head.weight = self.emb.tok.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        if (b * t) % 16:  # shape check only
            raise ValueError(f"FP8 needs batch*seq_len divisible by 16, got {b}*{t}; change --batch-size/--seq-len")
        x = self.emb(input_ids).transpose(0, 1).contiguous()  # TE's default layout is [seq, batch, hidden]
        with _te_autocast(_import_te(), self.fp8_recipe):  # a sys.modules lookup after the first call
            for block in self.blocks:
                x = block(x)
        return self.head(self.ln_f(x.transpose(0, 1)))


def _fp8_available(te: Any) -> tuple[bool, str]:
    check = getattr(te, "is_fp8_available", None)
    if check is not None:
        try:
            ok, reason = check(return_reason=True)
            return bool(ok), str(reason)
        except TypeError:
            return bool(check()), "is_fp8_available() is False"
    fp8 = getattr(te, "fp8", None)
    legacy = getattr(getattr(fp8, "FP8GlobalStateManager", None), "is_fp8_available", None)
    if legacy is not None:
        ok, reason = legacy()
        return bool(ok), str(reason)
    return True, ""


def build_model(cfg: GPTConfig, *, fp8: bool = False, fp8_recipe: Any | None = None) -> nn.Module:
    """:class:`GPT`, or :class:`TEGPT` when ``fp8`` (raises :class:`TransformerEngineUnavailable` if TE or an
    FP8-capable GPU is missing)."""
    return TEGPT(cfg, recipe=fp8_recipe) if fp8 else GPT(cfg)


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer and data
# ---------------------------------------------------------------------------------------------------------------


class ByteTokenizer:
    """Byte-level tokenizer: a token is one byte of the UTF-8 encoding, so ``vocab_size == 256``.

    Deterministic, needs no vocabulary file, and round-trips any ``str`` exactly
    (``decode(encode(s)) == s``). Token ids that do not form valid UTF-8 decode to U+FFFD.
    """

    vocab_size: int = 256

    def encode(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else bytes(text))

    def encode_tensor(self, text: str | bytes) -> torch.Tensor:
        """``torch.uint8`` tensor of the bytes of ``text`` (one copy, no Python loop)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        ids = list(ids)
        bad = [i for i in ids if not 0 <= int(i) < 256]
        if bad:
            raise ValueError(f"ByteTokenizer ids must be in [0, 256), got {bad[:5]}")
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


EMBEDDED_CORPUS_NAME = "corpus.txt.gz"
EMBEDDED_CORPUS_SHA256 = "4269f1deab32be846cdaf3d18b318e488a802342a75a9c3763a208d65a338241"
"""SHA-256 of the decompressed embedded corpus (KJV Genesis-Deuteronomy, see recipes/data/README.md)."""


def load_embedded_corpus(*, verify: bool = True) -> bytes:
    """The embedded public-domain corpus as UTF-8 bytes (``recipes/data`` of the checkout; no network)."""
    raw = (Path(__file__).resolve().parent / "data" / EMBEDDED_CORPUS_NAME).read_bytes()
    data = gzip.decompress(raw)
    if verify and hashlib.sha256(data).hexdigest() != EMBEDDED_CORPUS_SHA256:
        raise RuntimeError(
            f"recipes/data/{EMBEDDED_CORPUS_NAME} does not match its recorded SHA-256; restore it from the repository"
        )
    return data


def _compact(tokens: torch.Tensor) -> torch.Tensor:
    """Smallest integer dtype holding ``tokens`` (memory for big token files; windows are cast to long)."""
    if tokens.numel() == 0:
        return tokens.to(torch.int64)
    hi = int(tokens.max())
    if hi < 256:
        return tokens.to(torch.uint8)
    if hi < 2**31:
        return tokens.to(torch.int32)
    return tokens.to(torch.int64)


def load_tokens(path: str | Path | None = None, *, vocab_size: int | None = None) -> tuple[torch.Tensor, int]:
    """Load a 1-D token tensor and its vocabulary size.

    * ``None``: the embedded corpus, byte-tokenized (vocab 256).
    * ``*.pt`` / ``*.pth``: ``torch.save`` of a 1-D integer tensor (or of a dict with key ``"tokens"``).
    * ``*.npy``: a 1-D integer NumPy array.
    * anything else: a text file (``*.gz`` is decompressed), byte-tokenized (vocab 256).

    ``vocab_size`` defaults to the tokenizer's (text) or ``max(token) + 1`` (token files); a given value must
    exceed every token id. Raises ``ValueError`` / ``FileNotFoundError`` with what to change.
    """
    if path is None:
        tokens = ByteTokenizer().encode_tensor(load_embedded_corpus())
        return _check_vocab(tokens, ByteTokenizer.vocab_size if vocab_size is None else vocab_size, "corpus")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist (pass a text, .pt or .npy file)")
    suffix = path.suffix.lower()
    if suffix in (".pt", ".pth"):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(obj, dict) and "tokens" in obj:
            obj = obj["tokens"]
        if not isinstance(obj, torch.Tensor):
            raise ValueError(f"{path} must hold a 1-D integer tensor (or {{'tokens': tensor}}), got {type(obj).__name__}")
        tokens = obj
    elif suffix == ".npy":
        try:
            import numpy as np  # only needed for .npy token files
        except ImportError as exc:
            raise ValueError(f"reading {path} needs numpy (pip install numpy)") from exc
        arr = np.load(path, allow_pickle=False)
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{path} must hold integer token ids, got dtype {arr.dtype}")
        tokens = torch.from_numpy(np.ascontiguousarray(arr).astype(np.int64, copy=False))
    else:
        raw = path.read_bytes()
        if suffix == ".gz":
            raw = gzip.decompress(raw)
        tokens = ByteTokenizer().encode_tensor(raw)
        return _check_vocab(tokens, ByteTokenizer.vocab_size if vocab_size is None else vocab_size, str(path))
    if tokens.dim() != 1:
        raise ValueError(f"{path} must hold a 1-D token tensor, got shape {tuple(tokens.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"{path} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.numel() == 0:
        raise ValueError(f"{path} holds no tokens")
    lo = int(tokens.min())
    if lo < 0:
        raise ValueError(f"{path} holds negative token id {lo}; token ids must be >= 0")
    if vocab_size is None:
        vocab_size = int(tokens.max()) + 1
    return _check_vocab(tokens, vocab_size, str(path))


def _check_vocab(tokens: torch.Tensor, vocab_size: int, what: str) -> tuple[torch.Tensor, int]:
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise ValueError(
            f"{what} holds token id {int(tokens.max())} but vocab_size is {vocab_size}; pass a larger vocab size"
        )
    return _compact(tokens), int(vocab_size)


def split_tokens(tokens: torch.Tensor, seq_len: int, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic split: the first ``1 - val_fraction`` of the stream trains, the tail validates.

    A contiguous split (not random windows) so no validation text is ever seen in training. The validation
    part holds at least one window (``seq_len + 1`` tokens) when ``val_fraction > 0``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n, need = tokens.numel(), seq_len + 1
    n_val = 0 if val_fraction == 0 else max(need, int(n * val_fraction))
    if n - n_val < need:
        raise ValueError(
            f"the data has {n} tokens: too few for seq_len={seq_len} with a validation split "
            f"(needs at least {need + (need if n_val else 0)}); use a smaller --seq-len or more data"
        )
    return tokens[: n - n_val], tokens[n - n_val :]


class TokenDataset(Dataset):
    """Windows of ``seq_len + 1`` tokens from a 1-D token tensor, as :data:`Batch` items.

    ``mode="sequential"``: non-overlapping windows at offsets ``0, seq_len, 2*seq_len, ...`` (validation).
    ``mode="random"``: ``num_samples`` windows at offsets drawn once from ``torch.Generator`` seeded with
    ``seed``, so item ``i`` is the same window on every run with the same seed (training).
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, *, mode: Literal["random", "sequential"] = "random",
                 num_samples: int | None = None, seed: int = 0) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        n_windows = (tokens.numel() - 1) // seq_len
        if n_windows < 1:
            raise ValueError(f"{tokens.numel()} tokens are too few for one window of seq_len={seq_len} (+1)")
        self.tokens, self.seq_len, self.mode = tokens, seq_len, mode
        if mode == "sequential":
            count = n_windows if num_samples is None else min(num_samples, n_windows)
            self.offsets = torch.arange(count, dtype=torch.int64) * seq_len
        elif mode == "random":
            count = n_windows if num_samples is None else num_samples
            if count < 1:
                raise ValueError(f"num_samples must be >= 1, got {count}")
            g = torch.Generator().manual_seed(seed)
            self.offsets = torch.randint(0, tokens.numel() - seq_len, (count,), generator=g, dtype=torch.int64)
        else:
            raise ValueError(f"mode must be 'random' or 'sequential', got {mode!r}")

    def __len__(self) -> int:
        return self.offsets.numel()

    def __getitem__(self, index: int) -> Batch:
        o = int(self.offsets[index])
        window = self.tokens[o : o + self.seq_len + 1].to(torch.long)
        return {"input_ids": window[:-1], "labels": window[1:]}


class GPTDataModule(pl.LightningDataModule):
    """Train/val dataloaders over the embedded corpus (``data=None``) or a text / ``.pt`` / ``.npy`` file.

    Tokens are loaded once (:func:`load_tokens`) at construction, so :attr:`vocab_size` is known before the
    model is built. The split is :func:`split_tokens` (deterministic, independent of ``seed``); training items
    are ``train_samples`` random windows fixed by ``seed`` (default: as many as non-overlapping windows fit),
    served in order (``shuffle=False``) with ``drop_last=True`` so every batch has the same shape — required
    for CUDA-graph replay. Validation uses the first ``val_samples`` sequential windows of the tail.
    """

    def __init__(self, data: str | Path | None = None, *, seq_len: int = 256, batch_size: int = 2,
                 val_fraction: float = 0.05, train_samples: int | None = None, val_samples: int | None = None,
                 seed: int = 0, num_workers: int = 0, vocab_size: int | None = None,
                 pin_memory: bool | None = None) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.data = data
        self.seq_len, self.batch_size = seq_len, batch_size
        self.val_fraction, self.seed, self.num_workers = val_fraction, seed, num_workers
        self.train_samples, self.val_samples = train_samples, val_samples
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.tokens, self.vocab_size = load_tokens(data, vocab_size=vocab_size)
        self.train_tokens, self.val_tokens = split_tokens(self.tokens, seq_len, val_fraction)
        self.train_dataset = TokenDataset(self.train_tokens, seq_len, mode="random",
                                          num_samples=train_samples, seed=seed)
        if len(self.train_dataset) < batch_size:
            raise ValueError(f"only {len(self.train_dataset)} training windows for batch_size={batch_size}")
        self.val_dataset = (
            TokenDataset(self.val_tokens, seq_len, mode="sequential", num_samples=val_samples)
            if self.val_tokens.numel() > seq_len else None
        )

    @property
    def source(self) -> str:
        return "embedded corpus (KJV Genesis-Deuteronomy)" if self.data is None else str(self.data)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.num_workers, pin_memory=self.pin_memory)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            return []
        return DataLoader(self.val_dataset, batch_size=self.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.num_workers, pin_memory=self.pin_memory)


# ---------------------------------------------------------------------------------------------------------------
# LightningModule
# ---------------------------------------------------------------------------------------------------------------


class GPTLightningModule(pl.LightningModule):
    """A standard LightningModule around :class:`GPT` / :class:`TEGPT`; nothing in it knows about CUDA graphs.

    ``training_step`` returns the loss and logs ``train_loss`` (progress bar); ``validation_step`` logs
    ``val_loss``. ``configure_optimizers``: AdamW (weight decay on >= 2-D weights only; with ``fp8``,
    :class:`nemo_cudagraph_plugin.fp8.MasterWeightAdamW`, the same update on FP32 masters) and, when
    ``warmup_steps > 0`` or ``max_steps`` is given, a ``LambdaLR`` stepped every optimizer step (linear warm-up
    to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at ``max_steps``).
    """

    def __init__(self, config: GPTConfig | None = None, *, model: nn.Module | None = None, lr: float = 6e-4,
                 weight_decay: float = 0.1, betas: Sequence[float] = (0.9, 0.95), warmup_steps: int = 0,
                 max_steps: int | None = None, min_lr_ratio: float = 0.1, fp8: bool = False,
                 fp8_recipe: Any | None = None) -> None:
        super().__init__()
        if config is None:
            config = getattr(model, "config", None) or PRESETS["tiny"]
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if warmup_steps < 0 or (max_steps is not None and max_steps < 1):
            raise ValueError(f"warmup_steps must be >= 0 and max_steps >= 1 (got {warmup_steps}, {max_steps})")
        self.config = config
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.max_steps, self.min_lr_ratio = warmup_steps, max_steps, min_lr_ratio
        self.fp8 = fp8
        self.save_hyperparameters({"config": config.as_dict(), "lr": lr, "weight_decay": weight_decay,
                                   "betas": list(self.betas), "warmup_steps": warmup_steps,
                                   "max_steps": max_steps, "min_lr_ratio": min_lr_ratio, "fp8": fp8})
        self.model = model if model is not None else build_model(config, fp8=fp8, fp8_recipe=fp8_recipe)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = gpt_loss(self(batch["input_ids"]), batch["labels"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = gpt_loss(self(batch["input_ids"]), batch["labels"])
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def lr_lambda(self, step: int) -> float:
        """LR multiplier at optimizer step ``step`` (used by the ``LambdaLR``)."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.max_steps is None:
            return 1.0
        span = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def configure_optimizers(self) -> Any:
        decay, no_decay = [], []
        for p in self.parameters():  # parameters() dedups the tied embedding/head weight
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": self.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        if self.fp8:
            # FP8 primary weights need FP32 masters (torch's AdamW would round each update back to FP8)
            from nemo_cudagraph_plugin.fp8 import MasterWeightAdamW

            optimizer: torch.optim.Optimizer = MasterWeightAdamW(groups, lr=self.lr, betas=self.betas)
        else:
            optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        if not self.warmup_steps and self.max_steps is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
