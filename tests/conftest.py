"""Session-wide checks of the test run itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    """``NCG_PACKAGE_UNDER_TEST=DIR``: stop unless ``nemo_cudagraph_plugin`` is imported from DIR. A run against an
    older copy of the package (``ci/gpu_tests.sh`` with ``OLD=``) must test that copy; an entry that pytest puts
    first on ``sys.path`` (its ``pythonpath`` setting) would otherwise make it test this checkout again, unseen."""
    want = os.environ.get("NCG_PACKAGE_UNDER_TEST")
    if not want:
        return
    import nemo_cudagraph_plugin

    got = Path(nemo_cudagraph_plugin.__file__).resolve()
    if not got.is_relative_to(Path(want).resolve()):
        raise pytest.UsageError(f"NCG_PACKAGE_UNDER_TEST={want}, but nemo_cudagraph_plugin was imported from {got}")
