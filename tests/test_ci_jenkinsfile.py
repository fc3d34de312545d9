"""Tests of the CI definition: the Jenkinsfile's structure, ci/stages.sh, .ci/run and ci/check_convergence.py.

The Jenkinsfile is parsed into its nested blocks (``pipeline { stages { stage('X') { steps { ... } } } }``)
by a small tokenizer that knows Groovy strings and comments, so unbalanced braces or quotes fail here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JENKINSFILE = ROOT / "Jenkinsfile"
STAGES_SH = ROOT / "ci" / "stages.sh"
CI_RUN = ROOT / ".ci" / "run"
sys.path.insert(0, str(ROOT / "ci"))
import check_convergence  # noqa: E402  (ci/ is not a package)

# Jenkins stage name -> the ci/stages.sh stage it runs.
EXPECTED = {
    "Lint": "lint",
    "CPU unit tests": "unit",
    "NeMo recipe": "nemo",
    "GPU tests": "gpu",
    "Convergence": "convergence",
    "Benchmark": "bench",
}
GPU_STAGES = {"GPU tests", "Convergence", "Benchmark"}
PYTEST_STAGES = {"CPU unit tests": "unit", "NeMo recipe": "nemo", "GPU tests": "gpu"}


# ------------------------------------------------------------------------------------------------------------
# A small parser of Groovy's block structure
# ------------------------------------------------------------------------------------------------------------


@dataclass
class Block:
    name: str
    arg: str = ""  # the text in parentheses after the name, e.g. "'Lint'"
    children: list[Block] = field(default_factory=list)
    statements: list[str] = field(default_factory=list)  # top-level statements inside the braces

    def find(self, name: str) -> list[Block]:
        return [c for c in self.children if c.name == name]

    def one(self, name: str) -> Block:
        found = self.find(name)
        assert len(found) == 1, f"{self.name}({self.arg}) has {len(found)} '{name}' blocks, expected 1"
        return found[0]


_TOKEN = re.compile(
    r"""(?P<comment>//[^\n]*|/\*.*?\*/)"""
    r"""|(?P<string>'''.*?'''|\"\"\".*?\"\"\"|'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*")"""
    r"""|(?P<open>\{)|(?P<close>\})|(?P<lparen>\()|(?P<rparen>\))|(?P<newline>\n)"""
    r"""|(?P<other>[^\s{}()'"/]+|/|[ \t\r]+)""",
    re.S,
)


def tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise SyntaxError(f"cannot tokenize at offset {pos}: {text[pos:pos + 20]!r} (unterminated string?)")
        kind = m.lastgroup
        if kind != "comment":
            tokens.append((kind, m.group()))
        pos = m.end()
    return tokens


def parse(text: str) -> Block:
    """Nested ``name(arg) { ... }`` blocks; anything else inside a block is kept as statements (one a line)."""
    root = Block("<root>")
    stack = [root]
    line: list[str] = []  # text of the current statement
    depth_paren = 0
    for kind, tok in tokenize(text):
        if kind == "lparen":
            depth_paren += 1
            line.append(tok)
        elif kind == "rparen":
            depth_paren -= 1
            if depth_paren < 0:
                raise SyntaxError("unbalanced ')'")
            line.append(tok)
        elif kind == "open" and depth_paren == 0:
            head = "".join(line).strip()
            m = re.fullmatch(r"([A-Za-z_][\w]*)\s*(?:\((.*)\))?", head, re.S)
            if m is None:
                raise SyntaxError(f"a block must start with name or name(args), got {head!r}")
            block = Block(m.group(1), (m.group(2) or "").strip())
            stack[-1].children.append(block)
            stack.append(block)
            line = []
        elif kind == "close" and depth_paren == 0:
            rest = "".join(line).strip()
            if rest:
                stack[-1].statements.append(rest)
            line = []
            if len(stack) == 1:
                raise SyntaxError("unbalanced '}'")
            stack.pop()
        elif kind == "newline" and depth_paren == 0:
            rest = "".join(line).strip()
            if rest:
                stack[-1].statements.append(rest)
            line = []
        else:
            line.append(tok)
    if len(stack) != 1 or depth_paren != 0:
        raise SyntaxError(f"unbalanced braces/parentheses at end of file (open blocks: {[b.name for b in stack[1:]]})")
    if "".join(line).strip():
        root.statements.append("".join(line).strip())
    return root


def _unquote(arg: str) -> str:
    m = re.fullmatch(r"""'([^']*)'|"([^"]*)\"""", arg.strip())
    assert m, f"expected one quoted string, got {arg!r}"
    return m.group(1) if m.group(1) is not None else m.group(2)


def _stages() -> dict[str, Block]:
    pipeline = parse(JENKINSFILE.read_text()).one("pipeline")
    stages = pipeline.one("stages").find("stage")
    return {_unquote(s.arg): s for s in stages}


def _script_stages() -> list[str]:
    out = subprocess.run(["bash", str(STAGES_SH), "--list"], capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.split()


# ------------------------------------------------------------------------------------------------------------
# Jenkinsfile
# ------------------------------------------------------------------------------------------------------------


def test_parser_rejects_broken_groovy():
    with pytest.raises(SyntaxError):
        parse("pipeline { stages { stage('a') { steps { sh 'x' } } }")  # one '}' missing
    with pytest.raises(SyntaxError):
        parse("pipeline { steps { sh 'unterminated } }")
    tree = parse("pipeline { // a } in a comment\n stage('a{b}') { steps { sh \"ci/stages.sh lint\" } } }")
    assert _unquote(tree.one("pipeline").one("stage").arg) == "a{b}"


def test_jenkinsfile_is_a_declarative_pipeline():
    tree = parse(JENKINSFILE.read_text())
    assert [b.name for b in tree.children] == ["pipeline"] and not tree.statements
    pipeline = tree.one("pipeline")
    assert "agent none" in pipeline.statements  # every stage picks its own agent
    assert pipeline.find("stages") and pipeline.find("options")
    assert any(s.startswith("CI = 'true'") for s in pipeline.one("environment").statements)


def test_jenkinsfile_has_the_stages_in_order():
    assert list(_stages()) == list(EXPECTED)


def test_every_stage_runs_one_stages_sh_command_that_exists():
    script = _script_stages()
    used = []
    for name, stage in _stages().items():
        steps = stage.one("steps").statements
        assert steps == [f"sh 'ci/stages.sh {EXPECTED[name]}'"], f"stage {name!r} steps: {steps}"
        used.append(EXPECTED[name])
        assert EXPECTED[name] in script, f"stage {name!r} runs ci/stages.sh {EXPECTED[name]}, which does not exist"
    assert sorted(used) == sorted(script), "every ci/stages.sh stage is run by exactly one Jenkins stage"


def test_agents_gpu_stages_on_gpu_label():
    for name, stage in _stages().items():
        if name in GPU_STAGES:
            assert stage.one("agent").statements == ["label 'gpu'"], name
        else:
            assert "agent any" in stage.statements, name


def test_junit_published_for_every_pytest_stage_at_the_path_stages_sh_writes():
    text = STAGES_SH.read_text()
    assert '--junitxml="$REPORTS_DIR/$name.xml"' in text and 'REPORTS_DIR="${REPORTS_DIR:-$ROOT/build/reports}"' in text
    for name, stage in _stages().items():
        post = stage.find("post")
        junit = [s for p in post for b in p.children for s in b.statements if s.startswith("junit ")]
        if name in PYTEST_STAGES:
            assert post and post[0].one("always"), f"{name}: junit must be published even when tests fail"
            assert junit == [f"junit allowEmptyResults: false, testResults: 'build/reports/{PYTEST_STAGES[name]}.xml'"]
            assert f"run_pytest {PYTEST_STAGES[name]} " in text
        else:
            assert not junit, name


def test_benchmark_stage_archives_its_json():
    post = _stages()["Benchmark"].one("post")
    assert "archiveArtifacts artifacts: 'benchmarks/results/*.json', fingerprint: true" in post.one("success").statements


# ------------------------------------------------------------------------------------------------------------
# ci/stages.sh and .ci/run
# ------------------------------------------------------------------------------------------------------------


def test_stages_sh_syntax_list_and_unknown_stage():
    assert subprocess.run(["bash", "-n", str(STAGES_SH)], timeout=30).returncode == 0
    assert _script_stages() == ["lint", "unit", "nemo", "gpu", "convergence", "bench"]
    bad = subprocess.run(["bash", str(STAGES_SH), "deploy"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown stage 'deploy'" in bad.stderr
    assert subprocess.run(["bash", str(STAGES_SH)], capture_output=True, timeout=30).returncode == 2
    assert os.access(STAGES_SH, os.X_OK), "Jenkins runs `sh 'ci/stages.sh ...'`: the script must be executable"


def test_ci_run_runs_the_cpu_stages_with_the_same_commands():
    text = CI_RUN.read_text()
    assert subprocess.run(["bash", "-n", str(CI_RUN)], timeout=30).returncode == 0
    assert re.search(r"^for stage in lint unit nemo; do$", text, re.M)
    assert 'bash ci/stages.sh "$stage"' in text
    cpu = [s for n, s in EXPECTED.items() if n not in GPU_STAGES]
    assert cpu == ["lint", "unit", "nemo"]
    assert 'exit "$status"' in text


def _fake_python(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _copy_script(tmp_path: Path) -> Path:
    (tmp_path / "ci").mkdir()
    shutil.copy(STAGES_SH, tmp_path / "ci" / "stages.sh")
    return tmp_path / "ci" / "stages.sh"


@pytest.mark.parametrize("pytest_rc, stage_rc", [(0, 0), (1, 1), (5, 1)])
def test_unit_stage_treats_pytest_exit_5_as_failure(tmp_path, pytest_rc, stage_rc):
    script = _copy_script(tmp_path)
    # A venv whose python installs nothing and whose pytest exits with pytest_rc, recording its arguments.
    _fake_python(tmp_path / ".venv" / "bin" / "python",
                 f'if [ "$2" = pytest ]; then echo "$@" > "{tmp_path}/pytest.args"; exit {pytest_rc}; fi\nexit 0\n')
    out = subprocess.run(["bash", str(script), "unit"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHON": "false"})
    assert out.returncode == stage_rc, out.stdout + out.stderr
    args = (tmp_path / "pytest.args").read_text()
    assert "-m pytest -m not gpu and not nemo" in args and f"--junitxml={tmp_path}/build/reports/unit.xml" in args
    if pytest_rc == 5:
        assert "collected no test for stage 'unit' (exit 5)" in out.stdout
    if stage_rc:
        assert "FAILED (exit" in out.stdout


def test_nemo_stage_fails_when_the_install_fails(tmp_path):
    script = _copy_script(tmp_path)
    # pip fails, as it does without network; the stage must fail, not skip its tests and pass.
    _fake_python(tmp_path / ".venv-nemo" / "bin" / "python",
                 'if [ "$2" = pip ]; then echo "ERROR: No matching distribution found" >&2; exit 1; fi\n'
                 f'echo "$@" >> "{tmp_path}/after-install"; exit 0\n')
    out = subprocess.run(["bash", str(script), "nemo"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "No matching distribution found" in out.stderr
    assert not (tmp_path / "after-install").exists(), "nothing may run after a failed install"


def test_nemo_stage_requires_nemo_and_runs_only_nemo_tests(tmp_path):
    script = _copy_script(tmp_path)
    _fake_python(tmp_path / ".venv-nemo" / "bin" / "python",
                 f'echo "NCG_REQUIRE_NEMO=$NCG_REQUIRE_NEMO $@" >> "{tmp_path}/calls"; '
                 'if [ "$2" = pytest ]; then exit 5; fi; exit 0\n')
    out = subprocess.run(["bash", str(script), "nemo"], capture_output=True, text=True, timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines()
    install = next(c for c in calls if " -m pip install " in c)
    for pin in ("torch==2.13.0", "nemo-toolkit[lightning]==2.7.3", "megatron-core==0.16.1", "leptonai==0.27.3",
                "nvidia-modelopt==0.37.0", "tiktoken==0.7.0", "tensorstore<0.1.72", "anyio<=4.9.0",
                "huggingface-hub<1.0", "pytest", "-e ."):
        assert pin in install.split(" ") or pin in install, pin
    run_tests = next(c for c in calls if " -m pytest " in c)
    assert run_tests.startswith("NCG_REQUIRE_NEMO=1 ") and " -m pytest -m nemo " in run_tests
    assert out.returncode == 1 and "collected no test for stage 'nemo'" in out.stdout  # exit 5 fails here too


def test_gpu_stage_refuses_a_machine_without_cuda(tmp_path):
    script = _copy_script(tmp_path)
    _fake_python(tmp_path / ".venv" / "bin" / "python",
                 'if [ "$1" = -c ]; then exec "' + sys.executable + '" "$@"; fi\n'
                 f'if [ "$2" = pytest ]; then touch "{tmp_path}/ran-pytest"; fi; exit 0\n')
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(["bash", str(script), "gpu"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0 and "needs a CUDA device" in out.stderr
    assert not (tmp_path / "ran-pytest").exists()


# ------------------------------------------------------------------------------------------------------------
# ci/check_convergence.py
# ------------------------------------------------------------------------------------------------------------


def _report(eager, graphed, replays=190, steps=None):
    return {
        "steps": steps if steps is not None else len(eager),
        "runs": [
            {"mode": "eager", "losses": eager, "graph_stats": None},
            {"mode": "graphed", "losses": graphed,
             "graph_stats": {"captures": 1, "replays": replays, "eager_reasons": {}}},
        ],
    }


def _curve(n=200, start=5.5, end=2.5, wiggle=0.0):
    return [start + (end - start) * i / (n - 1) + (wiggle if i % 2 else -wiggle) for i in range(n)]


def test_convergence_passes_for_matching_curves():
    failures, summary = check_convergence.check(_report(_curve(), _curve(wiggle=0.01)))
    assert failures == []
    assert summary["worst_window_ratio"] <= 1 and summary["replays"] == 190


def test_convergence_fails_when_curves_drift_apart():
    graphed = [v + (0.3 if i >= 100 else 0.0) for i, v in enumerate(_curve())]
    failures, _ = check_convergence.check(_report(_curve(), graphed))
    assert failures and all("mean loss graphed" in f for f in failures)
    assert failures[0].startswith("steps 101-120:")


def test_convergence_fails_without_replays_nan_short_runs_or_no_learning():
    failures, _ = check_convergence.check(_report(_curve(), _curve(), replays=0))
    assert any("replayed no CUDA graph" in f for f in failures)
    graphed = _curve()
    graphed[7] = None
    failures, _ = check_convergence.check(_report(_curve(), graphed))
    assert any("non-finite losses at steps [8]" in f for f in failures)
    failures, _ = check_convergence.check(_report(_curve()[:150], _curve()[:150], steps=200))
    assert any("150 losses, expected one per step (200)" in f for f in failures)
    flat = [5.5] * 200
    failures, _ = check_convergence.check(_report(flat, flat))
    assert any("did not converge" in f for f in failures)


def test_convergence_cli_exit_codes_and_summary(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_report(_curve(), _curve())))
    summary = tmp_path / "s" / "summary.json"
    assert check_convergence.main([str(good), "--summary", str(summary)]) == 0
    assert "check_convergence: OK" in capsys.readouterr().out
    assert json.loads(summary.read_text())["passed"] is True
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_report(_curve(), _curve(), replays=0)))
    assert check_convergence.main([str(bad)]) == 1
    eager_only = tmp_path / "eager.json"
    eager_only.write_text(json.dumps({"steps": 3, "runs": [{"mode": "eager", "losses": [1, 2, 3]}]}))
    assert check_convergence.main([str(eager_only)]) == 2
    assert "run with --compare" in capsys.readouterr().err
    assert check_convergence.main([str(tmp_path / "missing.json")]) == 2


def test_convergence_check_reads_the_recipe_output(tmp_path):
    """The real gpt-pretrain --compare JSON (here on the CPU, so the "graphed" run trains eagerly): the format
    is understood, and the check refuses it because no graph was replayed."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "recipes.gpt_pretrain", "--preset", "tiny", "--compare", "--steps", "4",
           "--seq-len", "32", "--val-batches", "1", "--log-every", "0", "--out", str(out)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    failures, summary = check_convergence.check(report, window=2)
    assert summary["steps"] == 4
    assert any("replayed no CUDA graph" in f for f in failures), failures
    assert not any("losses, expected" in f or "non-finite" in f for f in failures), failures


def test_convergence_stage_commands_with_no_venv(tmp_path):
    script = _copy_script(tmp_path)
    fake = tmp_path / "bin" / "python3"
    _fake_python(fake, f'echo "$@" >> "{tmp_path}/calls"; exit 0\n')
    env = {**os.environ, "NO_VENV": "1", "PYTHON": str(fake)}
    out = subprocess.run(["bash", str(script), "convergence"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    calls = [c for c in (tmp_path / "calls").read_text().splitlines() if c != "--version"]
    assert not any("pip" in c for c in calls), "NO_VENV=1 installs nothing"
    assert calls == [
        f"-m recipes.gpt_pretrain --preset small --compare --steps 200 --out {tmp_path}/build/convergence",
        f"ci/check_convergence.py {tmp_path}/build/convergence/results.json --rtol 0.02 --atol 0.02 "
        f"--summary {tmp_path}/build/convergence/convergence.json",
    ]
    assert not (tmp_path / ".venv").exists()
