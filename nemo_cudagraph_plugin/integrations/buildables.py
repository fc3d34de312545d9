"""Duck-typed helpers for ``fiddle`` buildables (``nemo_run.Config``/``Partial`` are ``fiddle`` classes): read and
compare their arguments without importing fiddle, NeMo or nemo_run."""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["UNSET", "explicit_arg", "get_attr", "is_buildable", "is_unset", "mro_names", "parameter_names", "same_value",
           "target_of"]

UNSET = "<unset>"  # the record's marker for "the argument was not set explicitly"


def is_unset(value: Any) -> bool:
    # Compared by value: the record may have been pickled or deep-copied.
    return isinstance(value, str) and value == UNSET


def same_value(a: Any, b: Any) -> bool:
    if is_unset(a) or is_unset(b):
        return is_unset(a) and is_unset(b)
    return type(a) is type(b) and a == b


def is_buildable(obj: Any) -> bool:
    state = getattr(obj, "__dict__", None)
    return isinstance(state, dict) and "__fn_or_cls__" in state and "__arguments__" in state


def target_of(obj: Any) -> Any:
    return obj.__dict__["__fn_or_cls__"] if is_buildable(obj) else None


def mro_names(obj: Any) -> tuple[str, ...]:
    target = target_of(obj)
    if target is None:
        target = type(obj)
    return tuple(c.__name__ for c in getattr(target, "__mro__", ()))


def parameter_names(obj: Any) -> set[str]:
    try:
        return set(inspect.signature(target_of(obj)).parameters)
    except (TypeError, ValueError):
        return set()


def get_attr(obj: Any, name: str, default: Any = None) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        return default


def explicit_arg(obj: Any, name: str) -> Any:
    """The explicitly set value, or ``UNSET`` (fiddle falls back to the signature default)."""
    return obj.__dict__["__arguments__"].get(name, UNSET)

