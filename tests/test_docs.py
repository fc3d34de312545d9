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


DESIGN = USAGE.parent / "design.md"
REPO = USAGE.parents[1]


def design_layout_problems(text: str, repo: Path = REPO) -> list[str]:
    """Paths of the design page's layout block that do not exist: each entry (``name.py`` or ``dir/``) under the
    entry it is indented below, and every ``name.py`` its description mentions somewhere under that directory."""
    block = text.split("## Parts", 1)[1].split("```")[1]
    stack: list[tuple[int, Path]] = []
    problems = []
    for line in block.splitlines():
        m = re.match(r"( *)(\S+)", line)
        if m is None:
            continue
        indent, first = len(m.group(1)), m.group(2)
        rest = line[m.end():]
        if first.endswith("/") or first.endswith(".py"):
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = (stack[-1][1] if stack else repo) / first.rstrip("/")
            if not path.exists():
                problems.append(str(path.relative_to(repo)))
            if first.endswith("/"):
                stack.append((indent, path))
        else:
            rest = line
        where = stack[-1][1] if stack else repo
        for name in re.findall(r"([\w/]+\.py)\b", rest):
            if "/" in name:  # a path from the repository's root (tests/_tape.py)
                if not (repo / name).exists():
                    problems.append(name)
            elif where.is_dir() and not any(where.rglob(name)):
                problems.append(f"{name} (under {where.relative_to(repo)})")
    return problems


def test_the_design_page_names_files_that_exist():
    assert design_layout_problems(DESIGN.read_text()) == []


def test_the_layout_check_sees_a_moved_file():
    text = DESIGN.read_text().replace("    engine.py ", "    pipeline_callback.py ", 1)
    text = text.replace("refresh.py:", "megatron.py:", 1)
    assert design_layout_problems(text) == [
        "nemo_cudagraph_plugin/core/pipeline_callback.py", "megatron.py (under nemo_cudagraph_plugin/fp8)"]
