"""Binds the capture engine to one Lightning ``Trainer`` (shared by the callback and the strategy).

Per training batch Lightning calls ``automatic_optimization.run(optimizer, batch_idx, kwargs)``.
While bound, that call (on this trainer's loop instance only) goes through
:meth:`LightningStepRunner.run`, which hands the engine's adapter (:class:`~.adapter.LightningStepAdapter`) a
step function covering the whole ``run``: training_step, zero_grad, backward, gradient clipping and
optimizer.step, and the step's key (:class:`~._compat.StepKey`: accumulation phase, ``accumulate_grad_batches``,
clipping, precision).

The runner is the binding: it decides whether the fit can be graphed (refusals), builds the adapter with what it
needs once, and changes Lightning's objects (the loop's ``run``, the loss division, the batch transfer, and the
points inside the step where the NaN guard acts). The adapter holds the step's state: replayed steps skip Python,
so it repeats the host-side effects Lightning relies on (``self.log`` calls made inside the step, the optimization
progress counters), keeps the optimizer's hyperparameters live by a guard before every step (code inside the step
that assigns them is refused at capture with its file:line) and owns the NaN guard. Other Python side effects of
hooks inside the step run once, at capture.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from ..core.backend import GraphBackend
from ..core.config import CaptureConfig, CaptureStats
from ..core.engine import CaptureEngine
from ..core.errors import CaptureError
from ..core.rng import GeneratorRegistry
from ..hf import (
    EXPERTS_GRAPH_SAFE,
    SDPA_GRAPH_SAFE,
    graph_safe_attention,
    graph_safe_experts,
    restore_attention,
    restore_experts,
)
from . import _compat
from .adapter import LightningStepAdapter, OptimizerNotPrepared
from .checks import Refusal, device_refusal, fp8_refusal, optimizer_refusal, setup_refusal

__all__ = ["LightningStepRunner"]


class LightningStepRunner:
    """Binds one ``fit`` of a ``Trainer`` to the capture engine: the refusals, the adapter and Lightning's patches.

    At :meth:`bind` it builds the engine's adapter (:class:`~.adapter.LightningStepAdapter`) with what it needs
    (the module, the optimizer, the loop, whether DDP shares the gradients, whether the module keeps Lightning's own
    clipping), routes this trainer's step to :meth:`LightningStepAdapter.step <.adapter.LightningStepAdapter.step>`
    and routes the adapter's :attr:`~.adapter.LightningStepAdapter.in_step` points (the NaN guard's) into Lightning's
    backward, closure and clipping. Everything :meth:`bind` changes on Lightning's objects is undone by
    :meth:`unbind` (one ``ExitStack``; the adapter undoes its own changes to the model and optimizer).

    Args:
        config: the options.
        stats: counters shared with the owner (``callback.stats``).
        owner: the class the user configured (``"CudaGraphCallback"``/``"CudaGraphStrategy"``),
            used in messages and for owner-specific refusals.
        generators: extra generators to register with every graph.
        backend: device interface of the engine (CUDA unless a test supplies a stand-in).
    """

    def __init__(
        self,
        config: CaptureConfig,
        stats: CaptureStats,
        owner: str = "CudaGraphCallback",
        generators: Optional[GeneratorRegistry] = None,
        backend: Optional[GraphBackend] = None,
    ) -> None:
        self.config = config
        self.stats = stats
        self.owner = owner
        self.generators = generators or GeneratorRegistry()
        self.backend = backend
        #: the engine's adapter of the bound (or last) fit; ``None`` before bind or when the fit was refused
        self.adapter: Optional[LightningStepAdapter] = None
        self.trainer: Any = None
        self.pl_module: Any = None
        self.refused: Optional[Refusal] = None
        self._loop: Any = None
        self._orig_run: Optional[Callable] = None
        # What bind() changed on Lightning's objects, undone in reverse by unbind().
        self._undo = contextlib.ExitStack()

    @property
    def engine(self) -> Optional[CaptureEngine]:
        """The adapter's engine (``None`` before bind or when the fit was refused)."""
        return self.adapter.engine if self.adapter is not None else None

    @property
    def eager_reason(self) -> Optional[str]:
        """Why this fit trains eagerly (``None`` while graphs are used, whole steps or partial graphs)."""
        if self.adapter is not None and self.adapter.partial is not None:
            return None
        if self.refused is not None:
            return self.refused.message
        return self.adapter.engine.disabled_reason if self.adapter is not None else None

    # ------------------------------------------------------------------------------------------
    # checks and binding
    # ------------------------------------------------------------------------------------------
    def _refuse(self, refusal: Refusal) -> None:
        """Train eagerly with one warning, or stop with a :class:`CaptureError` (see ``Refusal.soft`` and
        ``Refusal.eager_too``)."""
        if refusal.eager_too:
            raise CaptureError(
                f"{self.owner}: this fit cannot train right, with or without CUDA graphs: {refusal.message}. "
                "(on_capture_error='eager' would not help: training eagerly has the same problem.)",
                rule="configuration",
            )
        if refusal.soft or self.config.on_capture_error == "eager":
            self.refused = refusal
            warnings.warn(f"nemo_cudagraph_plugin: training eagerly: {refusal.message}.", stacklevel=3)
            return
        raise CaptureError(
            f"{self.owner}: cannot capture this training step into CUDA graphs: {refusal.message}. "
            "Pass on_capture_error='eager' to train without graphs instead.",
            rule="configuration",
        )

    def check_setup(self, trainer: Any, pl_module: Any) -> None:
        """At ``setup``, on any machine: refusals that need no optimizer and no GPU."""
        check_single_owner(trainer)
        self.refused = None
        why = setup_refusal(self.config, trainer, pl_module, self.owner)
        if why is not None:
            self._refuse(why)

    def bind(self, trainer: Any, pl_module: Any) -> None:
        """Build the adapter and route this trainer's step through the engine (``on_train_start``).

        Raises :class:`CaptureError` (``on_capture_error="raise"``) when the fit cannot be graphed
        for a reason the user must fix; warns once and leaves training eager otherwise.
        """
        _compat.check_lightning_version()
        self.trainer, self.pl_module = trainer, pl_module
        if self.refused is not None:  # refused at setup, already said
            return
        why = (setup_refusal(self.config, trainer, pl_module, self.owner) or fp8_refusal(trainer, pl_module)
               or optimizer_refusal(trainer))
        if why is None and (self.backend is None or self.backend.device_type == "cuda"):
            why = device_refusal(pl_module)
        if why is not None:
            self._refuse(why)
            return
        if self.config.hf_attention == "graph_safe" and (switched := graph_safe_attention(pl_module)):
            self._undo.callback(restore_attention, pl_module, switched)
            rank_zero_info(f"{self.owner}: Hugging Face attention {SDPA_GRAPH_SAFE!r} (SDPA without a host read of "
                           f"the attention mask) for {', '.join(n or type(pl_module).__name__ for n in switched)}"
                           " until the end of fit")
        if self.config.hf_experts == "graph_safe" and (experts := graph_safe_experts(pl_module)):
            self._undo.callback(restore_experts, pl_module, experts)
            rank_zero_info(f"{self.owner}: Hugging Face experts {EXPERTS_GRAPH_SAFE!r} (grouped GEMMs in the autocast "
                           "dtype, offsets on the device) for "
                           f"{', '.join(n or type(pl_module).__name__ for n, _ in experts)} until the end of fit")
        self._loop = _compat.automatic_loop(trainer)
        # Lightning's own configure_gradient_clipping (not a module's override) clips by norm with one norm per
        # gradient: the NaN guard may read those instead of reading every gradient again.
        hook = getattr(pl_module.configure_gradient_clipping, "__func__", None)
        try:
            adapter = LightningStepAdapter(
                self.config, self.stats, pl_module, trainer.optimizers[0], self._loop, owner=self.owner,
                shares_grads="DDPStrategy" in {c.__name__ for c in type(trainer.strategy).__mro__},
                global_step=lambda: trainer.global_step,
                default_clipping=hook is pl.LightningModule.configure_gradient_clipping,
                generators=self.generators, backend=self.backend,
                nan_checked_at=self.adapter.nan_checked_at if self.adapter is not None else 0,
            )
        except OptimizerNotPrepared as exc:
            self.adapter = None
            self._refuse(Refusal("optimizer", str(exc).rstrip(".")))
            return
        self.adapter = adapter
        self._install(adapter, pl_module)

    def _install(self, adapter: LightningStepAdapter, pl_module: Any) -> None:
        """Lightning's side: the step routed to the adapter, and the adapter's points inside the step."""
        undo = self._undo
        self._orig_run, undo_route = _compat.route_step(self._loop, self.run)
        undo.callback(undo_route)
        # Lightning divides the loss by accumulate_grad_batches also when it is 1: two kernels per step, no bit changed.
        undo_divide = _compat.undivided_loss(self._loop)
        if undo_divide is not None:
            undo.callback(undo_divide)
        if self.backend is None and pl_module.device.type == "cuda":
            undo_transfer = _compat.around_batch_transfer(self.trainer, torch.cuda.Stream(pl_module.device))
            if undo_transfer is not None:
                undo.callback(undo_transfer)
        points = adapter.in_step
        if points is not None:  # the NaN guard's only routes into the step, for the callback and the strategy alike
            undo.callback(_compat.around_backward(self.trainer, points.before_backward))
            undo.callback(_compat.after_closure(self.trainer, points.after_backward))
            if points.around_clip_by_norm is not None:
                undo.callback(_compat.around_clip_by_norm(self.trainer, points.around_clip_by_norm))
        if self.config.scope != "step":  # the partial tier's optimizer graph takes Lightning's clipping in
            undo.callback(_compat.around_clip_gradients(self.trainer, adapter.around_clip_gradients))

    def unbind(self) -> None:
        """Undo everything :meth:`bind` changed, latest first (also after an exception; idempotent)."""
        self._undo.close()
        if self.adapter is not None:
            self.adapter.close()  # its changes to the model and optimizer, then the graphs
        self._orig_run = None

    def count_unbound_step(self) -> None:
        """A batch trained by plain Lightning because this fit was refused: count it with the reason."""
        if self.refused is not None:
            self.stats.count_eager(self.refused.label)

    # ------------------------------------------------------------------------------------------
    # the step (hot path: one replay per call once captured)
    # ------------------------------------------------------------------------------------------
    def run(self, optimizer: torch.optim.Optimizer, batch_idx: int, kwargs: OrderedDict) -> Any:
        """Replacement for ``automatic_optimization.run`` on this trainer."""
        key = _compat.step_key(self.trainer, self._loop, batch_idx)
        orig_run, batch = self._orig_run, kwargs.get("batch")

        def call(b: Any) -> Any:
            return orig_run(optimizer, batch_idx, kwargs if b is batch else OrderedDict(kwargs, batch=b))

        return self.adapter.step(key, batch, call)

    # ------------------------------------------------------------------------------------------
    # Lightning's hooks outside the step (the owner calls them)
    # ------------------------------------------------------------------------------------------
    def reattach_grads(self) -> None:
        """Lightning frees gradients before validation; give the graphs' gradient buffers back."""
        if self.adapter is not None:
            self.adapter.reattach_grads()

    def check_nan(self) -> None:
        """Read the NaN guard now (one host sync; epoch and fit end); raise or report."""
        if self.adapter is not None:
            self.adapter.check_nan()

    def portable_checkpoint(self, checkpoint: dict) -> None:
        """Write floats (not device tensors) for lr/betas into a checkpoint being saved."""
        for state in checkpoint.get("optimizer_states", []):
            self.portable_optimizer_state(state)

    def portable_optimizer_state(self, state: dict) -> dict:
        """An optimizer's ``state_dict`` with float lr/betas and the user's kernel flags, so it loads anywhere (in
        place; also returned)."""
        return self.adapter.portable_state(state) if self.adapter is not None else state


def check_single_owner(trainer: Any) -> None:
    """One step has one owner: a ``CudaGraphCallback`` and a ``CudaGraphStrategy`` together is an error."""
    owners = [cb for cb in trainer.callbacks if isinstance(getattr(cb, "step_runner", None), LightningStepRunner)]
    if isinstance(getattr(trainer.strategy, "step_runner", None), LightningStepRunner):
        owners.append(trainer.strategy)
    if len(owners) > 1:
        raise ValueError(
            "Both CudaGraphCallback and CudaGraphStrategy are configured; they capture the same step. "
            "Keep one: remove the callback (pass its options to CudaGraphStrategy) or use a plain strategy."
        )
