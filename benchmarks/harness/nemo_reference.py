"""NeMo 3.0.0's ``CUDAGraphCallback``, loaded at run time from the nemo-toolkit wheel (never vendored).

The harness compares against the real thing: ``nemo/utils/callbacks/cuda_graph.py`` is read out of the
nemo-toolkit 3.0.0 wheel with :mod:`zipfile` and executed as a module of its own with :mod:`importlib`. That
file imports only torch and Lightning, so the rest of NeMo (and its dependencies) is never needed. Get the wheel
once on a machine with a package index and carry the ignored ``.bench/`` folder to the GPU host::

    python3 -m pip download --no-deps --only-binary=:all: nemo-toolkit==3.0.0 -d .bench

What NeMo's callback does to the process (why every variant of the harness runs in its own process): it
replaces ``torch.autocast.__init__``, ``DistributedDataParallel.__init__`` and
``LightningModule._LightningModule__to_tensor`` on the classes, sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, and
swaps the trainer's training dataloader, the module's ``training_step``/``optimizer_step`` and the optimizer's
``zero_grad``. It calls ``training_step(batch)`` with one argument, and it needs an optimizer built with
``capturable=True`` (torch refuses to capture ``step()`` otherwise; NeMo does not set it).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import sys
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["DOWNLOAD_COMMAND", "MEMBER", "NEMO_VERSION", "default_wheel", "load_cuda_graph_module", "preflight"]

NEMO_VERSION = "3.0.0"
MEMBER = "nemo/utils/callbacks/cuda_graph.py"
DOWNLOAD_COMMAND = f"python3 -m pip download --no-deps --only-binary=:all: nemo-toolkit=={NEMO_VERSION} -d .bench"
_MODULE_NAME = "_nemo_3_0_0_cuda_graph"  # not "nemo.…": no package "nemo" exists in this process


def default_wheel(repo: Path) -> Path:
    """The wheel under ``repo/.bench`` (the name pip gives it)."""
    hits = sorted((repo / ".bench").glob(f"nemo_toolkit-{NEMO_VERSION}-*.whl"))
    return hits[0] if hits else repo / ".bench" / f"nemo_toolkit-{NEMO_VERSION}-py3-none-any.whl"


class _WheelMemberLoader(importlib.abc.SourceLoader):
    """Source loader for one ``.py`` member of a zip file (no bytecode cache: nothing is written)."""

    def __init__(self, wheel: Path, member: str) -> None:
        self.wheel, self.member = wheel, member

    def get_filename(self, fullname: str) -> str:
        return f"{self.wheel}/{self.member}"  # tracebacks point into the wheel

    def get_data(self, path: str) -> bytes:
        with zipfile.ZipFile(self.wheel) as z:
            return z.read(self.member)


def load_cuda_graph_module(wheel: Path) -> ModuleType:
    """Import ``nemo/utils/callbacks/cuda_graph.py`` from ``wheel``; the module has ``CUDAGraphCallback``.

    Raises ``FileNotFoundError`` saying how to download the wheel when it is missing.
    """
    wheel = Path(wheel)
    if not wheel.is_file():
        raise FileNotFoundError(
            f"NeMo wheel not found at {wheel}; download it on a machine with a package index with "
            f"`{DOWNLOAD_COMMAND}` and carry the .bench folder with the repository"
        )
    if _MODULE_NAME in sys.modules:
        return sys.modules[_MODULE_NAME]
    loader = _WheelMemberLoader(wheel, MEMBER)
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, loader.get_filename(_MODULE_NAME), loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE_NAME] = mod  # @dataclass looks its module up in sys.modules
    try:
        loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(_MODULE_NAME, None)
        raise
    src = loader.get_data("")
    mod.__nemo_provenance__ = {  # type: ignore[attr-defined]
        "wheel": wheel.name, "member": MEMBER, "sha256": hashlib.sha256(src).hexdigest(), "bytes": len(src),
    }
    return mod


def preflight(trainer: Any = None) -> dict[str, bool]:
    """Whether the Lightning internals NeMo's callback patches exist in this Lightning.

    Without a trainer only class-level attributes are checked; with one that has run ``fit``, also the fit
    loop's attributes NeMo swaps in ``on_train_start``.
    """
    from lightning.pytorch import LightningModule
    from lightning.pytorch.loops.optimization import automatic

    checks = {
        "LightningModule._LightningModule__to_tensor": hasattr(LightningModule, "_LightningModule__to_tensor"),
        "ClosureResult.from_training_step_output": hasattr(automatic.ClosureResult, "from_training_step_output"),
    }
    if trainer is not None:
        loop = trainer.fit_loop
        cl = getattr(loop, "_combined_loader", None)
        checks["fit_loop._combined_loader._iterables"] = cl is not None and hasattr(cl, "_iterables")
        checks["fit_loop._combined_loader._mode"] = cl is not None and hasattr(cl, "_mode")
        checks["fit_loop._data_fetcher.setup"] = hasattr(getattr(loop, "_data_fetcher", None), "setup")
    return checks
