"""Make torch optimizers run inside a CUDA graph, and keep their hyperparameters live.

Inside a graph every Python float an optimizer uses is frozen into the kernels' arguments at
capture. So that LR schedulers keep working, the learning rate (and Adam's betas) become
one-element device tensors that schedulers update in place (``fill_``, which torch's
schedulers already do for tensor values); the kernels read them on every replay.

What is changed, per param group, until :meth:`OptimizerPrep.restore`:
- Adam/AdamW (and any optimizer with a ``capturable`` option): ``capturable=True``; step
  counters live on the device. An optimizer that fixes its capturable mode when it is built
  (TransformerEngine's ``FusedAdam(capturable=True)``: its ``lr`` is a device tensor per group and
  its step count a device tensor, kept by itself) is left as it is: its own update is captured.
- SGD: ``fused=True`` (the fused kernel takes ``lr`` as a device tensor without a host sync).
- ``lr`` (and ``betas`` where supported) become device tensors.
- ``nan_action="skip"``: Adam/AdamW/SGD run their fused kernels, which skip the update on the
  device when ``optimizer.found_inf`` is set.

With ``math="eager"`` (the default of ``CaptureConfig.optimizer_math``), a torch Adam/AdamW that
:func:`.user_adam.why_not` accepts, or an SGD that :func:`.user_sgd.why_not` accepts, keeps its own settings and
float ``lr`` instead: its own non-capturable update is captured with the host's scalars read from the device
(:mod:`.user_adam`, :mod:`.user_sgd`), so graphed steps give the bits of the user's eager steps. Anything else
gets the capturable preparation above, and :attr:`OptimizerPrep.math_differs` says why; with ``verify_steps``,
:meth:`OptimizerPrep.users_step` lets the first verified step measure by how much (``stats.optimizer_math_gap``).

Any other scalar hyperparameter (``weight_decay``, ``eps``, SGD ``momentum``...) stays a float:
:meth:`OptimizerPrep.changed_scalars` reports a change so the engine can re-capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import Tensor

from . import user_adam, user_fused_adam, user_sgd
from ._torch_compat import (
    check_torch_version,
    clear_found_inf,
    plain_torch_function,
    quiet_uncaptured_capturable,
    set_found_inf,
    zero_grads_in_place,
)
from .user_step import UserStep

__all__ = ["OptimizerPrep", "ParamGroupWatch", "built_capturable", "check_optimizer_supported",
           "portable_optimizer_state", "zero_grads_in_place"]

# Optimizers that cannot run inside a graph at all, with what to use instead.
_REFUSED: dict[str, str] = {
    "LBFGS": "LBFGS re-evaluates the closure several times per step and reads the loss on the host",
    "SparseAdam": "SparseAdam works on sparse gradients, whose shapes change every step",
}

# Optimizers whose update takes tensor lr/betas inside a graph (verified on torch >= 2.4).
_TENSOR_LR = ("Adam", "AdamW", "SGD")
_TENSOR_BETAS = ("Adam", "AdamW")


def _family(optimizer: torch.optim.Optimizer) -> Optional[str]:
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in _TENSOR_LR + tuple(_REFUSED):
            return cls.__name__
    return None


def built_capturable(optimizer: torch.optim.Optimizer) -> Optional[bool]:
    """The capturable mode of an optimizer that fixes it when it is built and keeps it as an attribute, not in its
    param groups: TransformerEngine's ``FusedAdam`` (``self.capturable``; only then does it make each group's ``lr``
    a device tensor and its step count a device tensor, TE 2.20 ``optimizers/fused_adam.py``). ``None`` for an
    optimizer with a per-group ``capturable`` option (torch's convention: the preparation switches it on) or none."""
    if "capturable" in optimizer.defaults:
        return None
    mode = getattr(optimizer, "capturable", None)
    return mode if isinstance(mode, bool) else None


def check_optimizer_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``TypeError`` naming the optimizer and the alternative if it cannot be graphed."""
    name = type(optimizer).__name__
    fam = _family(optimizer)
    if fam in _REFUSED or name in _REFUSED:
        why = _REFUSED.get(fam or name)
        raise TypeError(
            f"{name} cannot run inside a CUDA graph: {why}. Use torch.optim.AdamW, Adam or SGD "
            "(or disable CUDA graphs for this model)."
        )
    built = built_capturable(optimizer) if fam is None else None
    if built is False:
        raise TypeError(
            f"{name} was built with capturable=False: its step keeps the step count and the learning rate on the "
            "host, so every replay would repeat the captured step's values, and the mode cannot be switched "
            f"afterwards. Build it with {name}(..., capturable=True), or use torch.optim.AdamW, Adam or SGD."
        )
    if fam is None and built is None and "capturable" not in optimizer.defaults:
        raise TypeError(
            f"{name} has no `capturable` option, so its step may sync with the host or keep state on the CPU "
            "and cannot be captured safely. Use torch.optim.AdamW, Adam or SGD, or an optimizer built with "
            "capturable=True (e.g. TransformerEngine's FusedAdam(capturable=True) on parameters that are not FP8)."
        )
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            raise TypeError(f"{name} param group {i} has differentiable=True, which cannot be captured.")
        for p in group["params"]:
            if p.is_sparse:
                raise TypeError(f"{name} param group {i} holds a sparse parameter; sparse updates cannot be captured.")


def _to_float(v: Any) -> Any:
    return float(v) if isinstance(v, Tensor) else v


_PROBES: dict[tuple, tuple[bool, bool]] = {}


def probe_tensor_hyperparams(optimizer: torch.optim.Optimizer, device: torch.device, fused: bool) -> tuple[bool, bool]:
    """Can this torch's ``type(optimizer)`` read ``lr`` / ``betas`` from device tensors without a host sync?

    Answered by running two steps of a one-parameter copy of the optimizer under
    ``set_sync_debug_mode("error")`` (once per class and device). torch's foreach Adam, for
    example, accepts tensor betas but turns them into host scalars (a sync), which a graph cannot
    capture; then betas stay floats and a scheduler that cycles them is refused (see the runner).
    """
    fam = _family(optimizer)
    key = (fam, str(device), fused)
    if key in _PROBES:
        return _PROBES[key]
    if device.type != "cuda" or fam not in _TENSOR_LR:
        _PROBES[key] = result = (fam in _TENSOR_LR, False)
        return result
    cls = type(optimizer) if type(optimizer).__module__.startswith("torch.optim") else getattr(torch.optim, fam)

    def works(tensor_betas: bool) -> bool:
        p = torch.nn.Parameter(torch.ones(4, device=device))
        kw: dict[str, Any] = {"lr": torch.tensor(0.01, device=device)}
        if fam in _TENSOR_BETAS:
            kw["capturable"] = True
            if tensor_betas:
                kw["betas"] = (torch.tensor(0.9, device=device), torch.tensor(0.99, device=device))
        if fused or fam == "SGD":
            kw["fused"] = True
        try:
            opt = cls([p], **kw)
            quiet_uncaptured_capturable(opt)
            prev = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(2):
                    p.grad = torch.ones_like(p)
                    opt.step()
            finally:
                torch.cuda.set_sync_debug_mode(prev)
        except (RuntimeError, ValueError, TypeError):
            return False
        return True

    with torch.cuda.device(device):
        if fam in _TENSOR_BETAS and works(True):
            result = (True, True)
        else:
            result = (works(False), False)
    _PROBES[key] = result
    return result


def _to_float_tree(v: Any) -> Any:
    return tuple(_to_float(x) for x in v) if isinstance(v, tuple) else _to_float(v)


def _is_scalar_value(v: Any) -> bool:
    if isinstance(v, (int, float, bool)):
        return True
    return isinstance(v, tuple) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)


class OptimizerPrep:
    """Switch one optimizer to its graph-safe configuration and watch its hyperparameters.

    Call :meth:`apply` after the optimizer exists (and after any checkpoint was loaded) and before
    the first eager warm-up step; :meth:`sync_hyperparams` before every replay (cheap: identity and
    float comparisons); :meth:`restore` at the end of training.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        skip_nonfinite: bool = False,
        tensor_hparams: Optional[tuple[bool, bool]] = None,
        math: str = "capturable",
        step_count: Optional[Callable[[], int]] = None,
        device_type: Optional[str] = None,
        before_update: Optional[Callable[[], None]] = None,
    ) -> None:
        check_torch_version()
        check_optimizer_supported(optimizer)
        self.tensor_hparams = tensor_hparams
        self.math = math
        self.step_count = step_count
        self.device_type = device_type or device.type
        #: handed to the captured user update (:attr:`.user_step.UserStep.before_update`)
        self.before_update = before_update
        #: the user's own update, captured (``math="eager"`` where it applies), else ``None``
        self.user: Optional[UserStep] = None
        #: why the graphed update is not the user's own (``""`` when it is)
        self.math_differs = ""
        self.optimizer = optimizer
        self.device = device
        self.skip_nonfinite = skip_nonfinite
        self.family = _family(optimizer)
        self._saved: list[dict[str, Any]] = []
        # (group, key, tensor-or-tuple object installed by us)
        self._live: list[tuple[dict, str, Any]] = []
        # (group, key, float value at capture) for scalars a graph bakes in
        self._frozen: list[tuple[dict, str, Any]] = []
        self.found_inf: Optional[Tensor] = None
        self.applied = False

    # -- setup ---------------------------------------------------------------------------------
    def apply(self) -> None:
        opt = self.optimizer
        fam = self.family
        if self.skip_nonfinite and fam not in ("Adam", "AdamW", "SGD"):
            raise TypeError(
                f"nan_action='skip' needs an optimizer with a fused kernel that honours found_inf "
                f"(torch.optim.Adam, AdamW or SGD), not {type(opt).__name__}. Use nan_action='raise'."
            )
        if self.math == "eager" and self._apply_user_math():
            return
        fused = fam == "SGD" or (self.skip_nonfinite and fam in ("Adam", "AdamW"))
        lr_t, betas_t = self.tensor_hparams or probe_tensor_hyperparams(opt, self.device, fused)
        # An optimizer of its own whose groups hold lr as float32 tensors on the device (TE's FusedAdam and
        # MasterWeightAdamW built capturable) reads them in its update: they are followed like ours, so a float a
        # scheduler or the user assigns between steps reaches the graph too.
        lr_t = lr_t or (fam is None and bool(opt.param_groups) and all(
            isinstance(g["lr"], Tensor) and g["lr"].device == self.device and g["lr"].dtype == torch.float32
            for g in opt.param_groups))
        self._live = []
        for i, group in enumerate(opt.param_groups):
            # A re-apply (after load_state_dict, or for a group added later) keeps the user's original settings.
            if i == len(self._saved):
                self._saved.append({k: group[k] for k in ("lr", "betas", "capturable", "fused", "foreach") if k in group})
            if "capturable" in group:
                group["capturable"] = True
            if fused:
                # Fused kernels take lr as a tensor without host syncs and honour found_inf.
                group["fused"] = True
                group["foreach"] = False
            if lr_t:
                lr = group["lr"]
                if not (isinstance(lr, Tensor) and lr.device == self.device and lr.dtype == torch.float32):
                    group["lr"] = _Assigned.make(_to_float(lr), self.device)
                self._live.append((group, "lr", group["lr"]))
            if betas_t and "betas" in group:
                b1, b2 = group["betas"]
                group["betas"] = tuple(
                    b if isinstance(b, Tensor) and b.device == self.device else
                    _Assigned.make(_to_float(b), self.device)
                    for b in (b1, b2)
                )
                self._live.append((group, "betas", group["betas"]))
        # Step counters must live on the device for capturable/fused updates (a checkpoint loaded
        # into a non-capturable optimizer keeps them on the CPU).
        for p, state in opt.state.items():
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, Tensor) and step.device != p.device:
                state["step"] = step.to(device=p.device, dtype=torch.float32)
        if self.skip_nonfinite:
            self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)  # 0-d, like GradScaler's
            set_found_inf(opt, self.found_inf)
        quiet_uncaptured_capturable(opt)
        own = built_capturable(opt) or (self._saved and all(s.get("capturable") for s in self._saved))
        if fam is None and own:
            self.math_differs = ""  # the optimizer's own capturable update, which the preparation did not change
        self.freeze_scalars()
        self.applied = True

    def _apply_user_math(self) -> bool:
        """``math="eager"``: capture the user's own update where :mod:`.user_adam` covers it (else say why)."""
        opt = self.optimizer
        previous = self.user
        if previous is not None:  # a re-apply (load_state_dict, a group added): counters and tables read again
            previous.remove()
            self.user = None
        sgd = isinstance(opt, torch.optim.SGD)
        fused = not sgd and user_fused_adam.all_fused(opt)
        why = (user_sgd if sgd else user_fused_adam if fused else user_adam).why_not(opt, self.device_type,
                                                                                     self.skip_nonfinite)
        if why is not None:
            self.math_differs = f"the plugin's capturable update of {type(opt).__name__} is captured ({why})"
            return False
        for i, group in enumerate(opt.param_groups):
            if i == len(self._saved):
                self._saved.append({k: group[k] for k in ("lr", "betas", "capturable", "fused", "foreach") if k in group})
        self.user = (user_sgd.UserMathSGD(opt, self.device) if sgd
                     else user_fused_adam.UserMathFusedAdam(opt, self.device, previous) if fused
                     else user_adam.UserMathAdam(opt, self.device, self.step_count))
        self.user.before_update = self.before_update
        self.user.install()
        if self.skip_nonfinite and self.found_inf is None:
            # only the fused update gets here with it (why_not): its kernel reads the flag and skips on the device
            self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)  # 0-d, like GradScaler's
            set_found_inf(opt, self.found_inf)
        self._live = []
        self.math_differs = ""
        self.freeze_scalars()
        self.applied = True
        return True

    def freeze_scalars(self) -> None:
        """Record every float hyperparameter a graph will bake in (called at each capture)."""
        live = {(id(g), k) for g, k, _ in self._live}
        if self.user is not None:  # read from the device on every step
            live |= {(id(g), "lr") for g in self.optimizer.param_groups}
        self._frozen = [
            (g, k, v)
            for g in self.optimizer.param_groups
            for k, v in g.items()
            if k != "params" and (id(g), k) not in live and _is_scalar_value(v)
        ]

    # -- per step ------------------------------------------------------------------------------
    def sync_hyperparams(self) -> Optional[str]:
        """Push scheduler changes into the device tensors; report a frozen scalar that changed.

        Returns ``None`` when every captured graph is still valid, else ``"group i: key a -> b"``.
        """
        if len(self.optimizer.param_groups) != len(self._saved):
            # A group added during training (fine-tuning callbacks unfreezing layers): its float lr and betas
            # would be baked in, so it gets device tensors too, and graphs without it are re-captured.
            self.apply()
            return f"param group {len(self._saved) - 1} added to the optimizer"
        if self.user is not None and (changed := self.user.sync()) is not None:
            return changed
        for group, key, obj in self._live:
            cur = group[key]
            if cur is not obj:  # a scheduler assigned a new float/tuple: copy it into our tensors
                if key == "lr":
                    obj.fill_(cur if isinstance(cur, Tensor) else float(cur))
                else:
                    for t, v in zip(obj, cur):
                        if v is not t:
                            t.fill_(v if isinstance(v, Tensor) else float(v))
                group[key] = obj
        for group, key, value in self._frozen:
            if group[key] != value:
                idx = _group_index(self.optimizer, group)
                return f"param group {idx}: {key} {value!r} -> {_to_float_tree(group[key])!r}"
        return None

    def portable_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` (the optimizer's) with float lr/betas and the kernel flags the user set before
        :meth:`apply` changed them, so it loads anywhere (in place; also returned)."""
        return portable_optimizer_state(state_dict, self._saved)

    # -- teardown ------------------------------------------------------------------------------
    def restore(self) -> None:
        """Put back float hyperparameters (current values) and the original kernel choices."""
        if not self.applied:
            return
        if self.user is not None:
            self.user.remove()
            self.user = None
            # The user's non-capturable, non-fused update keeps its step counters on the CPU (a fused one on the
            # device).
            on_host = not user_fused_adam.all_fused(self.optimizer)
            for state in self.optimizer.state.values() if on_host else ():
                step = state.get("step") if isinstance(state, dict) else None
                if isinstance(step, Tensor) and step.device.type != "cpu":
                    state["step"] = step.cpu()
        for group, saved in zip(self.optimizer.param_groups, self._saved):
            for k in ("capturable", "fused", "foreach"):
                if k in saved:
                    group[k] = saved[k]
            if isinstance(group.get("lr"), Tensor) and not isinstance(saved.get("lr"), Tensor):
                group["lr"] = float(group["lr"])
            if "betas" in group and not any(isinstance(b, Tensor) for b in saved.get("betas", ())):
                group["betas"] = tuple(_to_float(b) for b in group["betas"])
        self._saved = []
        if self.found_inf is not None:
            clear_found_inf(self.optimizer, self.found_inf)
        self.found_inf = None
        self.applied = False

    def state_tensors(self, names: Optional[dict[int, str]] = None) -> list[tuple[str, Tensor]]:
        """Every tensor a captured optimizer step reads or writes, named for messages (address checks).

        Args:
            names: ``id(parameter) -> name``; parameters not in it are named by position.
        """
        names = names or {}
        out: list[tuple[str, Tensor]] = []
        for i, (p, state) in enumerate(self.optimizer.state.items()):
            if isinstance(state, dict):
                pname = names.get(id(p), f"#{i}")
                out.extend((f"optimizer state {k} of {pname}", v) for k, v in state.items() if isinstance(v, Tensor))
        if self.user is not None:
            out.extend(self.user.tensors())
        for g, k, obj in self._live:
            idx = _group_index(self.optimizer, g)
            if k == "lr":
                out.append((f"param group {idx} lr tensor", obj))
            else:
                out.extend((f"param group {idx} {k}[{j}] tensor", t) for j, t in enumerate(obj))
        return out


    def users_step(self) -> Optional[contextlib.AbstractContextManager]:
        """Where the graphed update is not the user's own (:attr:`math_differs`): a context in which the optimizer runs
        with the user's settings (their ``capturable``/``fused``/``foreach``, float ``lr``/``betas`` as their code last
        assigned them, no ``found_inf``), to measure how far the graphed math is from their step (``verify_steps``).
        ``None`` where the graphed update is theirs."""
        if self.user is not None or not self.applied or not self.math_differs:
            return None
        return self._users_settings()

    @contextlib.contextmanager
    def _users_settings(self) -> Iterator[None]:
        opt = self.optimizer
        swapped: list[tuple[dict, dict[str, Any]]] = []
        for group, saved in zip(opt.param_groups, self._saved):
            swapped.append((group, {k: group[k] for k in saved}))
            for k, v in saved.items():
                if k in ("lr", "betas") and not _has_tensor(v):  # the floats the user's code last wrote
                    v = tuple(_users_float(x) for x in group[k]) if k == "betas" else _users_float(group[k])
                group[k] = v
        found_inf = self.found_inf
        if found_inf is not None:
            clear_found_inf(opt, found_inf)
        try:
            yield
        finally:
            for group, prepared in swapped:
                group.update(prepared)
            if found_inf is not None:
                set_found_inf(opt, found_inf)

    def reference_step(self) -> contextlib.AbstractContextManager:
        """Inside the block the optimizer runs the user's own eager step (``verify_steps``' reference): torch's own
        ``step`` where the user's update is captured; elsewhere the prepared eager step (the graphed math)."""
        return self.user.torchs_step() if self.user is not None else contextlib.nullcontext()


class _Assigned(Tensor):
    """A hyperparameter's float32 device tensor (a plain tensor to every operation) that remembers the Python number
    last written into it with ``fill_`` (by an LR scheduler, or by :meth:`OptimizerPrep.sync_hyperparams` copying a
    float the user's code assigned): the user's double, of which the tensor holds the float32 rounding."""

    __torch_function__ = plain_torch_function

    @classmethod
    def make(cls, value: float, device: torch.device) -> _Assigned:
        t = torch.tensor(value, dtype=torch.float32, device=device).as_subclass(cls)
        t.assigned = value
        return t

    def fill_(self, value: Any) -> Tensor:  # type: ignore[override]
        self.assigned = value if not isinstance(value, Tensor) else None
        return super().fill_(value)

    # Copies and pickles (a deep-copied or saved state_dict) are plain tensors: nothing needs this class to load them.
    def __deepcopy__(self, memo: dict) -> Tensor:
        out = memo[id(self)] = Tensor.clone(self)
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        return Tensor.clone(self).__reduce_ex__(protocol)


def _users_float(v: Any) -> Any:
    """The user's number behind ``v``: the double last written into one of our tensors, else ``v`` as a float."""
    assigned = getattr(v, "assigned", None) if isinstance(v, _Assigned) else None
    return float(assigned) if assigned is not None else _to_float(v)


def _has_tensor(v: Any) -> bool:
    return isinstance(v, Tensor) or (isinstance(v, tuple) and any(isinstance(x, Tensor) for x in v))


def _group_index(optimizer: torch.optim.Optimizer, group: dict) -> int:
    # By identity: list.index compares group dicts by value, which compares their parameter tensors.
    return next(i for i, g in enumerate(optimizer.param_groups) if g is group)


class ParamGroupWatch:
    """Context manager that records assignments to an optimizer's param groups (``group[k] = v``).

    A replay runs no Python, so a hyperparameter assigned by code *inside* the captured step (an
    overridden ``optimizer_step`` or ``on_before_optimizer_step`` doing a manual LR warm-up) would
    keep its capture-time value forever. While the block runs, each group dict is swapped for a
    recording copy; on exit the originals come back with every change applied, and
    :attr:`changes` lists ``(group index, key, old, new, stack)`` for values that really changed.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.changes: list[tuple[int, str, Any, Any, Any]] = []
        self._orig: list[dict] = []

    def __enter__(self) -> ParamGroupWatch:
        self.changes = []
        self._orig = list(self.optimizer.param_groups)
        self.optimizer.param_groups[:] = [_RecordingGroup(g, i, self.changes) for i, g in enumerate(self._orig)]
        return self

    def __exit__(self, *exc: Any) -> None:
        watched = list(self.optimizer.param_groups)
        for orig, rec in zip(self._orig, watched):
            if isinstance(rec, _RecordingGroup):
                orig.update(dict.items(rec))
        self.optimizer.param_groups[:] = self._orig


class _RecordingGroup(dict):
    """A param group copy that logs writes that change a value (with the writer's stack)."""

    def __init__(self, group: dict, index: int, changes: list) -> None:
        super().__init__(group)
        self._index, self._changes = index, changes

    def __setitem__(self, key: str, value: Any) -> None:
        old = self.get(key)
        if key != "params" and not _same_value(old, value):
            import traceback

            self._changes.append((self._index, key, old, value, traceback.extract_stack()[:-1]))
        super().__setitem__(key, value)


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values count as a change
        return False


def portable_optimizer_state(state_dict: dict[str, Any], originals: Optional[list[dict[str, Any]]] = None) -> dict:
    """Turn tensor lr/betas in an optimizer ``state_dict`` back into floats (in place).

    Checkpoints written during graphed training then load into any optimizer, graphed or not.
    ``originals`` (from :class:`OptimizerPrep`) restores ``capturable``/``fused``/``foreach``.
    """
    for i, group in enumerate(state_dict.get("param_groups", [])):
        if isinstance(group.get("lr"), Tensor):
            group["lr"] = float(group["lr"])
        if "betas" in group:
            group["betas"] = tuple(_to_float(b) for b in group["betas"])
        if originals is not None and i < len(originals):
            for k in ("capturable", "fused", "foreach"):
                if k in originals[i]:
                    group[k] = originals[i][k]
    return state_dict
