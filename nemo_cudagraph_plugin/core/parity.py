"""``verify_steps``: a graphed step compared with the same step run eagerly, from the same state.

The eager half runs first under :class:`WriteRecorder`, which snapshots every pre-existing tensor before its first
write (parameters, gradients, optimizer state, module buffers such as BatchNorm statistics, NaN-guard accumulators);
those, the adapter's ``mutable_tensors``, every generator, the host counters and the gradients' tensor objects are
restored before the graph's step, whose effects are the ones that stay. Training is then exactly that of an unverified
run. The graphed half is a whole-step graph's replay (:meth:`StepParity.replay`) or, for the partial tier, the step
with its module and optimizer graphs, whose eager half runs with every graph of the tier set aside
(:meth:`StepParity.verify`, ``bypass``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from ._torch_compat import ObservingMode, dispatch_disabled, returns_alias, written_arguments
from .buffers import flatten
from .errors import ParityError

if TYPE_CHECKING:
    from .adapter import StepAdapter
    from .backend import GraphBackend
    from .config import CaptureStats
    from .engine import GraphEntry
    from .rng import GeneratorRegistry

__all__ = ["StepParity", "WriteRecorder"]


class StepParity:
    """Runs a step eagerly, undoes everything it wrote, then runs it with its graphs and compares (``verify_steps``).

    Args:
        backend, device: where the default generator's state lives.
        generators: the extra generators registered with each graph (restored too).
        adapter: the framework's ``mutable_tensors`` (written by kernels the dispatcher does not see) and
            ``host_state`` (host counters), restored after the eager half.
        stats: the verified step is counted there (``verified_steps``, ``replays``).
        rtol: relative tolerance (0.0: bitwise).
    """

    def __init__(self, backend: GraphBackend, device: torch.device, generators: GeneratorRegistry,
                 adapter: StepAdapter, stats: CaptureStats, rtol: float) -> None:
        self.backend, self.device, self.generators = backend, device, generators
        self.adapter, self.stats, self.rtol = adapter, stats, rtol

    def replay(self, entry: GraphEntry, leaves: list[Tensor], batch: Any, quiet_fn: Callable[[Any], Any],
               named_params: Sequence[tuple[str, Tensor]], what: str = "the graphed step") -> Any:
        """A whole-step graph verified (:meth:`verify`): the eager step on ``batch``, undone; then ``entry``'s replay
        on ``leaves``, whose outputs are returned."""

        def graphed() -> tuple[Any, tuple[str, ...]]:
            out = entry.replay(leaves)
            self.stats.replays += 1
            if entry.owns_grads and any(
                p.grad is not None and p.grad.data_ptr() != entry.state.get(n + ".grad") for n, p in named_params
            ):
                # The parameters' .grad is another graph's memory now: this graph's gradients are not visible.
                return out, ("grad_norm",)
            return out, ()

        return self.verify(batch, quiet_fn, graphed, named_params, what=what)

    def verify(self, batch: Any, quiet_fn: Callable[[Any], Any],
               graphed: Callable[[], tuple[Any, Optional[Sequence[str]]]],
               named_params: Sequence[tuple[str, Tensor]],
               bypass: Optional[Callable[[], contextlib.AbstractContextManager]] = None,
               what: str = "the graphed step") -> Any:
        """The eager step on ``batch`` (``quiet_fn``: no host-visible side effects), undone; then ``graphed()``, the
        step with its graphs, whose outputs are returned.

        ``graphed`` returns ``(outputs, metrics not compared)``, or ``(outputs, None)`` where the step turned out not
        to be one to verify: nothing is compared and it is not counted (the eager half was undone all the same).
        ``bypass`` (optional): a context in which everything but ``graphed()`` runs (the eager half, its undoing, the
        comparison): the graphs set aside, and the work not counted as the step's. Raises :class:`ParityError` when
        the two differ (``what``: the step and its graphs, for the message)."""
        aside = bypass if bypass is not None else contextlib.nullcontext
        with aside():
            eager_vals, post_eager, post_user = self._eager(batch, quiet_fn, named_params)
        out_graph, unseen = graphed()
        if unseen is None:
            return out_graph
        with aside():
            self._compare(out_graph, eager_vals, post_eager, post_user, unseen, named_params, what)
        return out_graph

    def _eager(self, batch: Any, quiet_fn: Callable[[Any], Any], named_params: Sequence[tuple[str, Tensor]]
               ) -> tuple[dict[str, float], list[Tensor], Optional[list[Tensor]]]:
        """The eager half: its metrics and parameters after it (and after the user's own optimizer settings' run, where
        one is measured), everything it wrote undone."""
        be = self.backend
        rng = be.rng_state(self.device)
        gens = self.generators.states()
        extra = [(t, t.detach().clone()) for t in self.adapter.mutable_tensors()]
        restore_host = self.adapter.host_state()
        grads = [(p, p.grad) for _, p in named_params]  # eager zero_grad may set them to None

        def eager(context: contextlib.AbstractContextManager) -> tuple[dict[str, float], list[Tensor]]:
            """The step run eagerly in ``context``: its metrics and parameters after it; then everything undone."""
            with context, WriteRecorder() as rec:
                out = quiet_fn(batch)
            vals = _metrics(out, named_params)
            post = [p.detach().clone() for _, p in named_params]
            rec.restore()
            for p, g in grads:
                p.grad = g
            with torch.no_grad():
                for t, v in extra:
                    t.copy_(v)
            self.generators.set_states(gens)
            be.set_rng_state(rng, self.device)
            restore_host()
            return vals, post

        # The adapter's reference_step (optional): the eager half runs the user's own optimizer step in it.
        reference = getattr(self.adapter, "reference_step", None)
        eager_vals, post_eager = eager(reference() if reference is not None else contextlib.nullcontext())
        # Where the graphed optimizer math is not the user's (the adapter's users_step, optional): the step once more
        # with the user's own optimizer settings, to say by how much (the first verified step only).
        users = getattr(self.adapter, "users_step", None) if self.stats.optimizer_math_gap is None else None
        users_context = users() if users is not None else None
        post_user = eager(users_context)[1] if users_context is not None else None
        return eager_vals, post_eager, post_user

    def _compare(self, out_graph: Any, eager_vals: dict[str, float], post_eager: list[Tensor],
                 post_user: Optional[list[Tensor]], unseen: Sequence[str], named_params: Sequence[tuple[str, Tensor]],
                 what: str) -> None:
        """The graphed half against the eager one (metrics but ``unseen``, every parameter); one verified step."""
        graph_vals = _metrics(out_graph, named_params)
        for k in unseen:
            eager_vals.pop(k, None)
        if post_user is not None:
            self.stats.optimizer_math_gap = _gap([p.detach() for _, p in named_params], post_user)
        rtol = self.rtol
        problems = []
        for k in eager_vals:
            a, b = graph_vals.get(k), eager_vals[k]
            if a is None or not _close(a, b, rtol):
                problems.append(f"{k}: graph {a!r} vs eager {b!r}")
        for (name, p), e in zip(named_params, post_eager):
            if not _close_t(p.detach(), e, rtol):
                diff = (p.detach().float() - e.float()).abs().max().item()
                problems.append(f"parameter '{name}' after the step: max |graph - eager| = {diff:.3e}")
                break
        self.stats.verified_steps += 1
        if problems:
            raise ParityError(
                f"verify_steps: {what} differs from the same step run eagerly (verified step "
                f"{self.stats.verified_steps}, rtol={rtol}):\n  " + "\n  ".join(problems) + "\nThe step does something a replay does not "
                "repeat (Python-side state, a host value frozen at capture, an unregistered random generator). "
                "Set on_capture_error='eager' or enabled=False for this model, and please report it."
            )


class WriteRecorder(ObservingMode):
    """Snapshots every tensor that existed before the block, right before its first in-place write.

    Writes are found from the operator schemas (``Tensor(a!)`` arguments, lists included: fused
    optimizer updates, ``add_``, ``out=`` variants), plus the ``running_mean``/``running_var``
    arguments of the batch-norm kernels, whose schemas (``native_batch_norm``, ``cudnn_batch_norm``,
    ``miopen_batch_norm``, ``batch_norm_update_stats``) do not mark them as written although the
    kernels update them. Tensors created inside the block are skipped. Kernels that bypass torch's
    dispatcher (custom C++ extensions) are invisible here: :class:`StepParity` snapshots those through its
    adapter's ``mutable_tensors`` (the Lightning adapter passes the module's buffers and TE's FP8 scaling state).
    """

    def __init__(self) -> None:
        super().__init__()
        self._created: set[int] = set()
        self._seen: set[tuple] = set()
        self._snaps: list[tuple[Tensor, Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        for i, name, written in written_arguments(func):
            if not written and name not in _UNMARKED_WRITES:
                continue
            val = kwargs[name] if name in kwargs else (args[i] if i < len(args) else None)
            for t in val if isinstance(val, (list, tuple)) else (val,):
                if isinstance(t, Tensor):
                    self._snapshot(t)
        out = func(*args, **kwargs)
        # New tensors (not views of, or writes into, an argument) are temporaries of the block.
        if not returns_alias(func):
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, Tensor) and t.numel():
                    self._created.add(t.untyped_storage().data_ptr())
        return out

    def _snapshot(self, t: Tensor) -> None:
        if not t.numel():
            return
        sp = t.untyped_storage().data_ptr()
        if sp in self._created:
            return
        view = (sp, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if view in self._seen:
            return
        self._seen.add(view)
        with dispatch_disabled():
            self._snaps.append((t, t.detach().clone()))

    def restore(self) -> None:
        """Write every snapshot back, latest first (overlapping views end with the oldest value)."""
        with torch.no_grad():
            for t, v in reversed(self._snaps):
                t.copy_(v)
        self._snaps.clear()


# Arguments that kernels write although their schemas do not say so (the batch-norm family's running statistics).
_UNMARKED_WRITES = frozenset({"running_mean", "running_var"})


def _metrics(out: Any, named_params: Sequence[tuple[str, Tensor]]) -> dict[str, float]:
    leaves, _ = flatten(out)
    vals: dict[str, float] = {}
    if leaves:
        vals["loss"] = float(leaves[0].detach().float().sum())
    grads = [p.grad for _, p in named_params if p.grad is not None]
    if grads:
        vals["grad_norm"] = float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))
    return vals


def _gap(graph: Sequence[Tensor], user: Sequence[Tensor]) -> tuple[float, float]:
    """``(max |graph - user|, max of that over the parameter's largest |user|)`` over the parameters."""
    gap_abs = gap_rel = 0.0
    for a, b in zip(graph, user):
        d = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
        scale = float(b.float().abs().max()) if b.numel() else 0.0
        gap_abs = max(gap_abs, d)
        gap_rel = max(gap_rel, d / scale if scale else (0.0 if d == 0 else float("inf")))
    return gap_abs, gap_rel


def _close(a: float, b: float, rtol: float) -> bool:
    if a != a or b != b:  # NaN never passes
        return False
    return a == b if rtol == 0 else abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


def _close_t(a: Tensor, b: Tensor, rtol: float) -> bool:
    if rtol == 0:
        return torch.equal(a, b)
    return torch.allclose(a.float(), b.float(), rtol=rtol, atol=0.0)
