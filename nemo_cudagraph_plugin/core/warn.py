"""One ``warn_once`` for the whole package (a message is shown once per process and key), and the one version
check every adapter module uses for the library whose internals it touches."""

from __future__ import annotations

import warnings

from packaging.version import Version

__all__ = ["check_tested_version", "warn_once"]

_WARNED: set[str] = set()


def warn_once(key: str, message: str, category: type[Warning] = UserWarning, stacklevel: int = 3) -> bool:
    """Warn with ``message`` the first time ``key`` is seen; return whether it warned."""
    if key in _WARNED:
        return False
    _WARNED.add(key)
    warnings.warn(message, category, stacklevel=stacklevel)
    return True


def check_tested_version(name: str, found: Version, minimum: Version, max_tested: Version, uses: str) -> None:
    """Refuse ``name`` older than ``minimum``; warn once above ``max_tested`` (it runs, but untested).

    Args:
        uses: which internals the adapter relies on (said in the warning).
    """
    if found < minimum:
        raise RuntimeError(f"nemo_cudagraph_plugin needs {name} >= {minimum}, found {found}. pip install -U {name}")
    if found > max_tested:
        warn_once(
            f"{name}-version",
            f"nemo_cudagraph_plugin was tested with {name} {minimum} - {max_tested}; found {found}. It uses {uses}; "
            "if training looks different with graphs, compare with verify_steps=5 and please report it.",
            stacklevel=4,
        )
