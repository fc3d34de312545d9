"""CudaGraphStrategy on one GPU: same results as the callback; DDP (world size 1, NCCL) captured."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _lightning_utils import CapturableEager, Recorder, loader, make_module, max_rel
from lightning.pytorch.strategies import DDPStrategy

from nemo_cudagraph_plugin import CudaGraphCallback, CudaGraphStrategy


def _fit(module, strategy, callbacks, steps, **kw):
    rec = Recorder()
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, max_steps=steps, callbacks=[*callbacks, rec], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw,
    )
    trainer.fit(module, train_dataloaders=loader(steps * kw.get("accumulate_grad_batches", 1)))
    return trainer, rec


@pytest.fixture(autouse=True)
def _no_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def test_strategy_equals_callback_single_device():
    s = CudaGraphStrategy()
    _, rs = _fit(make_module(), s, [], 60)
    cb = CudaGraphCallback()
    _, rc = _fit(make_module(), "auto", [cb], 60)
    assert s.stats.replays >= 55 and cb.stats.replays >= 55
    assert torch.equal(rs.loss_tensor(), rc.loss_tensor()), max_rel(rs.loss_tensor(), rc.loss_tensor())


def test_strategy_and_callback_together_is_one_clear_error():
    with pytest.raises(ValueError, match="Both CudaGraphCallback and CudaGraphStrategy"):
        _fit(make_module(), CudaGraphStrategy(), [CudaGraphCallback()], 5)


@pytest.mark.parametrize("acc", [1, 2])
def test_ddp_world_size_1_allreduce_captured(acc):
    s = CudaGraphStrategy("ddp")
    assert s.capture_config.warmup_steps >= 11
    _, rg = _fit(make_module(), s, [], 40, accumulate_grad_batches=acc)
    dist.destroy_process_group()
    _, re = _fit(make_module(), DDPStrategy(), [CapturableEager()], 40, accumulate_grad_batches=acc)
    assert s.stats.captures == acc and s.stats.replays > 0, s.stats.summary()
    gl, el = rg.loss_tensor(), re.loss_tensor()
    print(f"\nDDP ws=1 acc={acc}: {s.stats.summary()}; graph vs eager DDP max rel {max_rel(gl, el):.3e}")
    assert torch.equal(gl, el), max_rel(gl, el)


def test_ddp_find_unused_parameters_refused():
    with pytest.raises(ValueError, match="find_unused_parameters=True"):
        CudaGraphStrategy(DDPStrategy(find_unused_parameters=True))
