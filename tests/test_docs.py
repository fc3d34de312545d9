"""The user documentation names every option and every counter the code has (one definition each, in the code)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from nemo_cudagraph_plugin.core.config import CaptureStats, option_names

USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage.md"


def test_every_option_has_a_row_in_the_options_table_of_the_usage_page():
    text = USAGE.read_text()
    table = text[text.index("| option | default | meaning |"):]
    table = table[:table.index("\n\n")]
    rows = set()
    for line in table.splitlines()[2:]:
        rows.update(re.findall(r"`([a-z_0-9]+)`", line.split("|")[1]))
    missing = [n for n in option_names() if n not in rows]
    assert not missing, f"docs/usage.md's options table lacks {missing}"
    unknown = sorted(rows - set(option_names()))
    assert not unknown, f"docs/usage.md's options table names options the code does not have: {unknown}"


def test_every_counter_of_the_stats_is_named_on_the_usage_page_and_no_other():
    text = USAGE.read_text()
    para = text[text.index("`callback.stats`"):]
    para = para[:para.index("\n\n")]
    named = set(re.findall(r"`([a-z_]+)`", para)) - {"callback", "strategy"}
    fields = {f.name for f in dataclasses.fields(CaptureStats)} | {"peak_over_eager"}
    assert fields <= named, f"docs/usage.md does not name stats {sorted(fields - named)}"
    assert named - {"stats"} <= fields | {"summary"}, f"docs/usage.md names stats that do not exist: {sorted(named - fields)}"
