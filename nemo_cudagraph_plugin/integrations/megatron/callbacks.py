"""Lightning callbacks for pipelines of Megatron-style model chunks and NeMo's ``MegatronStrategy``.

* :class:`AlignPipelineTransposes`: FP8 weight transposes of every model chunk current before any pipeline
  stage's first microbatch (see :mod:`nemo_cudagraph_plugin.fp8.pipeline`). Megatron-core DDP chunks are
  refreshed on their all-gather completion path, other chunks right after the optimizer step.
* :class:`Fp8ParamGatherRefresh`: FP8 transposes refreshed where megatron-core's parameter all-gather
  completes without rebuilding them (the forced sync of NeMo's checkpoint save, older megatron-core).
* :class:`MegatronFullIterationGraph`: each training step's forward-backward captured as one CUDA graph
  with megatron-core's ``FullCudaGraphWrapper`` (what NeMo 2.7 stopped doing with megatron-core >= 0.16).

They live here, not in :mod:`nemo_cudagraph_plugin.lightning`, because they reach into Megatron-core's DDP
chunks (Lightning has no pipeline parallelism of its own: the stages come from Megatron/NeMo).

Example::

    from nemo_cudagraph_plugin import AlignPipelineTransposes

    trainer = L.Trainer(callbacks=[AlignPipelineTransposes(sync_group=True)], ...)

With NeMo's ``MegatronStrategy`` the model chunks are the strategy's ``MegatronParallel`` list
(all virtual stages); otherwise the LightningModule. Pass ``model_chunks=`` to choose.
``nemo_cudagraph_plugin.integrations.nemo.with_cuda_graph`` adds these to NeMo recipes where they apply.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import lightning.pytorch as pl
from torch import nn

from ...fp8 import iter_fp8_params
from ...fp8.pipeline import ModelChunks, TransposeAligner, chunk_parameters, sync_pipeline_group
from .full_iteration import full_iteration_forward_backward
from .param_gather import ParamGatherRefresh, find_megatron_ddp, install_param_gather_refresh
from .param_sync import ParamSyncHook, default_pp_group

__all__ = ["AlignPipelineTransposes", "Fp8ParamGatherRefresh", "MegatronFullIterationGraph"]


def _resolve_chunks(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[Any]:
    model = getattr(trainer.strategy, "model", None)
    # NeMo's MegatronParallel is an nn.ModuleList of the virtual-stage chunks of this rank.
    if isinstance(model, nn.ModuleList) and len(model) > 0:
        return list(model)
    return [pl_module]


class AlignPipelineTransposes(pl.Callback):
    """Refresh every FP8 transpose of every model chunk after each optimizer step, in one pass.

    How: a torch ``optimizer.register_step_post_hook`` on each of the trainer's optimizers runs
    the refresh right after ``optimizer.step()``. When the step is captured into a CUDA graph
    (``CudaGraphCallback``/``CudaGraphStrategy``) the refresh kernels are captured with it and
    replay every step; otherwise they run eagerly. The hooks are removed at fit end.

    The optional barrier over the pipeline group (``sync_group=True``) blocks the host, so it is
    never captured: it runs once per optimizer step at the end of the training batch that stepped
    (after the refresh was enqueued, before the next schedule starts).

    Megatron-core DDP chunks (NeMo's ``MegatronParallel``; distributed optimizer) are not refreshed after
    the optimizer step at all: their new FP8 bytes arrive with the parameter all-gather, where
    megatron-core >= 0.16 (with a TransformerEngine that has ``post_all_gather_processing``) rebuilds the
    transposes itself; where it does not (a forced sync, an older megatron-core) the callback refreshes on
    that completion path (:func:`~nemo_cudagraph_plugin.integrations.megatron.install_param_gather_refresh`). No
    all-gather is forced, so ``overlap_param_gather=True`` keeps overlapping the first forward, and no
    torch step hook is needed (NeMo's ``McoreDistributedOptimizer`` never runs one).

    Other chunks: if an optimizer's ``step`` does not run torch step hooks (a wrapper that bypasses
    ``torch.optim.Optimizer.__init__``), that is detected after the first step: the callback warns
    and from then on refreshes those chunks at the end of each stepping batch instead (outside any graph).
    A chunk that only *looks* like Megatron DDP (``start_param_sync`` and ``ddp_config`` but no bucket
    groups) keeps the old behaviour: its overlapped all-gather is finished first, eagerly.

    Args:
        model_chunks: the chunks to refresh; default: the strategy's ``nn.ModuleList`` of chunks
            (NeMo ``MegatronParallel``) or the LightningModule.
        sync_group: barrier over ``pp_group`` once per optimizer step.
        pp_group: the pipeline-parallel group; default Megatron-core's when initialised, else world.

    Attributes: ``refreshes`` (host-side refresh calls of the post-step path; a graph replay refreshes
    without coming back to Python), ``gather_refresh`` (the completion-path handle for Megatron chunks, or
    ``None``), ``syncs``, ``fallback`` (True once refreshing outside the optimizer step).
    """

    def __init__(
        self,
        model_chunks: Optional[ModelChunks] = None,
        *,
        sync_group: bool = False,
        pp_group: Optional[Any] = None,
    ) -> None:
        super().__init__()
        self.model_chunks = model_chunks
        self.sync_group = bool(sync_group)
        self.pp_group = pp_group
        self.hook: Optional[ParamSyncHook] = None
        self.gather_refresh: Optional[ParamGatherRefresh] = None
        self.fallback = False
        self.syncs = 0
        self._handles: list[Any] = []
        self._hook_calls = 0
        self._last_step: Optional[int] = None
        self._checked = False
        self._pp_group: Optional[Any] = None

    @property
    def aligner(self) -> Optional[TransposeAligner]:
        return None if self.hook is None else self.hook.aligner

    @property
    def refreshes(self) -> int:
        return 0 if self.hook is None else self.hook.aligner.calls

    # -- hooks ----------------------------------------------------------------------------------

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # Runs inside optimizer.step(): captured with it under CUDA graphs, eager otherwise.
        self._hook_calls += 1
        self.hook.align()  # type: ignore[union-attr]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        chunks = self.model_chunks if self.model_chunks is not None else _resolve_chunks(trainer, pl_module)
        chunks = list(chunks) if isinstance(chunks, (list, tuple, nn.ModuleList)) else [chunks]
        pp_group = self.pp_group
        if self.sync_group and pp_group is None:
            pp_group = default_pp_group()
        self._pp_group = pp_group
        self._remove_hooks()
        megatron = [c for c in chunks if find_megatron_ddp(c) is not None]
        others = [c for c in chunks if find_megatron_ddp(c) is None]
        # The barrier is done at batch end, outside the step, so the hook itself never syncs.
        self.hook = ParamSyncHook(others, sync_group=False, finish_param_sync=True) if others else None
        self.gather_refresh = install_param_gather_refresh(megatron) if megatron else None
        n_fp8 = len(self.hook.aligner) if self.hook is not None else 0
        if megatron:
            n_fp8 += sum(1 for _ in iter_fp8_params(chunk_parameters(megatron)))
        if n_fp8 == 0:
            warnings.warn(
                "AlignPipelineTransposes: the model chunks hold no FP8 (TransformerEngine Float8Tensor) "
                "parameter, so there is no transpose to align; remove the callback or create the model under "
                "te.quantized_model_init / te.fp8_model_init.",
                stacklevel=2,
            )
        self._hook_calls = 0
        self._checked = self.hook is None  # Megatron chunks need no torch step hook
        self.fallback = False
        self._last_step = trainer.global_step
        if self.hook is None:
            return
        for opt in trainer.optimizers:
            try:
                self._handles.append(opt.register_step_post_hook(self._post_step))
            except AttributeError:
                self._use_fallback(
                    f"{type(opt).__name__} does not support torch step hooks (no register_step_post_hook)"
                )

    def _use_fallback(self, why: str) -> None:
        if not self.fallback:
            warnings.warn(
                f"AlignPipelineTransposes: {why}; refreshing FP8 transposes at the end of each training batch "
                "that stepped instead (eager, outside any CUDA graph). Still before the next microbatch.",
                stacklevel=3,
            )
        self.fallback = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (self.hook is None and self.gather_refresh is None) or trainer.global_step == self._last_step:
            return  # accumulating gradients: no optimizer step in this batch
        self._last_step = trainer.global_step
        if not self._checked:
            self._checked = True
            if self._hook_calls == 0 and not self.fallback:
                self._use_fallback("the optimizer stepped but its torch step post-hook never ran")
        if self.fallback and self.hook is not None:
            self.hook.align()
        if self.sync_group:
            if sync_pipeline_group(self._pp_group):
                self.syncs += 1

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.hook is not None:
            self.hook.aligner.remove()
        if self.gather_refresh is not None:
            self.gather_refresh.remove()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()


class Fp8ParamGatherRefresh(pl.Callback):
    """Refresh FP8 transposes where megatron-core's parameter all-gather completes without rebuilding them.

    For NeMo ``MegatronStrategy`` runs with FP8 primary weights and the distributed optimizer. megatron-core
    >= 0.16 (with a TransformerEngine that has ``post_all_gather_processing``) rebuilds the transposes itself
    after each overlapped or synchronous all-gather, and then asks TE *not* to mark them invalid when the
    optimizer writes new FP8 bytes. A *forced* sync of a chunk that overlaps its all-gather rebuilds nothing
    (``megatron/core/distributed/param_and_grad_buffer.py:264``), and NeMo forces one on every checkpoint save
    (``MegatronStrategy.save_checkpoint`` -> ``force_param_sync()``): the step after the save would read
    transposes of the previous weights, even eagerly. This callback installs
    :func:`~nemo_cudagraph_plugin.integrations.megatron.install_param_gather_refresh` on the strategy's chunks at fit start:
    it refreshes on those paths only (none on an ordinary step when megatron-core rebuilds itself) and never
    forces an all-gather. With pipeline size > 1 use :class:`AlignPipelineTransposes`, which does the same.

    Args:
        model_chunks: default: the strategy's ``nn.ModuleList`` of chunks (NeMo ``MegatronParallel``).

    Attributes: ``handle`` (the :class:`~nemo_cudagraph_plugin.integrations.megatron.ParamGatherRefresh`, after fit start).
    """

    def __init__(self, model_chunks: Optional[ModelChunks] = None) -> None:
        super().__init__()
        self.model_chunks = model_chunks
        self.handle: Optional[ParamGatherRefresh] = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        chunks = self.model_chunks if self.model_chunks is not None else _resolve_chunks(trainer, pl_module)
        chunks = list(chunks) if isinstance(chunks, (list, tuple, nn.ModuleList)) else [chunks]
        megatron = [c for c in chunks if find_megatron_ddp(c) is not None]
        if self.handle is not None:
            self.handle.remove()
        if not megatron:
            warnings.warn(
                "Fp8ParamGatherRefresh: no Megatron-core DistributedDataParallel chunk (the strategy is not NeMo's "
                "MegatronStrategy, or DDP is off), so there is no parameter all-gather to follow; remove the "
                "callback.",
                stacklevel=2,
            )
            self.handle = None
            return
        self.handle = install_param_gather_refresh(megatron)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.handle is not None:
            self.handle.remove()


class MegatronFullIterationGraph(pl.Callback):
    """Capture each training step's forward-backward as one CUDA graph under NeMo's ``MegatronStrategy``.

    NeMo 2.7's ``MegatronStep.forward_backward_func`` wraps megatron-core's schedule in ``FullCudaGraphWrapper``
    only when ``enable_cuda_graph`` is true and ``cuda_graph_scope == "full_iteration"`` as a *string*
    (``nemo/lightning/megatron_parallel.py:1436-1441``); megatron-core >= 0.16 forbids ``enable_cuda_graph``
    with ``cuda_graph_impl`` and turns the scope into a list of enums
    (``megatron/core/transformer/transformer_config.py:1711``), so NeMo never wraps. This callback uses NeMo's
    documented ``on_megatron_step_start(step)`` event (every Lightning callback with that method is registered
    by ``MegatronStrategy``): for training steps it sets the step's ``forward_backward_func`` to one
    :func:`~nemo_cudagraph_plugin.integrations.megatron.full_iteration_forward_backward` wrapper, built on the first step.
    Validation/prediction steps stay eager.

    Captured: all microbatches' forward and backward, DDP's gradient hooks and reduce-scatters, the overlapped
    parameter all-gathers and megatron-core's FP8 transpose rebuild. Not captured: data loading (copied into
    static buffers), ``zero_grad_buffer`` and the optimizer step. Needs ``model.config.cuda_graph_impl="local"``,
    ``cuda_graph_scope=["full_iteration"]`` and Megatron DDP's NaN checks off, which ``with_cuda_graph(recipe,
    scope=["full_iteration"])`` sets.

    Args:
        warmup_steps: eager training steps before the capture; default ``model.config.cuda_graph_warmup_steps``.

    Attributes: ``wrapper`` (the ``FullCudaGraphWrapper``), ``wrapped_steps``.
    """

    def __init__(self, warmup_steps: Optional[int] = None) -> None:
        super().__init__()
        self.warmup_steps = warmup_steps
        self.wrapper: Any = None
        self.wrapped_steps = 0

    def on_megatron_step_start(self, step: Any) -> Any:
        """NeMo's transform event: returns the step with our forward-backward function for training steps."""
        if getattr(step, "forward_only", True):
            return step
        if self.wrapper is None:
            model = step.model  # MegatronStep.model: one chunk, or the list of virtual-stage chunks
            chunks = model if isinstance(model, list) else [model]
            config = getattr(chunks[0], "config", None)
            if config is None:
                raise ValueError(
                    "MegatronFullIterationGraph: the Megatron model has no .config (TransformerConfig); it needs "
                    "NeMo's MegatronStrategy with a megatron-core model."
                )
            self.wrapper = full_iteration_forward_backward(
                config=config, model_chunks=chunks, warmup_steps=self.warmup_steps,
            )
        step.forward_backward_func = self.wrapper  # overrides MegatronStep's cached_property for this step
        self.wrapped_steps += 1
        return step
