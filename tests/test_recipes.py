"""CPU tests of the GPT recipe: tokenizer, data, model, LightningModule, CLI, and short eager training runs."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from recipes import gpt
from recipes import gpt_pretrain as cli
from recipes.gpt import (
    GPT,
    PRESETS,
    ByteTokenizer,
    GPTConfig,
    GPTDataModule,
    GPTLightningModule,
    TokenDataset,
    TransformerEngineUnavailable,
    build_model,
    get_config,
    gpt_loss,
    load_embedded_corpus,
    load_tokens,
    split_tokens,
)

DATA_DIR = Path(gpt.__file__).parent / "data"
# Small-but-real CLI settings: tiny preset, short sequences, no progress bar.
FAST = ["--preset", "tiny", "--seq-len", "32", "--val-batches", "1", "--log-every", "0"]


def _need_matplotlib() -> None:
    """Skip without matplotlib, except in CI's unit stage (NCG_REQUIRE_PLOT=1), which installs the plot extra."""
    if os.environ.get("NCG_REQUIRE_PLOT") == "1":
        import matplotlib  # noqa: F401  (an ImportError fails the test: the stage promised matplotlib)
    else:
        pytest.importorskip("matplotlib")


def _png_text(path: Path) -> dict[str, str]:
    """The text chunks (Title, Description) that plot_compare writes into the PNG."""
    from PIL import Image  # a matplotlib dependency

    with Image.open(path) as img:
        return dict(img.text)


def _plugin_importable() -> bool:
    try:
        from nemo_cudagraph_plugin import CudaGraphCallback, CudaGraphStrategy  # noqa: F401
    except ImportError:
        return False
    return True


def _small_cfg(**kw) -> GPTConfig:
    base = dict(n_layer=2, n_embd=32, n_head=2, seq_len=16, batch_size=2, vocab_size=64)
    base.update(kw)
    return GPTConfig(**base)


# --------------------------------------------------------------------------------------------- tokenizer, corpus


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "In the beginning — naïve café ✓ 🚀\nline two\t"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < tok.vocab_size for i in ids) and tok.vocab_size == 256
    assert tok.decode(ids) == text
    t = tok.encode_tensor(text)
    assert t.dtype == torch.uint8 and t.tolist() == ids
    assert tok.decode(t) == text
    assert tok.encode_tensor("").numel() == 0
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([65, 300])


def test_embedded_corpus_is_packaged_and_needs_no_network(monkeypatch):
    gz = DATA_DIR / "corpus.txt.gz"
    assert gz.is_file() and gz.stat().st_size < 500_000
    assert (DATA_DIR / "README.md").read_text().count("public domain") >= 1

    def no_network(*a, **k):
        raise AssertionError("the embedded corpus must load without the network")

    monkeypatch.setattr(socket, "socket", no_network)
    data = load_embedded_corpus()
    assert len(data) == 845_214
    assert data.startswith(b"Genesis 1\n\n  1 In the beginning God created the heaven and the earth.")
    assert data.rstrip().endswith(b"shewed in the sight of all Israel.")
    tokens, vocab = load_tokens(None)
    assert vocab == 256 and tokens.numel() == len(data) and tokens.dtype == torch.uint8


def test_embedded_corpus_checksum_is_enforced(monkeypatch):
    monkeypatch.setattr(gpt, "EMBEDDED_CORPUS_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="SHA-256"):
        load_embedded_corpus()
    assert len(load_embedded_corpus(verify=False)) == 845_214


# --------------------------------------------------------------------------------------------- dataset, datamodule


def test_token_dataset_windows_and_shapes():
    tokens = torch.arange(101, dtype=torch.int32)
    seq = TokenDataset(tokens, 10, mode="sequential")
    assert len(seq) == 10
    item = seq[3]
    assert set(item) == {"input_ids", "labels"}
    assert item["input_ids"].shape == (10,) and item["input_ids"].dtype == torch.long
    assert item["input_ids"].tolist() == list(range(30, 40))
    assert item["labels"].tolist() == list(range(31, 41))

    rnd = TokenDataset(tokens, 10, mode="random", num_samples=50, seed=7)
    assert len(rnd) == 50
    for i in range(50):
        it = rnd[i]
        assert torch.equal(it["labels"][:-1], it["input_ids"][1:])
        assert int(it["labels"][-1]) <= 100  # never reads past the end
    same = TokenDataset(tokens, 10, mode="random", num_samples=50, seed=7)
    other = TokenDataset(tokens, 10, mode="random", num_samples=50, seed=8)
    assert torch.equal(rnd.offsets, same.offsets)
    assert not torch.equal(rnd.offsets, other.offsets)
    with pytest.raises(ValueError, match="too few"):
        TokenDataset(torch.arange(10), 10)
    with pytest.raises(ValueError, match="mode"):
        TokenDataset(tokens, 10, mode="shuffled")


def test_split_is_contiguous_and_deterministic():
    tokens = torch.arange(1000)
    train, val = split_tokens(tokens, seq_len=16, val_fraction=0.1)
    assert train.numel() == 900 and val.numel() == 100
    assert torch.equal(torch.cat([train, val]), tokens)
    train2, val2 = split_tokens(tokens, seq_len=16, val_fraction=0.1)
    assert torch.equal(train, train2) and torch.equal(val, val2)
    # the validation tail always holds a full window
    _, v = split_tokens(tokens, seq_len=200, val_fraction=0.01)
    assert v.numel() == 201
    with pytest.raises(ValueError, match="--seq-len"):
        split_tokens(torch.arange(50), seq_len=40)


def test_datamodule_split_and_batches_are_deterministic():
    a = GPTDataModule(seq_len=32, batch_size=4, seed=3, train_samples=12, val_samples=8)
    b = GPTDataModule(seq_len=32, batch_size=4, seed=3, train_samples=12, val_samples=8)
    c = GPTDataModule(seq_len=32, batch_size=4, seed=4, train_samples=12, val_samples=8)
    assert a.vocab_size == 256
    # split independent of the seed; training windows fixed by the seed
    assert torch.equal(a.val_tokens, c.val_tokens) and torch.equal(a.train_tokens, c.train_tokens)
    assert a.train_tokens.numel() + a.val_tokens.numel() == 845_214
    batches_a, batches_b = list(a.train_dataloader()), list(b.train_dataloader())
    assert len(batches_a) == 3
    for x, y in zip(batches_a, batches_b):
        assert x["input_ids"].shape == (4, 32) and x["labels"].shape == (4, 32)
        assert torch.equal(x["input_ids"], y["input_ids"])
    assert not torch.equal(batches_a[0]["input_ids"], next(iter(c.train_dataloader()))["input_ids"])
    val = list(a.val_dataloader())
    assert len(val) == 2 and val[0]["input_ids"].shape == (4, 32)
    # validation windows come from the tail only
    first_val = a.val_tokens[:32].long()
    assert torch.equal(val[0]["input_ids"][0], first_val)


def test_datamodule_drops_incomplete_batches():
    dm = GPTDataModule(seq_len=16, batch_size=4, train_samples=10)
    assert [b["input_ids"].shape[0] for b in dm.train_dataloader()] == [4, 4]


def test_load_tokens_from_files(tmp_path):
    txt = tmp_path / "t.txt"
    txt.write_text("hello world ✓")
    toks, vocab = load_tokens(txt)
    assert vocab == 256 and ByteTokenizer().decode(toks) == "hello world ✓"
    gz = tmp_path / "t.txt.gz"
    gz.write_bytes(gzip.compress(b"abcabc"))
    assert load_tokens(gz)[0].tolist() == [97, 98, 99, 97, 98, 99]

    pt = tmp_path / "t.pt"
    torch.save(torch.tensor([5, 1, 1000, 7]), pt)
    toks, vocab = load_tokens(pt)
    assert vocab == 1001 and toks.tolist() == [5, 1, 1000, 7] and toks.dtype == torch.int32
    torch.save({"tokens": torch.tensor([1, 2, 3])}, pt)
    toks, vocab = load_tokens(pt, vocab_size=10)
    assert toks.tolist() == [1, 2, 3] and vocab == 10

    npy = tmp_path / "t.npy"
    np.save(npy, np.array([3, 4, 5], dtype=np.uint16))
    toks, vocab = load_tokens(npy)
    assert vocab == 6 and toks.tolist() == [3, 4, 5]


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (torch.zeros(2, 3, dtype=torch.long), "1-D"),
        (torch.tensor([0.5, 1.0]), "integer"),
        (torch.tensor([1, -2, 3]), "negative"),
        ([1, 2, 3], "1-D integer tensor"),
    ],
)
def test_load_tokens_rejects_bad_token_files(tmp_path, payload, match):
    pt = tmp_path / "bad.pt"
    torch.save(payload, pt)
    with pytest.raises(ValueError, match=match):
        load_tokens(pt)


def test_load_tokens_other_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokens(tmp_path / "missing.txt")
    pt = tmp_path / "t.pt"
    torch.save(torch.tensor([1, 50]), pt)
    with pytest.raises(ValueError, match="vocab"):
        load_tokens(pt, vocab_size=20)
    npy = tmp_path / "f.npy"
    np.save(npy, np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="integer"):
        load_tokens(npy)


# --------------------------------------------------------------------------------------------- config, model


def test_presets_match_the_spec():
    shape = {k: (c.n_layer, c.n_embd, c.n_head, c.seq_len, c.batch_size, c.dropout) for k, c in PRESETS.items()}
    assert shape == {
        "tiny": (4, 256, 4, 256, 2, 0.0),
        "small": (12, 768, 12, 512, 4, 0.0),
        "medium": (24, 1024, 16, 1024, 8, 0.0),
    }
    cfg = get_config("small", seq_len=128, batch_size=None, dropout=0.1)
    assert (cfg.n_layer, cfg.seq_len, cfg.batch_size, cfg.dropout) == (12, 128, 4, 0.1)
    with pytest.raises(ValueError, match="unknown preset"):
        get_config("huge")


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"n_embd": 30, "n_head": 4}, "divisible"), ({"dropout": 1.0}, "dropout"), ({"n_layer": 0}, "n_layer")],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        _small_cfg(**kw)


def test_num_params_matches_model():
    cfg = _small_cfg()
    model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert model.head.weight is model.emb.tok.weight  # tied


def test_model_forward_backward_cpu():
    torch.manual_seed(0)
    cfg = _small_cfg()
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    logits = model(x)
    assert logits.shape == (3, cfg.seq_len, cfg.vocab_size)
    loss = gpt_loss(logits, y)
    assert loss.dtype == torch.float32 and abs(loss.item() - math.log(cfg.vocab_size)) < 0.5
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    # shorter inputs are fine, longer ones are refused with a clear message
    assert model(x[:, :5]).shape == (3, 5, cfg.vocab_size)
    with pytest.raises(ValueError, match="position table"):
        model(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))


def test_model_is_causal():
    torch.manual_seed(0)
    cfg = _small_cfg()
    model = GPT(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    x2 = x.clone()
    x2[0, 10:] = (x2[0, 10:] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_forward_traces_without_graph_breaks():
    """No host sync and no value-dependent control flow: Dynamo traces forward+loss as one graph.

    (A proxy for CUDA-graph capturability that runs on CPU: ``.item()`` or ``if tensor:`` would break it.)
    """
    cfg = _small_cfg(dropout=0.1)
    model = GPT(cfg).train()

    def step(x, y):
        return gpt_loss(model(x), y)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    loss = compiled(x, x)
    loss.backward()
    assert torch.isfinite(loss)


def test_fp8_model_without_te_gives_clear_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(TransformerEngineUnavailable, match=r"TransformerEngine.*transformer-engine\[pytorch\]"):
        build_model(_small_cfg(), fp8=True)
    assert isinstance(build_model(_small_cfg()), GPT)


def test_te_api_selection_by_version_shape():
    calls = []

    def ctx(name):
        def f(**kw):
            calls.append((name, kw))
            return name
        return f

    te2 = SimpleNamespace(quantized_model_init=ctx("quantized_model_init"), fp8_model_init=ctx("fp8_model_init"),
                          autocast=ctx("autocast"), fp8_autocast=ctx("fp8_autocast"))
    assert gpt._te_primary_weight_context(te2, "R") == "quantized_model_init"
    assert gpt._te_autocast(te2, "R") == "autocast"
    assert calls[-1] == ("autocast", {"enabled": True, "recipe": "R"})
    te1 = SimpleNamespace(fp8_model_init=ctx("fp8_model_init"), fp8_autocast=ctx("fp8_autocast"))
    assert gpt._te_primary_weight_context(te1, None) == "fp8_model_init"
    assert calls[-1] == ("fp8_model_init", {"enabled": True})
    assert gpt._te_autocast(te1, "R") == "fp8_autocast"
    assert calls[-1] == ("fp8_autocast", {"enabled": True, "fp8_recipe": "R"})

    def old_init(enabled=True):  # TE < 1.11: no recipe argument
        calls.append(("old", enabled))
        return "old"

    assert gpt._te_primary_weight_context(SimpleNamespace(fp8_model_init=old_init), "R") == "old"


# --------------------------------------------------------------------------------------------- LightningModule


def test_configure_optimizers_and_schedule():
    module = GPTLightningModule(_small_cfg(), lr=1e-3, weight_decay=0.1, warmup_steps=10, max_steps=110,
                                min_lr_ratio=0.1)
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]
    assert isinstance(opt, torch.optim.AdamW) and sched["interval"] == "step"
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    n_opt = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n_opt == module.config.num_params()  # tied weight optimised once
    assert module.lr_lambda(0) == pytest.approx(0.1)
    assert module.lr_lambda(9) == pytest.approx(1.0)
    assert module.lr_lambda(10) == pytest.approx(1.0)
    assert module.lr_lambda(60) == pytest.approx(0.55)
    assert module.lr_lambda(110) == pytest.approx(0.1)
    assert module.lr_lambda(500) == pytest.approx(0.1)
    plain = GPTLightningModule(_small_cfg()).configure_optimizers()
    assert isinstance(plain, torch.optim.AdamW)


def test_fp8_weights_train_under_the_fp32_master_adamw_with_the_same_groups_and_schedule():
    from nemo_cudagraph_plugin.fp8 import MasterWeightAdamW

    model = gpt.GPT(_small_cfg())  # the FP8 model needs TE; the optimizer choice follows the fp8 flag
    module = GPTLightningModule(model=model, fp8=True, lr=1e-3, weight_decay=0.1, warmup_steps=10, max_steps=110)
    conf = module.configure_optimizers()
    opt = conf["optimizer"]
    assert isinstance(opt, MasterWeightAdamW) and not isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0 and decay["betas"] == (0.9, 0.95)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert float(decay["lr"]) == pytest.approx(1e-4)  # the LambdaLR's first warm-up step


def test_training_step_returns_and_logs_loss(monkeypatch):
    module = GPTLightningModule(_small_cfg())
    logged = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kw: logged.setdefault(name, (value, kw)))
    x = torch.randint(0, 64, (2, 16))
    loss = module.training_step({"input_ids": x, "labels": x}, 0)
    assert loss.requires_grad and loss.dim() == 0
    assert logged["train_loss"][0] is loss and logged["train_loss"][1] == {"prog_bar": True}
    with torch.no_grad():
        module.validation_step({"input_ids": x, "labels": x}, 0)
    assert "val_loss" in logged


# --------------------------------------------------------------------------------------------- CLI


def test_cli_defaults_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cli.parse_args([])
    assert args.cuda_graph is False and args.precision == "32-true" and args.preset == "tiny"
    assert args.strategy == "callback" and args.compare is False and args.fp8 is False
    # CPU: fewer steps by default (the job finishes in about a minute), so the LR warm-up is shorter too
    assert args.steps == cli.CPU_DEFAULT_STEPS == 50 and args.steps_defaulted is True
    assert args.lr_warmup_steps == 5 and args.graph_warmup_steps == 3 and args.timing_skip == 5
    assert args.config == PRESETS["tiny"]
    assert cli.parse_args(["--steps", "200"]).steps_defaulted is False
    assert cli.parse_args(["--cuda-graph"]).cuda_graph is True
    assert cli.parse_args(["--no-cuda-graph"]).cuda_graph is False


def test_cli_defaults_on_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = cli.parse_args([])
    assert args.steps == cli.GPU_DEFAULT_STEPS == 200 and args.lr_warmup_steps == 20
    assert args.cuda_graph is True and args.precision == "bf16-mixed"


def test_cli_flags_parse(capsys):
    args = cli.parse_args([
        "--preset", "medium", "--steps", "7", "--batch-size", "3", "--seq-len", "64", "--seed", "9",
        "--strategy", "strategy", "--compare", "--lr", "1e-3", "--dropout", "0.1", "--precision", "bf16-mixed",
        "--out", "x", "--devices", "1", "--data", "f.txt", "--graph-warmup-steps", "1", "--lr-warmup-steps", "2",
    ])
    assert (args.config.n_layer, args.config.batch_size, args.config.seq_len, args.config.dropout) == (24, 3, 64, 0.1)
    assert (args.steps, args.seed, args.strategy, args.compare, args.lr) == (7, 9, "strategy", True, 1e-3)
    assert (args.precision, args.out, args.data) == ("bf16-mixed", "x", "f.txt")
    assert (args.lr_warmup_steps, args.graph_warmup_steps) == (2, 1)
    assert args.timing_skip == 3  # graph warm-up 1 + capture + 1
    assert cli.parse_args(["--steps", "3"]).timing_skip == 2  # always leaves a step to time
    assert capsys.readouterr().err == ""  # the new spellings print no deprecation notice


def test_cli_old_warmup_spellings_still_work_and_say_what_to_type(capsys):
    args = cli.parse_args(["--warmup-steps", "7", "--graph-warmup", "2"])
    assert (args.lr_warmup_steps, args.graph_warmup_steps) == (7, 2)
    err = capsys.readouterr().err
    assert "--warmup-steps is deprecated, use --lr-warmup-steps" in err
    assert "--graph-warmup is deprecated, use --graph-warmup-steps" in err


def test_cli_graph_warmup_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--graph-warmup-steps", "0"])
    err = capsys.readouterr().err
    assert "--graph-warmup-steps" in err and "must be >= 1" in err


@pytest.mark.parametrize(
    "argv",
    [["--strategy", "both"], ["--preset", "huge"], ["--steps", "0"], ["--batch-size", "-1"], ["--bogus"]],
)
def test_cli_rejects_bad_flags(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_help_answers_before_torch_is_imported():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "recipes.gpt_pretrain", "--help"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert out.returncode == 0 and "--preset" in out.stdout
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "lightning" not in imported, sorted(imported)


def test_cli_says_what_a_bad_number_should_be(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--steps", "abc"])
    err = capsys.readouterr().err
    assert "--steps: expected a whole number, got 'abc'" in err and "_positive_int" not in err


def test_cli_labels_16_mixed_on_a_cpu_with_the_precision_it_trains(monkeypatch):
    """Lightning trains 16-mixed as bf16-mixed on a CPU: the banner and results.json say bf16-mixed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cli.parse_args(["--precision", "16-mixed"])
    assert args.precision == "bf16-mixed" and "trains bf16-mixed" in args.precision_note
    assert cli.parse_args(["--precision", "32-true"]).precision_note is None


@pytest.mark.parametrize(
    ("argv", "match"),
    [(["--dropout", "1.5"], "--dropout"), (["--compare", "--devices", "2"], "--devices 1"),
     (["--devices", "2"], "GPUs"), (["--lr", "0"], "--lr")],
)
def test_cli_rejects_bad_combinations(argv, match):
    with pytest.raises(cli.RecipeError, match=match):
        cli.parse_args(argv)


def test_help_lists_every_flag_and_the_preset_sizes(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    out = capsys.readouterr().out
    for flag in ("--cuda-graph", "--no-cuda-graph", "--strategy", "--fp8", "--preset", "--steps", "--batch-size",
                 "--seq-len", "--seed", "--compare", "--data", "--lr", "--dropout", "--precision", "--out",
                 "--devices", "--lr-warmup-steps", "--graph-warmup-steps"):
        assert flag in out, flag
    # the ambiguous old spellings are hidden (they still parse, see above)
    assert "--warmup-steps " not in out and "--graph-warmup " not in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()[:1] in (["tiny"], ["small"], ["medium"])}
    assert set(rows) == set(PRESETS)
    for name, cfg in PRESETS.items():
        layers, d_model, heads, seq, batch, params = rows[name]
        assert (int(layers), int(d_model), int(heads), int(seq), int(batch)) == (
            cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.seq_len, cfg.batch_size)
        assert params == f"{cfg.replace(vocab_size=256).num_params() / 1e6:.1f}M"
    assert "50 on a CPU-only machine" in out


def test_fp8_flag_without_te_gives_clear_message(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    rc = cli.main(["--fp8", *FAST, "--steps", "2", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "TransformerEngine" in err and "pip install" in err
    assert not (tmp_path / "results.json").exists()


def test_cuda_graph_flag_without_plugin_gives_clear_message(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "nemo_cudagraph_plugin", None)
    rc = cli.main(["--cuda-graph", *FAST, "--steps", "2", "--out", str(tmp_path)])
    assert rc == 2
    assert "--no-cuda-graph" in capsys.readouterr().err


def test_bad_data_path_gives_clear_message(capsys, tmp_path):
    rc = cli.main([*FAST, "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path)])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- end-to-end (CPU)


def test_recipe_trains_eagerly_on_cpu(capsys, tmp_path):
    rc = cli.main([*FAST, "--steps", "5", "--lr", "3e-3", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count(cli.NO_GPU_MESSAGE) == 1
    assert "ms/step" in out and "tokens/s" in out and "final loss" in out
    report = json.loads((tmp_path / "results.json").read_text())
    (run,) = report["runs"]
    assert run["mode"] == "eager" and run["steps"] == 5 and run["graph_stats"] is None
    assert run["measured_steps"] == 5 - report["timing_skip"] >= 1
    assert len(run["losses"]) == 5 and len(run["step_ms"]) == 5
    assert all(math.isfinite(x) for x in run["losses"])
    assert run["losses"][0] == pytest.approx(math.log(256), abs=0.5)  # untrained byte model
    assert run["final_loss"] < run["losses"][0] - 0.5  # it learns
    assert run["ms_per_step"] > 0 and run["tokens_per_s"] > 0 and run["val_loss"] is not None
    assert report["config"]["seq_len"] == 32 and report["data"] == "embedded"


def test_recipe_with_replacement_text_and_token_file(capsys, tmp_path):
    text = tmp_path / "mine.txt"
    text.write_text("ab" * 3000)
    rc = cli.main([*FAST, "--steps", "6", "--lr", "5e-3", "--data", str(text), "--out", str(tmp_path / "t")])
    assert rc == 0
    assert str(text) in capsys.readouterr().out
    run = json.loads((tmp_path / "t" / "results.json").read_text())["runs"][0]
    # "abab..." is trivially predictable: far below the embedded corpus' loss after the same steps
    assert run["final_loss"] < 1.5

    toks = tmp_path / "toks.pt"
    torch.save(torch.arange(2000) % 37, toks)
    rc = cli.main([*FAST, "--steps", "3", "--data", str(toks), "--out", str(tmp_path / "p")])
    assert rc == 0
    report = json.loads((tmp_path / "p" / "results.json").read_text())
    assert report["config"]["vocab_size"] == 37
    assert report["runs"][0]["losses"][0] == pytest.approx(math.log(37), abs=0.5)


# --------------------------------------------------------------------------------------------- reporting


def test_step_timer_copies_losses_and_times_the_window():
    """Losses are copied per step (graph replay overwrites one static output tensor), window skips warm-up."""
    timer = cli.StepTimer(skip_steps=2)
    trainer = SimpleNamespace(max_steps=5)
    module = SimpleNamespace(device=torch.device("cpu"))
    timer.on_train_start(trainer, module)
    static_loss = torch.zeros(())  # like a captured graph's output: same tensor, new value each step
    for i in range(5):
        timer.on_train_batch_start(trainer, module, None, i)
        static_loss.fill_(10.0 - i)
        timer.on_train_batch_end(trainer, module, {"loss": static_loss}, None, i)
    timer.on_train_end(trainer, module)
    assert timer.losses() == [10.0, 9.0, 8.0, 7.0, 6.0]
    assert timer.count == 5 and timer.measured_steps == 3
    assert len(timer.step_ms()) == 5 and all(ms >= 0 for ms in timer.step_ms())
    assert 0 <= timer.window_s <= sum(timer.step_ms()) / 1e3 + 1e-3
    # a tensor output (not a dict) works too; steps past max_steps are ignored
    timer.on_train_batch_end(trainer, module, torch.tensor(1.0), None, 5)
    assert timer.count == 5


def test_step_timer_on_cpu_reports_the_median_step_not_a_mean_spoiled_by_slow_start_up_steps(monkeypatch):
    """Two CPU runs must not differ by where start-up steps fall: a window whose first steps are slow reports the
    steady step time."""
    clock = [100.0]
    monkeypatch.setattr(cli.time, "perf_counter", lambda: clock[0])
    timer = cli.StepTimer(skip_steps=2)
    trainer = SimpleNamespace(max_steps=10)
    module = SimpleNamespace(device=torch.device("cpu"))
    timer.on_train_start(trainer, module)
    seconds = [3.0, 1.0, 2.3, 0.7] + [0.1] * 6  # two skipped steps, two slow start-up steps in the window
    for i, dt in enumerate(seconds):
        timer.on_train_batch_start(trainer, module, None, i)
        clock[0] += dt
        timer.on_train_batch_end(trainer, module, torch.tensor(1.0), None, i)
    timer.on_train_end(trainer, module)
    assert timer.measured_steps == 8
    assert timer.window_s / timer.measured_steps * 1e3 == pytest.approx(450.0)  # the window's mean
    assert timer.ms_per_step() == pytest.approx(100.0)
    assert math.isnan(cli.StepTimer(skip_steps=2).ms_per_step())  # nothing timed


def _result(mode, ms, losses, speedup=None, *, requested="", replays=None):
    r = cli.RunResult(mode=mode, steps=len(losses), measured_steps=len(losses) - 1, ms_per_step=ms,
                      steps_per_s=1e3 / ms, tokens_per_s=1000 * 1e3 / ms, capture_time_s=0.25 if speedup else None,
                      peak_mem_bytes=3 * 2**30, final_loss=losses[-1], val_loss=None, wall_s=1.0,
                      losses=losses, step_ms=[ms] * len(losses), speedup=speedup, requested=requested)
    if replays is not None:
        r.graph_stats = {"replays": replays, "captures": int(replays > 0), "eager_reasons": {}}
    return r


def test_summary_table_and_parity():
    eager = _result("eager", 20.0, [5.0, 4.0, 3.0], speedup=1.0)
    graphed = _result("graphed", 10.0, [5.0, 4.0, 3.5], speedup=2.0)
    graphed.graph_stats = {"replays": 2, "captures": 1}
    lines = cli.format_summary([eager, graphed]).splitlines()
    assert lines[0].split()[:5] == ["mode", "steps", "replayed", "steps/s", "ms/step"]
    assert lines[2].split() == ["eager", "3", "-", "50.00", "20.00", "50,000", "1.00x", "0.250", "3.00", "GiB",
                                "3.0000", "-"]
    assert "2.00x" in lines[3] and "10.00" in lines[3]
    assert cli.loss_parity(eager, graphed) == pytest.approx(0.5)
    assert lines[3].split()[2] == "2"  # replays from graph_stats
    nan_row = cli.format_summary([_result("eager", float("nan"), [1.0])]).splitlines()[2]
    assert nan_row.split()[3:5] == ["-", "-"]
    assert cli._json_safe({"a": [float("nan"), 1.0]}) == {"a": [None, 1.0]}


def test_a_run_that_replayed_is_graphed_and_gets_a_speedup():
    """The GPU case: the plugin replayed steps, so the run is "graphed" and eager/graphed ms is its speedup."""
    eager = _result("eager", 20.0, [5.0, 4.0], requested="eager")
    graphed = cli.label_run(_result("graphed", 8.0, [5.0, 4.0], requested="graphed", replays=5), None,
                            has_cuda=True)
    assert graphed.mode == "graphed" and graphed.not_graphed_reason is None
    assert cli.assign_speedups([eager, graphed]) is None
    assert (eager.speedup, graphed.speedup) == (1.0, pytest.approx(2.5))
    assert "2.50x" in cli.format_summary([eager, graphed]).splitlines()[3]
    assert graphed.as_dict()["replayed"] == 5
    title = cli.compare_title([eager, graphed], preset="tiny", device="H200")
    assert title == "gpt-pretrain --preset tiny: eager vs CUDA-graphed (H200)"


def test_a_run_that_replayed_nothing_is_not_called_graphed_and_gets_no_speedup():
    """The CPU case: the plugin was attached but replayed no step, so nothing may say "graphed"."""
    plugin = SimpleNamespace(eager_reason="no CUDA device is available")
    eager = _result("eager", 20.0, [5.0, 4.0], requested="eager")
    attached = cli.label_run(_result("graphed", 6.0, [5.0, 4.0], requested="graphed", replays=0), plugin,
                             has_cuda=False)
    assert attached.mode == cli.NOT_REPLAYED_MODE == "eager+plugin"
    assert attached.not_graphed_reason == "no CUDA device is available"
    note = cli.assign_speedups([eager, attached])
    assert note is not None and "no step was replayed (no CUDA device is available)" in note
    assert eager.speedup is None and attached.speedup is None
    table = cli.format_summary([eager, attached])
    assert "graphed" not in table and "x " not in table + " " and "3.33" not in table
    assert [line.split()[0] for line in table.splitlines()[2:]] == ["eager", "eager+plugin"]
    assert attached.as_dict()["replayed"] == 0 and attached.as_dict()["mode"] == "eager+plugin"
    title = cli.compare_title([eager, attached], preset="tiny", device="cpu")
    assert title == ("gpt-pretrain --preset tiny: eager vs eager+plugin (cpu)\n"
                     "no step was replayed (no CUDA device is available): both runs trained eagerly, no speedup")
    assert [label for pair in cli.plot_labels([eager, attached]) for label in pair if "graphed" in label] == []


@pytest.mark.parametrize(
    ("plugin", "stats", "has_cuda", "reason"),
    [
        (SimpleNamespace(eager_reason="capture failed: host-sync at x.py:3"), None, True,
         "capture failed: host-sync at x.py:3"),
        (SimpleNamespace(eager_reason=None), {"eager_reasons": {"no CUDA device": 4}}, False, "no CUDA device"),
        (None, {"eager_reasons": {}}, False, "no CUDA device"),
        (None, {"eager_reasons": {}}, True, "the plugin replayed no step (see its stats line)"),
    ],
)
def test_not_replayed_reason_uses_the_plugins_words(plugin, stats, has_cuda, reason):
    assert cli.not_replayed_reason(plugin, stats, has_cuda=has_cuda) == reason


def test_compare_png(tmp_path):
    _need_matplotlib()
    eager = _result("eager", 20.0, [5.0, 4.0, 3.0], requested="eager")
    graphed = _result("graphed", 10.0, [5.0, 4.0, 3.0], requested="graphed", replays=2)
    path = cli.plot_compare([eager, graphed], tmp_path / "c.png", skip=1, title="t")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    text = _png_text(path)
    assert text["Title"] == "t"
    assert text["Description"] == ("legend: eager (20.00 ms/step timed); "
                                   "graphed (2 replayed, 10.00 ms/step timed)")


def test_compare_png_without_matplotlib(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert cli.plot_compare([_result("eager", 1.0, [1.0])], tmp_path / "c.png", skip=0, title="t") is None
    assert "pip install matplotlib" in capsys.readouterr().out
    assert not (tmp_path / "c.png").exists()


# --------------------------------------------------------------------------------------------- with the plugin


@pytest.mark.skipif(not _plugin_importable(), reason="nemo_cudagraph_plugin.CudaGraphCallback not importable yet")
@pytest.mark.parametrize("strategy", ["callback", "strategy"])
def test_cuda_graph_flag_on_cpu_constructs_plugin_and_trains_eagerly(strategy, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = cli.main(["--cuda-graph", "--strategy", strategy, *FAST, "--steps", "4", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "results.json").read_text())
    run = report["runs"][0]
    assert run["mode"] == "eager+plugin" and run["requested"] == "graphed" and run["graph_stats"] is not None
    assert run["replayed"] == 0 and run["not_graphed_reason"]
    assert report["mode"] == "eager+plugin" and report["replayed"] == 0
    assert run["graph_stats"]["captures"] == 0 and run["graph_stats"]["replays"] == 0
    assert run["graph_summary"] and "0 graphed steps" in run["graph_summary"]
    assert f"eager+plugin stats: {run['graph_summary']}" in out  # whatever the plugin's stats say is printed
    assert all(math.isfinite(x) for x in run["losses"]) and len(run["losses"]) == 4


@pytest.mark.skipif(not _plugin_importable(), reason="nemo_cudagraph_plugin.CudaGraphCallback not importable yet")
def test_compare_on_cpu_says_nothing_was_graphed_in_table_png_and_json(monkeypatch, capsys, tmp_path):
    """On CPU the second run replays nothing; the table, PNG and JSON must not call it graphed."""
    _need_matplotlib()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = cli.main(["--compare", *FAST, "--steps", "4", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "loss parity" in out
    table = out[out.index("mode "):out.index("(timed over")].splitlines()
    assert [line.split()[0] for line in table[2:]] == ["eager", "eager+plugin"]
    assert not any(re.search(r"\d\.\d\dx", line) for line in table), table  # no speedup printed
    assert "no speedup: no step was replayed (" in out
    assert "eager+plugin: the plugin was attached but no step was replayed:" in out
    assert not [line for line in out.splitlines() if line.startswith("graphed")]
    report = json.loads((tmp_path / "results.json").read_text())
    assert [r["mode"] for r in report["runs"]] == ["eager", "eager+plugin"]
    assert [r["replayed"] for r in report["runs"]] == [None, 0]
    assert report["speedup"] is None and report["speedup_note"].startswith("no speedup: no step was replayed")
    assert report["replayed"] == 0 and report["not_graphed_reason"]
    # same seed, both eager on CPU: identical losses
    assert report["max_abs_loss_diff"] == pytest.approx(0.0, abs=1e-6)
    png = tmp_path / "compare.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    text = _png_text(png)
    assert "graphed" not in text["Title"].replace("no step was replayed", "")
    assert "eager vs eager+plugin" in text["Title"] and "no speedup" in text["Title"]
    assert "graphed" not in text["Description"] and "eager+plugin (0 replayed" in text["Description"]
