"""The recipe editor behind :func:`~nemo_cudagraph_plugin.integrations.nemo.with_cuda_graph`: applies and logs each
change, keeps the values before the flag in a record on the recipe (for ``enabled=False``), and edits
``trainer.callbacks``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal, Optional, Union

from ..buildables import UNSET, explicit_arg, get_attr, is_unset, mro_names, same_value, target_of
from ..megatron.graph_fields import Change

log = logging.getLogger(__name__)

Mode = Literal["auto", "callback", "strategy"]
Fp8Refresh = Union[bool, Literal["auto"]]


_RECORD = "__nemo_cudagraph_record__"  # attribute on the recipe root: values before the flag, for undo


def _is_megatron_strategy(strategy: Any) -> bool:
    return "MegatronStrategy" in mro_names(strategy)


def _is_ours(obj: Any, name: str) -> bool:
    target = target_of(obj)
    return target is not None and getattr(target, "__name__", "") == name and getattr(
        target, "__module__", ""
    ).startswith("nemo_cudagraph_plugin.")


class _Editor:
    """Applies and logs changes to a recipe, keeping the before-values in the recipe's record."""

    def __init__(self, root: Any) -> None:
        self.root = root
        record = root.__dict__.get(_RECORD)
        self.record: dict[str, Any] = record if isinstance(record, dict) else {}
        # No record (never flagged, or copied/deserialized since): undo can only turn graphs off.
        self.fallback = not self.record
        self.changes: list[Change] = []

    def set(self, obj: Any, path: str, name: str, value: Any, why: str) -> None:
        old = get_attr(obj, name, UNSET)
        if same_value(old, value):
            return
        self.record.setdefault(f"{path}.{name}", explicit_arg(obj, name))
        setattr(obj, name, value)
        self._log(Change(f"{path}.{name}", old, value, why))

    def restore(self, obj: Any, path: str, name: str, off: Any = UNSET, why: str = "restored") -> None:
        """Put back the recorded value of ``path.name``; when the recipe has no record at all, set ``off``
        (if given). A field the record does not name was not changed by the flag and is left alone."""
        key = f"{path}.{name}"
        old = get_attr(obj, name, UNSET)
        if key in self.record:
            value = self.record.pop(key)
            if is_unset(value):
                if name in obj.__dict__["__arguments__"]:
                    delattr(obj, name)
                new = get_attr(obj, name, UNSET)
            else:
                setattr(obj, name, value)
                new = value
        elif self.fallback and not is_unset(off):
            if same_value(old, off):
                return
            setattr(obj, name, off)
            new = off
            why = f"{why}; no record of the value before with_cuda_graph, so set to off"
        else:
            return
        if not same_value(old, new):
            self._log(Change(key, old, new, why))

    def _log(self, change: Change) -> None:
        self.changes.append(change)
        log.info("with_cuda_graph: %s", change)

    def save(self) -> None:
        if self.record:
            object.__setattr__(self.root, _RECORD, self.record)
        elif _RECORD in self.root.__dict__:
            object.__delattr__(self.root, _RECORD)


def _callback_list(trainer: Any) -> list[Any]:
    callbacks = get_attr(trainer, "callbacks")
    if callbacks is None:
        return []
    if not isinstance(callbacks, list):
        raise ValueError(f"recipe.trainer.callbacks must be a list of callback configs, got {type(callbacks).__name__}.")
    return callbacks


def _set_callbacks(trainer: Any, editor: _Editor, add: Optional[Any], remove: Callable[[Any], bool], why: str) -> None:
    """Append ``add`` (if given) / drop the entries matching ``remove``; record the list's original state."""
    before = _callback_list(trainer)
    after = [c for c in before if not remove(c)]
    if add is None and len(after) == len(before):
        return
    if add is not None:
        after.append(add)
    editor.record.setdefault("trainer.callbacks", explicit_arg(trainer, "callbacks") if before == [] else "<list>")
    trainer.callbacks = after
    editor._log(Change("trainer.callbacks", [_name(c) for c in before], [_name(c) for c in after], why))


def _restore_empty_callbacks(trainer: Any, editor: _Editor) -> None:
    original = editor.record.pop("trainer.callbacks", "<list>")
    if _callback_list(trainer) == [] and not (isinstance(original, str) and original == "<list>"):
        if is_unset(original):
            if "callbacks" in trainer.__dict__["__arguments__"]:
                delattr(trainer, "callbacks")
        else:
            trainer.callbacks = original


def _name(obj: Any) -> str:
    target = target_of(obj)
    return getattr(target, "__name__", type(obj).__name__) if target is not None else type(obj).__name__


def _config_like(template: Any, target: Any, **kwargs: Any) -> Any:
    """A buildable of the same class as ``template`` (nemo_run.Config stays nemo_run.Config)."""
    cls = type(template)
    if "Partial" in cls.__name__:  # a callback/strategy must be built into an object, not a partial
        for base in cls.__mro__:
            if base.__name__ == "Config":
                cls = base
                break
    return cls(target, **kwargs)


# -- Lightning strategies: our capture engine ----------------------------------------------------------------


_OUR_CALLBACK = "trainer.callbacks[CudaGraphCallback]"
_OUR_STRATEGY = "trainer.strategy[CudaGraphStrategy]"
_OUR_FP8 = "trainer.callbacks[AlignPipelineTransposes]"
_OUR_GATHER = "trainer.callbacks[Fp8ParamGatherRefresh]"
_OUR_FULL = "trainer.callbacks[MegatronFullIterationGraph]"


def _add_our_callback(trainer: Any, editor: _Editor, cls: type, key: str, why: str) -> None:
    if not any(_is_ours(c, cls.__name__) for c in _callback_list(trainer)):
        _set_callbacks(trainer, editor, _config_like(trainer, cls), lambda c: False, why)
        editor.record[key] = True
