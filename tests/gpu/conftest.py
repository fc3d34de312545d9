"""GPU tests: marked ``gpu``; on a machine without CUDA they are not collected at all.

Not collected rather than skipped: several of these modules skip themselves at import without CUDA, which pytest
would report as "skipped" in every CPU run (the unit and NeMo stages). The header of a CPU run says how many
files were left out and why; ``ci/stages.sh gpu`` runs them on a CUDA machine.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

# Deterministic cuBLAS so that eager and graphed runs can be compared to the last bit.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

HERE = Path(__file__).resolve().parent
# The helpers shared with the CPU tests (tests/hf_models.py, tests/fp8_doubles.py) import as top-level modules.
if str(HERE.parent) not in sys.path:
    sys.path.append(str(HERE.parent))
_LEFT_OUT: list[str] = []

# TransformerEngine first, where it is installed: its loader picks a cuDNN by path, and once torch has loaded its own
# for an earlier test's attention, TE's can fail to load ("libcudnn_heuristic.so.9: undefined symbol",
# seen on an H200 with TE 2.20.2). A TE that does not import is left to its tests to report.
if torch.cuda.is_available():
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        try:
            import transformer_engine.pytorch  # noqa: F401
        except Exception:  # noqa: BLE001 - the TE tests import it again and say why
            pass


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Without CUDA, leave every test module of tests/gpu/ uncollected (counted for the header)."""
    if torch.cuda.is_available():
        return None
    path = Path(collection_path).resolve()
    if path.parent == HERE and path.name.startswith("test_") and path.suffix == ".py":
        if path.name not in _LEFT_OUT:
            _LEFT_OUT.append(path.name)
        return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.gpu)


def pytest_report_collectionfinish(config, start_path, items):
    if _LEFT_OUT:
        return (f"tests/gpu: {len(_LEFT_OUT)} test files not collected: no CUDA device "
                "(they run in the gpu stage, ci/stages.sh gpu)")
    return None
