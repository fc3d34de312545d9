"""One ``warn_once`` for the whole package: a message is shown once per process and key."""

from __future__ import annotations

import warnings

__all__ = ["warn_once"]

_WARNED: set[str] = set()


def warn_once(key: str, message: str, category: type[Warning] = UserWarning, stacklevel: int = 3) -> bool:
    """Warn with ``message`` the first time ``key`` is seen; return whether it warned."""
    if key in _WARNED:
        return False
    _WARNED.add(key)
    warnings.warn(message, category, stacklevel=stacklevel)
    return True
