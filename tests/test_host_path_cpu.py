"""``benchmarks/host_path_cpu.py`` keeps working: its stand-in backend drives the real callback, runner and engine
through a real ``Trainer`` into replays, and its ``floor`` variant (Lightning's loop with a stored step) advances
``global_step`` like training does, so both stop at ``max_steps``."""

from __future__ import annotations

import warnings

import pytest

from benchmarks import host_path_cpu


@pytest.mark.parametrize("variant", ["floor", "callback", "nolog"])
def test_every_variant_replays_and_reaches_max_steps(variant):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = host_path_cpu.run(variant, steps=24, skip=8)  # raises when the callback variants did not replay
    assert out["median_us"] > 0


def test_callgrind_totals_are_read_from_the_dump(tmp_path):
    (tmp_path / "cg.callback").write_text("events: Ir\nsummary: 0\ntotals: 0\n")
    (tmp_path / "cg.callback.1").write_text("events: Ir\nsummary: 0\nfl=x\n1 5\ntotals: 3200\n")
    assert host_path_cpu.read_totals(tmp_path, "callback") == 3200
