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
