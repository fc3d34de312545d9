"""Imports point down only: core <- fp8, hf <- lightning <- integrations.

Every ``import`` statement of the package (top level and inside functions) is read with ``ast``, relative imports
resolved, and checked against the layer of the importing module. ``importlib.import_module`` with a literal name
counts as an import too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = "nemo_cudagraph_plugin"
ROOT = Path(__file__).resolve().parents[1] / PKG

# Layer of a module (by its dotted name under the package) -> the names it must not import. The frameworks that
# drive a step themselves (Megatron, NeMo) are reached only from integrations; Lightning only from lightning/ up.
_FRAMEWORKS = ("megatron", "nemo", "nemo_run", "fiddle", f"{PKG}.megatron", f"{PKG}.nemo")
FORBIDDEN = {
    "core": (f"{PKG}.fp8", f"{PKG}.hf", f"{PKG}.lightning", f"{PKG}.integrations", f"{PKG}.diagnostics", "lightning",
             "transformers", *_FRAMEWORKS),
    "diagnostics": (f"{PKG}.fp8", f"{PKG}.lightning", f"{PKG}.integrations", "lightning", *_FRAMEWORKS),
    "fp8": (f"{PKG}.hf", f"{PKG}.lightning", f"{PKG}.integrations", "lightning", *_FRAMEWORKS),
    # Hugging Face models in a captured step: beside fp8, for any adapter to call
    "hf": (f"{PKG}.fp8", f"{PKG}.lightning", f"{PKG}.integrations", "lightning", *_FRAMEWORKS),
    "lightning": (f"{PKG}.integrations", *_FRAMEWORKS),
}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FORBIDDEN else None


def imported_names(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` for every import in ``path``; ``from X import y`` gives ``X.y`` too, so that
    ``from .. import integrations`` is seen."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.lineno, node.args[0].value))
    return out


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        layer = _layer(_module_name(path, root))
        if layer is None:
            continue
        for line, name in imported_names(path, root):
            hit = [f for f in FORBIDDEN[layer] if name == f or name.startswith(f + ".")]
            if hit:
                bad.append(f"{path.relative_to(root.parent)}:{line}: {layer} imports {name}")
    return bad


def test_imports_point_down_only():
    assert violations() == []


def test_the_check_sees_a_relative_import_of_a_higher_layer(tmp_path):
    pkg = tmp_path / PKG
    (pkg / "lightning").mkdir(parents=True)
    (pkg / "core").mkdir()
    (pkg / "lightning" / "cb.py").write_text("def f():\n    from ..integrations.megatron import callbacks\n")
    (pkg / "core" / "x.py").write_text("from .. import fp8\nimport lightning.pytorch\n")
    assert sorted(violations(pkg)) == [
        f"{PKG}/core/x.py:1: core imports {PKG}.fp8",
        f"{PKG}/core/x.py:2: core imports lightning.pytorch",
        f"{PKG}/lightning/cb.py:2: lightning imports {PKG}.integrations.megatron",
        f"{PKG}/lightning/cb.py:2: lightning imports {PKG}.integrations.megatron.callbacks",
    ]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_every_layer_has_modules(layer):
    assert any(_layer(_module_name(p)) == layer for p in ROOT.rglob("*.py"))


def test_package_imports_are_relative():
    """One import style inside the package: relative (``from ..core.config import ...``)."""
    absolute = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            absolute += [f"{path.relative_to(ROOT.parent)}:{node.lineno}" for n in names
                         if n == PKG or n.startswith(PKG + ".")]
    assert absolute == []


# The seam inside lightning/: the binding (runner.py) changes Lightning's objects and holds none of the step's state
# (optimizer preparation, NaN guard, watches, logs, FP8 care: the adapter's); the engine's adapter (adapter.py) holds
# that state and reaches Lightning's objects only through _compat.py (from Lightning itself: public utilities only).
_STEP_STATE = tuple(f"{PKG}.{m}" for m in ("core.nan_guard", "core.optim", "core.module_state", "core.adam_step",
                                           "core.user_adam", "fp8", "lightning.logs"))
SEAM = {
    f"{PKG}.lightning.runner": lambda name: name.startswith(_STEP_STATE),
    f"{PKG}.lightning.adapter": lambda name: (
        (name == "lightning" or name.startswith("lightning."))
        and not name.startswith("lightning.pytorch.utilities")
        or name.startswith((f"{PKG}.lightning.runner", f"{PKG}.lightning.checks", f"{PKG}.hf"))),
}


def seam_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        forbidden = SEAM.get(module)
        if forbidden is None:
            continue
        bad += [f"{path.relative_to(root.parent)}:{line}: {module} imports {name}"
                for line, name in imported_names(path, root) if forbidden(name)]
    return bad


def test_the_binding_holds_no_step_state_and_the_adapter_reaches_lightning_through_compat():
    assert seam_violations() == []


def test_the_seam_check_sees_planted_violations(tmp_path):
    pkg = tmp_path / PKG
    (pkg / "lightning").mkdir(parents=True)
    (pkg / "lightning" / "runner.py").write_text("from ..core.nan_guard import NanPolicy\nfrom . import _compat\n")
    (pkg / "lightning" / "adapter.py").write_text(
        "from lightning.pytorch.loops import _AutomaticOptimization\nfrom lightning.pytorch.utilities import rank_zero_info\n"
        "from . import _compat\n")
    assert seam_violations(pkg) == [
        f"{PKG}/lightning/adapter.py:1: {PKG}.lightning.adapter imports lightning.pytorch.loops",
        f"{PKG}/lightning/adapter.py:1: {PKG}.lightning.adapter imports lightning.pytorch.loops._AutomaticOptimization",
        f"{PKG}/lightning/runner.py:1: {PKG}.lightning.runner imports {PKG}.core.nan_guard",
        f"{PKG}/lightning/runner.py:1: {PKG}.lightning.runner imports {PKG}.core.nan_guard.NanPolicy",
    ]


# What sets up an FP8 refresh besides the installer: the plan itself, and the user's public one-shot entry points.
_REFRESH_OUTSIDE_INSTALLER = ("Fp8RefreshPlan", "refresh_fp8_transposes", "after_param_sync")


def refresh_plans_built_outside_the_installer(root: Path = ROOT) -> list[str]:
    """``Fp8RefreshPlan(...)``, ``refresh_fp8_transposes(...)`` and ``after_param_sync(...)`` calls outside
    ``fp8/refresh.py``: every FP8 refresh the package runs (after a step, an all-gather, at fit start) is set up by
    ``install_fp8_refresh``, so its checks, options and undo exist once; the other two are for users."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "fp8/refresh.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in _REFRESH_OUTSIDE_INSTALLER:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_fp8_refreshes_are_set_up_by_the_one_installer():
    assert refresh_plans_built_outside_the_installer() == []


def test_the_installer_check_sees_a_plan_built_elsewhere(tmp_path):
    pkg = tmp_path / PKG
    (pkg / "fp8").mkdir(parents=True)
    (pkg / "fp8" / "refresh.py").write_text("class Fp8RefreshPlan: ...\nFp8RefreshPlan()\n")
    (pkg / "fp8" / "pipeline.py").write_text("from . import refresh\n\nrefresh.Fp8RefreshPlan([])\n")
    (pkg / "fp8" / "cb.py").write_text("from .refresh import refresh_fp8_transposes\nrefresh_fp8_transposes([])\n")
    assert refresh_plans_built_outside_the_installer(pkg) == [f"{PKG}/fp8/cb.py:2", f"{PKG}/fp8/pipeline.py:3"]


# Modules that wrap another library's private API (and say which versions they were checked against): the one place
# each such name is used. Everything else reaches it through them.
COMPAT_MODULES = {
    f"{PKG}.core._torch_compat": "torch's private APIs",
    f"{PKG}.lightning._compat": "Lightning's private APIs",
    f"{PKG}.fp8._te_compat": "TransformerEngine's private APIs",
}


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _package_of(module: str, root: Path) -> str:
    """The package a module belongs to: itself for a package (``__init__.py``), else its parent."""
    rel = Path(*module.split(".")[1:]) if "." in module else Path()
    return module if (root / rel).is_dir() else module.rpartition(".")[0]


def private_imports(root: Path = ROOT) -> list[str]:
    """Imports of a ``_private`` module or name that belongs to another package than the importer's: a private
    module belongs to the package that holds it, a private name to its module's package. Third-party private names
    count too (``torch.utils._python_dispatch``); only :data:`COMPAT_MODULES` may import those."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        own = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for line, name in imported_names(path, root):
            parts = name.split(".")
            i = next((k for k, p in enumerate(parts) if _is_private(p)), None)
            if i is None or i == 0:
                continue
            holder = ".".join(parts[:i])
            owner = _package_of(holder, root) if holder.startswith(PKG + ".") or holder == PKG else holder
            if owner == own:
                continue
            if not holder.startswith(PKG) and module in COMPAT_MODULES:
                continue
            bad.append(f"{path.relative_to(root.parent)}:{line}: {module} imports {name}")
    return sorted(set(bad))


def test_no_module_imports_another_packages_private_names():
    assert private_imports() == []


def test_the_private_import_check_sees_a_planted_violation(tmp_path):
    pkg = tmp_path / PKG
    for sub in ("core", "lightning", "integrations/nemo"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "_torch_compat.py").write_text("from torch.utils._python_dispatch import TorchDispatchMode\n")
    (pkg / "core" / "engine.py").write_text("from ._torch_compat import copy_all\nfrom .buffers import _private\n")
    (pkg / "core" / "nan_guard.py").write_text("from torch.utils._python_dispatch import TorchDispatchMode\n")
    (pkg / "lightning" / "checks.py").write_text("from ..core._torch_compat import compiled_with_cuda_graphs\n")
    (pkg / "integrations" / "_helpers.py").write_text("def _get(): ...\n")
    (pkg / "integrations" / "nemo" / "cli.py").write_text("from .._helpers import _get\n")
    assert private_imports(pkg) == sorted([
        f"{PKG}/core/nan_guard.py:1: {PKG}.core.nan_guard imports torch.utils._python_dispatch",
        f"{PKG}/core/nan_guard.py:1: {PKG}.core.nan_guard imports torch.utils._python_dispatch.TorchDispatchMode",
        f"{PKG}/lightning/checks.py:1: {PKG}.lightning.checks imports {PKG}.core._torch_compat",
        f"{PKG}/lightning/checks.py:1: {PKG}.lightning.checks imports "
        f"{PKG}.core._torch_compat.compiled_with_cuda_graphs",
        f"{PKG}/integrations/nemo/cli.py:1: {PKG}.integrations.nemo.cli imports {PKG}.integrations._helpers",
        f"{PKG}/integrations/nemo/cli.py:1: {PKG}.integrations.nemo.cli imports {PKG}.integrations._helpers._get",
    ])
