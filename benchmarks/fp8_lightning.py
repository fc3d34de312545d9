"""FP8 primary weights under CudaGraphCallback: an optimizer that writes FP8 bytes in place (FP32 masters),
eager vs graphed + refresh vs graphed without refresh; and the refresh's share of the graphed step time.

    python benchmarks/fp8_lightning.py --out fp8_lightning.json     (GPU + TransformerEngine)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fp8_refresh as b  # noqa: E402

from nemo_cudagraph_plugin import CudaGraphCallback  # noqa: E402
from nemo_cudagraph_plugin.fp8 import verify_fp8_transposes  # noqa: E402
from recipes.gpt import GPTDataModule, GPTLightningModule, get_config  # noqa: E402


class Writer(b.MasterWeightAdamW):
    def __init__(self, params, lr):
        super().__init__(params, lr)
        self.defaults["capturable"] = True  # the inner AdamW is capturable; tells the plugin the step is graph-safe
        for g in self.param_groups:
            g["capturable"] = True

    def step(self, closure=None):
        # Lightning passes the training_step + backward closure to optimizer.step().
        if closure is not None:
            with torch.enable_grad():
                closure()
        return super().step()


class M(GPTLightningModule):
    def configure_optimizers(self):
        return Writer(list(self.parameters()), lr=1e-3)


class Timer(pl.Callback):
    def __init__(self, start, end):
        self.start, self.end, self.t = start, end, []
        self.losses = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx in (self.start, self.end):
            torch.cuda.synchronize()
            self.t.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().float())


def run(preset, steps, mode):
    pl.seed_everything(0, verbose=False)
    cfg = get_config(preset)
    dm = GPTDataModule(seq_len=cfg.seq_len, batch_size=cfg.batch_size, train_samples=steps * cfg.batch_size, seed=0)
    m = M(cfg.replace(vocab_size=dm.vocab_size), fp8=True)
    cbs = [] if mode == "eager" else [CudaGraphCallback(fp8_refresh=(mode == "graphed+refresh"), nan_guard=False)]
    timer = Timer(steps // 4, steps - 1)
    tr = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=steps, callbacks=[*cbs, timer],
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    limit_val_batches=0)
    tr.fit(m, datamodule=dm)
    rep = verify_fp8_transposes(m.model)
    w = [p.dequantize(dtype=torch.float32) for p in b.iter_fp8_params(m.model)] if hasattr(b, "iter_fp8_params") else []
    return {"losses": torch.stack(timer.losses).cpu().tolist(), "ms": (timer.t[1] - timer.t[0]) * 1e3 / (timer.end - timer.start),
            "stale": len(rep.stale), "replays": cbs[0].stats.replays if cbs else 0, "w": w}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fp8_lightning.json")
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    res = {}
    for mode in ("eager", "graphed+refresh", "graphed-no-refresh"):
        res[mode] = run("tiny", a.steps, mode)
    e = res["eager"]
    rows = []
    for mode, r in res.items():
        dl = max(abs(x - y) / max(abs(y), 1e-3) for x, y in zip(r["losses"], e["losses"]))
        num = sum(float((x - y).pow(2).sum()) for x, y in zip(r["w"], e["w"]))
        den = sum(float(y.pow(2).sum()) for y in e["w"]) or 1.0
        rows.append((mode, r["losses"][0], r["losses"][-1], dl, (num / den) ** 0.5, r["stale"], r["replays"], r["ms"]))
    # Refresh overhead on the small preset, graphed, with vs without the refresh (same run, side by side).
    t_on = run("small", 80, "graphed+refresh")["ms"]
    t_off = run("small", 80, "graphed-no-refresh")["ms"]
    out = {"rows": rows, "small_ms_refresh": t_on, "small_ms_no_refresh": t_off, "overhead": t_on / t_off - 1}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("mode                 loss0   lossN   max rel loss dev vs eager  rel weight dev  stale  replays  ms/step")
    for r in rows:
        print(f"{r[0]:20s} {r[1]:7.4f} {r[2]:7.4f} {r[3]:12.3e} {r[4]:14.3e} {r[5]:6d} {r[6]:8d} {r[7]:8.3f}")
    print(f"FP8 REFRESH OVERHEAD small graphed: {t_on:.3f} vs {t_off:.3f} ms/step -> {100 * (t_on / t_off - 1):+.2f}%")


if __name__ == "__main__":
    main()
