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


def refresh_plans_built_outside_the_installer(root: Path = ROOT) -> list[str]:
    """``Fp8RefreshPlan(...)`` calls outside ``fp8/refresh.py``: every FP8 refresh that runs after a step or an
    all-gather is set up by ``install_fp8_refresh``, so its checks, options and undo exist once."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "fp8/refresh.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name == "Fp8RefreshPlan":
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_fp8_refreshes_are_set_up_by_the_one_installer():
    assert refresh_plans_built_outside_the_installer() == []


def test_the_installer_check_sees_a_plan_built_elsewhere(tmp_path):
    pkg = tmp_path / PKG
    (pkg / "fp8").mkdir(parents=True)
    (pkg / "fp8" / "refresh.py").write_text("class Fp8RefreshPlan: ...\nFp8RefreshPlan()\n")
    (pkg / "fp8" / "pipeline.py").write_text("from . import refresh\n\nrefresh.Fp8RefreshPlan([])\n")
    assert refresh_plans_built_outside_the_installer(pkg) == [f"{PKG}/fp8/pipeline.py:3"]
