"""Every use of torch's private or underscore APIs by the core, behind one version check.

Checked against torch 2.4 - 2.13 (2.11 on the GPU host, 2.13 CPU in CI). Above the newest tested
version the package still runs and warns once; below the minimum it refuses.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Optional

import torch
from packaging.version import Version
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .warn import check_tested_version

__all__ = [
    "TORCH_VERSION",
    "check_torch_version",
    "copy_all",
    "foreach_max_abs",
    "quiet_uncaptured_capturable",
    "set_found_inf",
    "clear_found_inf",
    "compiled_with_cuda_graphs",
    "ObservingMode",
    "compiled_runs_under_modes",
    "compiled_submodule",
    "compiler_of",
    "is_compiled",
    "FOREACH_NORM",
    "dispatch_disabled",
    "written_arguments",
    "returns_alias",
    "ADAM_STEP_SHAPE",
    "adam_functional",
    "AdamGroupLists",
    "adam_init_group",
    "adam_step_is_torchs",
    "runs_foreach",
    "scalar_division",
    "scalar_division_kind",
    "plain_torch_function",
    "mark_step_called",
    "sgd_init_group",
    "sgd_step_is_torchs",
    "autocast_cache_disabled",
    "donated_buffers_off",
    "autocast_state",
    "zero_grads_in_place",
    "grad_accumulator",
    "backward_runs",
    "backward_pass_id",
    "at_backward_end",
    "has_grad_hooks",
    "drop_empty_grad_hooks",
    "is_view",
]

TORCH_VERSION = Version(torch.__version__.split("+")[0])
MIN_TORCH = Version("2.4.0")
MAX_TESTED_TORCH = Version("2.13.0")


def check_torch_version() -> None:
    check_tested_version(
        "torch", TORCH_VERSION, MIN_TORCH, MAX_TESTED_TORCH,
        "torch._foreach_norm/_foreach_copy_, optimizer attributes (found_inf, _warned_capturable_if_run_uncaptured) "
        "and the autograd engine's pass queries (_will_engine_execute_node, _current_graph_task_id)",
    )


_has_foreach_copy = hasattr(torch, "_foreach_copy_")


def copy_all(dst: Sequence[Tensor], src: Sequence[Tensor]) -> None:
    """``d.copy_(s, non_blocking=True)`` for each pair: one multi-tensor launch where torch has one."""
    if len(dst) == 1:
        dst[0].copy_(src[0], non_blocking=True)
    elif _has_foreach_copy and len(dst) > 1:
        torch._foreach_copy_(dst, src, non_blocking=True)
    else:
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)


def foreach_max_abs(tensors: list[Tensor]) -> list[Tensor]:
    """Each tensor's max |x| (non-finite iff the tensor holds a NaN/Inf; unlike the 2-norm it cannot
    overflow for finite values), in one multi-tensor kernel on CUDA."""
    return list(torch._foreach_norm(tensors, float("inf")))


def quiet_uncaptured_capturable(optimizer: Any) -> None:
    """Warm-up steps run a capturable optimizer outside a graph on purpose; torch would warn once."""
    optimizer._warned_capturable_if_run_uncaptured = True


def set_found_inf(optimizer: Any, found_inf: Tensor) -> None:
    """torch's fused Adam/AdamW/SGD read ``optimizer.found_inf`` and skip the update on the device."""
    optimizer.found_inf = found_inf


def clear_found_inf(optimizer: Any, found_inf: Tensor) -> None:
    if getattr(optimizer, "found_inf", None) is found_inf:
        del optimizer.found_inf


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper of a module (``OptimizedModule``: it holds ``_orig_mod``)."""
    return hasattr(module, "_orig_mod")


def compiler_of(compiled: torch.nn.Module) -> Any:
    """What compiles a callable as ``torch.compile`` compiled ``compiled`` (the same backend, mode, options,
    ``dynamic`` and ``fullgraph``), ``None`` where its wrapper keeps nothing to compile with.

    That is the wrapper's dynamo context (``OptimizedModule.dynamo_ctx``, torch 2.0 to 2.13): what ``torch.compile``
    applied to the module's call; applied to another callable it compiles that one the same way. A submodule's bound
    ``forward`` compiles the submodule's own code only: instances of one class share that code and, where dynamo
    inlines ``nn.Module`` calls (torch 2.5+), one compiled graph."""
    ctx = getattr(compiled, "dynamo_ctx", None)
    return ctx if callable(ctx) else None


def compiled_submodule(module: torch.nn.Module) -> Optional[str]:
    """The name (``""`` for ``module`` itself) of the first submodule that is ``torch.compile``'s wrapper of a module,
    else ``None``."""
    return next((name for name, m in module.named_modules() if is_compiled(m)), None)


def compiled_with_cuda_graphs(module: torch.nn.Module) -> Any:
    """The name (``""`` for ``module`` itself) of the first submodule that ``torch.compile`` compiles with its own
    CUDA graphs (``mode="reduce-overhead"``/``"max-autotune"``, ``options={"triton.cudagraphs": True}``, or that
    inductor option set globally), else ``None``. Those graphs are captured and replayed by inductor's CUDA graph
    trees when the compiled code runs, which cannot happen inside another graph's capture."""
    for name, m in module.named_modules():
        get_config = getattr(m, "get_compiler_config", None)  # torch.compile's OptimizedModule
        if get_config is None or not is_compiled(m):
            continue
        # Inductor's options as this compile will use them (its mode and the global config); None for other backends.
        config = get_config()
        if config is not None and config.get("triton.cudagraphs"):
            return name
    return None


# Dispatch modes (``torch.utils._python_dispatch``): the parity recorder (``core/parity.py``) and the NaN guard's
# norm tap see every operator a step runs, with its schema.
#: the multi-tensor norm operator (``torch._foreach_norm``), as a dispatch mode sees it
FOREACH_NORM = torch.ops.aten._foreach_norm.Scalar


_COMPILED_RUNS_UNDER_MODES = hasattr(TorchDispatchMode, "ignore_compile_internals")


def compiled_runs_under_modes() -> bool:
    """Whether ``torch.compile``d code can run compiled under a dispatch mode (:class:`ObservingMode`; torch 2.9+).
    Before, dynamo runs it eagerly under any dispatch mode that is not torch's own, with no way to say otherwise."""
    return _COMPILED_RUNS_UNDER_MODES


class ObservingMode(TorchDispatchMode):
    """The base of the package's dispatch modes: they watch the operators a step dispatches, and ``torch.compile``d
    code keeps running compiled under them (its fused kernels are not dispatched, so these modes do not see them;
    the extern calls it makes, matrix products among them, they do).

    Dynamo runs a compiled function eagerly under a dispatch mode that does not declare this, and marks the code it
    skipped to run eagerly from then on (torch 2.11 and 2.13, ``convert_frame``: "non-infra torch dispatch mode
    present"): one counted or verified step would leave the user's compiled model uncompiled for the rest of the
    process, slower and with eager's rounding. Torch versions without the hook (before 2.9,
    :func:`compiled_runs_under_modes`) run compiled code eagerly under any mode: the package does not enter these modes
    around a compiled module there.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def dispatch_disabled() -> Any:
    """A context in which the active dispatch modes do not see the operators run (a mode's own work)."""
    return _disable_current_modes()


@functools.cache
def written_arguments(func: Any) -> tuple[tuple[int, str, bool], ...]:
    """``(position, name, written)`` of each argument of the operator ``func``; ``written``: its schema marks it
    ``Tensor(a!)`` (read once per operator)."""
    return tuple((i, a.name, a.alias_info is not None and a.alias_info.is_write)
                 for i, a in enumerate(func._schema.arguments))


def returns_alias(func: Any) -> bool:
    """Some result of the operator ``func`` is a view of, or a write into, an argument (its schema says so)."""
    return any(r.alias_info is not None for r in func._schema.returns)


# torch versions whose ``Adam.step``, ``Adam._init_group`` and capturable multi-tensor update
# (``torch/optim/adam.py``: ``_multi_tensor_adam``) have the shape ``core/adam_step.py`` mirrors: the same
# operations in the same order, read from the sources of 2.11 (the GPU host) and 2.13 (CI) (2.12 lies between).
# ``core/user_sgd.py`` mirrors ``SGD.step`` (``torch/optim/sgd.py``: ``_multi_tensor_sgd``, ``_single_tensor_sgd``)
# over the same range.
ADAM_STEP_SHAPE = (Version("2.11.0"), Version("2.13.99"))


def adam_step_is_torchs(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s class runs torch's own ``Adam.step`` (``AdamW`` inherits it; a subclass may not)."""
    import inspect

    mine = inspect.unwrap(type(optimizer).step)  # torch wraps ``step`` with its hook runner per class
    return mine is inspect.unwrap(torch.optim.Adam.step)


def sgd_step_is_torchs(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s class runs torch's own ``SGD.step`` (a subclass may override it)."""
    import inspect

    return inspect.unwrap(type(optimizer).step) is inspect.unwrap(torch.optim.SGD.step)


def sgd_init_group(optimizer: Any, group: dict, params: list, grads: list, momentum_buffer_list: list) -> bool:
    """torch's ``SGD._init_group``: fills the lists for the parameters that have a gradient (momentum buffers only
    where ``momentum != 0``, ``None`` before their first step); returns whether a gradient is sparse."""
    return optimizer._init_group(group, params, grads, momentum_buffer_list)


class AdamGroupLists(NamedTuple):
    """One param group's tensors as ``Adam.step`` gathers them (the parameters that have a gradient)."""

    params: list
    grads: list
    exp_avgs: list
    exp_avg_sqs: list
    max_exp_avg_sqs: list
    steps: list
    has_complex: bool


def adam_init_group(optimizer: Any, group: dict) -> AdamGroupLists:
    """torch's ``Adam._init_group``: the lists for the parameters that have a gradient, their state created on their
    first step, and whether any is complex."""
    lists: tuple[list, ...] = ([], [], [], [], [], [])
    has_complex = optimizer._init_group(group, *lists)
    return AdamGroupLists(*lists, has_complex=bool(has_complex))


def adam_functional(optimizer: Any, group: dict, params: list, grads: list, exp_avgs: list, exp_avg_sqs: list,
                    max_exp_avg_sqs: list, state_steps: list, has_complex: bool, lr: Any = None) -> None:
    """torch's update of one param group, called exactly as ``Adam.step`` calls it (``lr``: in place of the
    group's)."""
    from torch.optim.adam import adam

    beta1, beta2 = group["betas"]
    adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
        amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
        lr=group["lr"] if lr is None else lr,
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"],
        capturable=group["capturable"], differentiable=group["differentiable"], fused=group["fused"],
        grad_scale=getattr(optimizer, "grad_scale", None), found_inf=getattr(optimizer, "found_inf", None),
        decoupled_weight_decay=group["decoupled_weight_decay"],
    )


def runs_foreach(group: dict, params: list, adam: bool = True) -> bool:
    """Whether torch's ``adam()`` (``adam=False``: ``sgd()``) runs its multi-tensor update for a non-fused group:
    ``foreach`` as set; unset with ``fused`` unset too, torch's default (CUDA tensors: yes, except Adam's for a tensor
    ``lr`` in a group that is not capturable; CPU: the for-loop update); unset with ``fused=False``, the for-loop
    update."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    foreach = group.get("foreach")
    if foreach is None and group.get("fused") is None:
        # torch's adam() leaves foreach off for a tensor lr without capturable (its for-loop update takes one)
        tensor_lr = adam and isinstance(group.get("lr"), Tensor) and not group.get("capturable")
        return _default_to_fused_or_foreach(params, False, use_fused=False)[1] and not tensor_lr
    return bool(foreach)


#: a divisor whose float32 reciprocal (``1.0f / float32(x)``) and double reciprocal rounded to float32
#: (``float32(1.0 / x)``) differ, and dividends that tell a multiply by either from an IEEE division
_PROBE_DIVISOR = 0.37765725201563405
_PROBE_POINTS = 4097


def scalar_division_kind(x: Tensor, divisor: float, result: Tensor) -> Optional[str]:
    """How ``result`` (float32) was computed as ``x / divisor`` (``divisor`` a Python float): ``"double"`` (a multiply by
    the reciprocal computed in double and rounded to float32), ``"float32"`` (a multiply by ``1.0f / float32(divisor)``),
    ``"divide"`` (an IEEE division by ``float32(divisor)``), or ``None`` (none of them). Every product is one float32
    rounding on the host, as a GPU rounds it."""
    x, result = x.detach().cpu(), result.detach().cpu()
    d = torch.tensor(divisor, dtype=torch.float64)
    candidates = {"double": x * (1.0 / d).to(torch.float32),
                  "float32": x * (torch.ones((), dtype=torch.float32) / d.to(torch.float32)),
                  "divide": x / d.to(torch.float32)}
    found = [k for k, v in candidates.items() if torch.equal(v, result)]
    return found[0] if len(found) == 1 else None


def scalar_division(device: torch.device) -> Optional[str]:
    """How this torch divides a float32 tensor on ``device`` by a Python float (``t / x``, as the for-loop Adam divides
    by ``bias_correction2_sqrt``), as :func:`scalar_division_kind` names it. CUDA's kernel multiplies by a reciprocal
    formed on the host (in double or in float32: torch versions differ, so it is measured once per device, a host read:
    call this outside any capture first); the CPU's divides."""
    if device.type != "cuda":
        return "divide"
    return _cuda_scalar_division(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_scalar_division(index: int) -> Optional[str]:
    x = torch.linspace(1, 2, _PROBE_POINTS, dtype=torch.float32, device=torch.device("cuda", index))
    return scalar_division_kind(x, _PROBE_DIVISOR, x / _PROBE_DIVISOR)


#: a ``Tensor`` subclass's ``__torch_function__`` that makes every operation treat it as a plain tensor (its results are
#: plain tensors)
plain_torch_function = torch._C._disabled_torch_function_impl


def mark_step_called(optimizer: Any) -> None:
    """What torch's LR scheduler's wrapper of ``optimizer.step`` records (it warns when a schedule steps first): set
    by a step that stands in for the wrapped one."""
    optimizer._opt_called = True


def donated_buffers_off() -> Any:
    """AOTAutograd's check of donated buffers off in the block (torch 2.6+; a no-op before): a compiled backward whose
    saved tensors it may overwrite refuses ``retain_graph=True`` under it, which the partial tier's backward capture
    passes (a CUDA capture only records, so the eager backward after a failed capture is the first to run them)."""
    import torch._functorch.config as config

    return config.patch(donated_buffer=False) if hasattr(config, "donated_buffer") else contextlib.nullcontext()


@contextlib.contextmanager
def autocast_cache_disabled() -> Iterator[None]:
    """Autocast's cache of cast weights off (restored after): casts run where they are called, every time."""
    prev = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(prev)


def autocast_state(device_type: str) -> tuple[bool, Any]:
    """Whether autocast is on for ``device_type`` and its dtype: a graph bakes in both."""
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def zero_grads_in_place(optimizer: Any) -> Optional[list[tuple[Tensor, Tensor]]]:
    """torch's ``Optimizer.zero_grad(set_to_none=False)``: each existing gradient detached from any graph and zeroed,
    with one multi-tensor zero per device and dtype (torch takes that path only for optimizers whose defaults say
    foreach or fused, else one kernel per gradient; the values are the same zeros). Returns ``(parameter, .grad)`` of
    each gradient zeroed; ``None`` where the optimizer's class has a ``zero_grad`` of its own (nothing is done: call
    it)."""
    if type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad:
        return None
    dense: dict[tuple[Any, Any], list] = {}
    zeroed = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            zeroed.append((p, g))
            if g.grad_fn is not None:
                g.detach_()
            else:
                g.requires_grad_(False)
            if g.is_sparse:
                g.zero_()
            else:
                dense.setdefault((g.device, g.dtype), []).append(g)
    for grads in dense.values():
        torch._foreach_zero_(grads)
    return zeroed


def grad_accumulator(leaf: Tensor) -> Any:
    """The autograd node that adds a leaf tensor's gradients into its ``.grad`` (its ``AccumulateGrad``; made where
    there is none yet, and kept by the leaf while a graph of autograd holds it)."""
    with torch.enable_grad():
        return leaf.view_as(leaf).grad_fn.next_functions[0][0]


def backward_runs(node: Any) -> bool:
    """Whether the backward pass running now (call it inside one) runs ``node``: an ``AccumulateGrad`` of a leaf
    that is none of the pass's ``inputs`` runs in ``backward()`` without ``inputs`` only (not in ``autograd.grad``,
    nor in ``backward(inputs=...)``)."""
    return torch._C._will_engine_execute_node(node)


def backward_pass_id() -> int:
    """An id of the backward pass running now, never reused (``-1`` outside one)."""
    return torch._C._current_graph_task_id()


def at_backward_end(fn: Any) -> None:
    """Run ``fn()`` once the backward pass running now has run every node (not where the pass raises)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def has_grad_hooks(leaf: Tensor) -> bool:
    """Whether hooks registered on the tensor expect to see its gradient (``register_hook``,
    ``register_post_accumulate_grad_hook``)."""
    return bool(leaf._backward_hooks) or bool(leaf._post_accumulate_grad_hooks)


def is_view(t: Tensor) -> bool:
    """Whether ``t`` is a view of another tensor (sharing its version counter)."""
    return t._is_view()


def drop_empty_grad_hooks(leaf: Tensor) -> None:
    """After the last ``register_hook`` handle of a tensor that had none was removed: torch keeps an empty hook
    dictionary that autograd still calls (the GIL taken, every backward); leave the tensor without it, as it was. Not
    inside the hooks' own call."""
    if leaf._backward_hooks is not None and not leaf._backward_hooks:
        leaf._backward_hooks = None
