"""The mutation check's definitions stay in step with the code: every mutant's text is found once in its file and
its tests' files exist, so a move or an edit cannot leave a mutant that only errors when the check runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ci"))
import mutants  # noqa: E402  (ci/ is not a package)


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_text_occurs_once_in_its_file_and_its_tests_exist(m):
    text = (ROOT / m.file).read_text()
    assert text.count(m.old) == 1, f"{m.name}: its text occurs {text.count(m.old)} times in {m.file}"
    assert m.old != m.new
    for t in m.tests:
        assert (ROOT / t.split("::")[0]).is_file(), f"{m.name}: no test file {t.split('::')[0]}"


def test_mutant_names_are_unique():
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_test_names_a_test_function_of_its_file(m):
    for t in m.tests:
        path, _, name = t.partition("::")
        func = name.split("[")[0].split("::")[-1]
        assert f"def {func}(" in (ROOT / path).read_text(), f"{m.name}: no test {func} in {path}"


def test_every_cpu_mutant_test_id_is_collected_as_written():
    # A renamed test or a dropped parametrization leaves an id pytest cannot find: the mutation check's baseline then
    # fails as a whole. Collecting the ids here finds that in the unit stage, in seconds, naming the id.
    import subprocess

    ids = sorted({t for m in mutants.MUTANTS if m.tier == "cpu" for t in m.tests})
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
                           "-p", "no:cacheprovider", *ids], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
