"""GPU tests: skipped (with the reason) on machines without CUDA."""

import os

import pytest
import torch

# Deterministic cuBLAS so that eager and graphed runs can be compared to the last bit.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU tests run on the GPU host; see docs/gpu-evidence/)")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
