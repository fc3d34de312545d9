"""Duck-typed helpers for ``fiddle`` buildables (``nemo_run.Config``/``Partial`` are ``fiddle`` classes): read and
compare their arguments without importing fiddle, NeMo or nemo_run."""

from __future__ import annotations

import inspect
from typing import Any

_UNSET = "<unset>"  # the record's marker for "the argument was not set explicitly"


def _is_unset(value: Any) -> bool:
    # Compared by value: the record may have been pickled or deep-copied.
    return isinstance(value, str) and value == _UNSET


def _same(a: Any, b: Any) -> bool:
    if _is_unset(a) or _is_unset(b):
        return _is_unset(a) and _is_unset(b)
    return type(a) is type(b) and a == b


def _is_buildable(obj: Any) -> bool:
    state = getattr(obj, "__dict__", None)
    return isinstance(state, dict) and "__fn_or_cls__" in state and "__arguments__" in state


def _target(obj: Any) -> Any:
    return obj.__dict__["__fn_or_cls__"] if _is_buildable(obj) else None


def _mro_names(obj: Any) -> tuple[str, ...]:
    target = _target(obj)
    if target is None:
        target = type(obj)
    return tuple(c.__name__ for c in getattr(target, "__mro__", ()))


def _params(obj: Any) -> set[str]:
    try:
        return set(inspect.signature(_target(obj)).parameters)
    except (TypeError, ValueError):
        return set()


def _get(obj: Any, name: str, default: Any = None) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        return default


def _explicit(obj: Any, name: str) -> Any:
    """The explicitly set value, or ``_UNSET`` (fiddle falls back to the signature default)."""
    return obj.__dict__["__arguments__"].get(name, _UNSET)

