"""Tests of the CI definition: the Jenkinsfile's structure, ci/stages.sh, ci/setup-venv.sh, .ci/run,
tests/gpu/conftest.py's handling of CPU machines and ci/check_convergence.py.

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
SETUP_VENV = ROOT / "ci" / "setup-venv.sh"
CI_RUN = ROOT / ".ci" / "run"
sys.path.insert(0, str(ROOT / "ci"))
import check_convergence  # noqa: E402  (ci/ is not a package)

# Jenkins stage name -> the ci/stages.sh stage it runs.
EXPECTED = {
    "Lint": "lint",
    "CPU unit tests": "unit",
    "CPU unit tests, transformers 4.57": "transformers4",
    "Mutants": "mutants",
    "NeMo recipe": "nemo",
    "GPU tests": "gpu",
    "Convergence": "convergence",
    "Benchmark": "bench",
}
GPU_STAGES = {"GPU tests", "Convergence", "Benchmark"}
PYTEST_STAGES = {"CPU unit tests": "unit", "CPU unit tests, transformers 4.57": "transformers4", "NeMo recipe": "nemo",
                 "GPU tests": "gpu"}


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
            # directly, or through cpu_tests NAME (the unit selection, run_pytest "$1")
            n = PYTEST_STAGES[name]
            assert f"run_pytest {n} " in text or (f"cpu_tests {n}\n" in text and 'run_pytest "$1" ' in text)
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
    assert _script_stages() == ["lint", "unit", "transformers4", "mutants", "nemo", "gpu", "convergence", "bench"]
    bad = subprocess.run(["bash", str(STAGES_SH), "deploy"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown stage 'deploy'" in bad.stderr
    assert subprocess.run(["bash", str(STAGES_SH)], capture_output=True, timeout=30).returncode == 2
    assert os.access(STAGES_SH, os.X_OK), "Jenkins runs `sh 'ci/stages.sh ...'`: the script must be executable"


def test_ci_run_runs_the_cpu_stages_with_the_same_commands():
    text = CI_RUN.read_text()
    assert subprocess.run(["bash", "-n", str(CI_RUN)], timeout=30).returncode == 0
    cpu = [s for n, s in EXPECTED.items() if n not in GPU_STAGES]
    assert cpu == ["lint", "unit", "transformers4", "mutants", "nemo"]
    assert re.search(rf"^CPU_STAGES=\({' '.join(cpu)}\)$", text, re.M), "the Jenkinsfile's CPU stages, in order"
    assert text.count('for stage in "${CPU_STAGES[@]}"; do') == 2  # run them all, and list them all
    assert 'bash ci/stages.sh "$stage"' in text
    assert '"$LOGS/mutants.log"' in text  # the mutants verdict is in the summary
    assert 'exit "$status"' in text


def test_ci_run_summary_prints_the_mutants_verdicts_not_the_stage_timing_line(tmp_path):
    """The summary quotes ci/mutants.py's verdict line, although ci/stages.sh prints its timing line after it."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(CI_RUN, tmp_path / ".ci" / "run")
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "stages.sh").write_text("""case "$1" in
  unit) echo "===== 5 passed, 28 deselected in 1.0s =====" ;;
  mutants) echo "  caught  some-mutant (3 s)"; echo "| table |"; echo "";
           echo "mutants: 3 of 3 caught (tier cpu) in 9 s"; echo "[ci/stages.sh mutants] passed in 12 s" ;;
  nemo) echo "===== 2 passed in 1.0s ====="; echo "mutants: 1 of 1 caught (tier nemo) in 3 s";
        echo "[ci/stages.sh nemo] passed in 5 s" ;;
esac
echo "[ci/stages.sh $1] passed in 1 s"
""")
    out = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = out.stdout.split(".ci/run summary", 1)[1].splitlines()
    assert "mutants verdict: mutants: 3 of 3 caught (tier cpu) in 9 s" in summary
    assert "nemo mutants verdict: mutants: 1 of 1 caught (tier nemo) in 3 s" in summary
    assert "unit pytest: ===== 5 passed, 28 deselected in 1.0s =====" in summary
    assert summary[-1] == "7 passed, 0 failed, 0 skipped"


def _fake_python(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _copy_script(tmp_path: Path) -> Path:
    (tmp_path / "ci").mkdir()
    shutil.copy(STAGES_SH, tmp_path / "ci" / "stages.sh")
    shutil.copy(SETUP_VENV, tmp_path / "ci" / "setup-venv.sh")
    return tmp_path / "ci" / "stages.sh"


@pytest.mark.parametrize("pytest_rc, stage_rc", [(0, 0), (1, 1), (5, 1)])
def test_unit_stage_treats_pytest_exit_5_as_failure(tmp_path, pytest_rc, stage_rc):
    script = _copy_script(tmp_path)
    # A venv whose python installs nothing and whose pytest exits with pytest_rc, recording its arguments.
    _fake_python(tmp_path / ".venv" / "bin" / "python",
                 f'if [ "$2" = pytest ]; then echo "NCG_REQUIRE_PLOT=$NCG_REQUIRE_PLOT NCG_REQUIRE_ZOO=$NCG_REQUIRE_ZOO '
                 f'NCG_REQUIRE_TRITON=$NCG_REQUIRE_TRITON $@" > "{tmp_path}/pytest.args"; '
                 f'exit {pytest_rc}; fi\necho "$@" >> "{tmp_path}/calls"; exit 0\n')
    out = subprocess.run(["bash", str(script), "unit"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHON": "false"})
    assert out.returncode == stage_rc, out.stdout + out.stderr
    args = (tmp_path / "pytest.args").read_text()
    assert "-m pytest -m not gpu and not nemo" in args and f"--junitxml={tmp_path}/build/reports/unit.xml" in args
    # the test, plot and zoo extras are installed and the Triton, PNG and Hugging Face tests are told not to skip
    assert args.startswith("NCG_REQUIRE_PLOT=1 NCG_REQUIRE_ZOO=1 NCG_REQUIRE_TRITON=1 ")
    assert "-m pip install --progress-bar off -e .[test,plot,zoo]" in (tmp_path / "calls").read_text().splitlines()
    # the deselected NeMo tests are not dropped silently: the stage says where they run
    assert "the NeMo recipe tests (marker nemo) are deselected here: they run in the nemo stage" in out.stdout
    if pytest_rc == 5:
        assert "collected no test for stage 'unit' (exit 5)" in out.stdout
    if stage_rc:
        assert "FAILED (exit" in out.stdout


@pytest.mark.parametrize("pytest_rc, stage_rc", [(0, 0), (5, 1)])
def test_transformers4_stage_runs_the_unit_selection_on_transformers_4_in_its_own_venv(tmp_path, pytest_rc, stage_rc):
    script = _copy_script(tmp_path)
    _fake_python(tmp_path / ".venv-transformers4" / "bin" / "python",
                 f'if [ "$2" = pytest ]; then echo "NCG_REQUIRE_ZOO=$NCG_REQUIRE_ZOO $@" > "{tmp_path}/pytest.args"; '
                 f'exit {pytest_rc}; fi\nif [ "$1" = -c ]; then echo 4.57.6; exit 0; fi\n'
                 f'echo "$@" >> "{tmp_path}/calls"; exit 0\n')
    out = subprocess.run(["bash", str(script), "transformers4"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHON": "false"})
    assert out.returncode == stage_rc, out.stdout + out.stderr
    args = (tmp_path / "pytest.args").read_text()
    assert args.startswith("NCG_REQUIRE_ZOO=1 ") and "-m pytest -m not gpu and not nemo" in args
    assert f"--junitxml={tmp_path}/build/reports/transformers4.xml" in args
    calls = (tmp_path / "calls").read_text().splitlines()
    assert "-m pip install --progress-bar off -e .[test,plot,zoo-transformers4]" in calls
    assert "transformers 4.57.6" in out.stdout
    if pytest_rc == 5:
        assert "collected no test for stage 'transformers4' (exit 5)" in out.stdout


@pytest.mark.parametrize("mutants_rc", [0, 3])
def test_mutants_stage_runs_ci_mutants_cpu_tier_in_the_unit_venv(tmp_path, mutants_rc):
    script = _copy_script(tmp_path)
    _fake_python(tmp_path / ".venv" / "bin" / "python",
                 f'echo "$@" >> "{tmp_path}/calls"; if [ "$1" = ci/mutants.py ]; then exit {mutants_rc}; fi; exit 0\n')
    # without ci/mutants.py the stage fails (it must never pass by running nothing)
    out = subprocess.run(["bash", str(script), "mutants"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "ci/mutants.py does not exist" in out.stdout
    (tmp_path / "ci" / "mutants.py").write_text("")
    out = subprocess.run(["bash", str(script), "mutants"], capture_output=True, text=True, timeout=60)
    assert out.returncode == mutants_rc, out.stdout + out.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert "-m pip install --progress-bar off -e .[test,plot,zoo]" in calls  # the unit stage's environment
    assert calls[-1] == "ci/mutants.py --tier cpu"


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


@pytest.mark.parametrize("mutants_rc", [0, 3])
def test_nemo_stage_runs_the_nemo_mutants_after_its_tests_and_fails_with_them(tmp_path, mutants_rc):
    script = _copy_script(tmp_path)
    _fake_python(tmp_path / ".venv-nemo" / "bin" / "python",
                 f'echo "NCG_REQUIRE_NEMO=$NCG_REQUIRE_NEMO $@" >> "{tmp_path}/calls"; '
                 f'if [ "$1" = ci/mutants.py ]; then exit {mutants_rc}; fi; exit 0\n')
    out = subprocess.run(["bash", str(script), "nemo"], capture_output=True, text=True, timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[-1] == "NCG_REQUIRE_NEMO=1 ci/mutants.py --tier nemo"
    assert any(" -m pytest -m nemo " in c for c in calls[:-1]), "the tests run first"
    assert (out.returncode == 0) == (mutants_rc == 0), out.stdout + out.stderr


def test_gpu_stage_refuses_a_machine_without_cuda(tmp_path):
    script = _copy_script(tmp_path)
    _fake_python(tmp_path / ".venv" / "bin" / "python",
                 'if [ "$1" = -c ]; then exec "' + sys.executable + '" "$@"; fi\n'
                 f'if [ "$2" = pytest ]; then touch "{tmp_path}/ran-pytest"; fi; exit 0\n')
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(["bash", str(script), "gpu"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0 and "needs a CUDA device" in out.stderr
    assert not (tmp_path / "ran-pytest").exists()


def test_gpu_tests_sh_stops_a_suite_that_ignores_the_timeouts_sigterm(tmp_path):
    """Lightning turns SIGTERM into an exception at the next batch end and pytest then runs the next test: the
    script's time limit must end the whole run (SIGKILL after a grace period), not one test."""
    (tmp_path / "ci").mkdir()
    shutil.copy(ROOT / "ci" / "gpu_tests.sh", tmp_path / "ci" / "gpu_tests.sh")
    _fake_python(tmp_path / "bin" / "python3",
                 'if [ "$1" = -m ] && [ "$2" = pytest ]; then trap "" TERM; for i in $(seq 60); do sleep 1; done; '
                 'exit 0; fi\n'
                 f'exec "{sys.executable}" "$@"\n')
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "NEW_TIMEOUT": "1", "KILL_AFTER": "1",
           "OUT": str(tmp_path / "out")}
    out = subprocess.run(["bash", str(tmp_path / "ci" / "gpu_tests.sh")], capture_output=True, text=True, timeout=30,
                         env=env)
    assert "new: exit 137" in out.stdout, out.stdout + out.stderr


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


def test_convergence_check_refuses_the_recipe_output_of_a_cpu_run(tmp_path, capsys):
    """The real gpt-pretrain --compare JSON on the CPU: the run with the plugin trains eagerly, is labelled
    "eager+plugin" (not "graphed"), and the convergence check must not pass it."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "recipes.gpt_pretrain", "--preset", "tiny", "--compare", "--steps", "4",
           "--seq-len", "32", "--val-batches", "1", "--log-every", "0", "--out", str(out)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    assert [r["mode"] for r in report["runs"]] == ["eager", "eager+plugin"] and report["replayed"] == 0
    assert check_convergence.main([str(out / "results.json"), "--window", "2"]) != 0
    said = capsys.readouterr()
    assert "replayed no CUDA graph" in said.out or "eager+plugin" in said.err, said


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


@pytest.mark.parametrize("writes", [True, False])
def test_bench_stage_runs_the_harness_and_fails_when_it_wrote_no_json(tmp_path, writes):
    script = _copy_script(tmp_path)
    fake = tmp_path / "bin" / "python3"
    write = "mkdir -p benchmarks/results && echo {} > benchmarks/results/step-time.json" if writes else ":"
    _fake_python(fake, f'echo "$@" >> "{tmp_path}/calls"; if [ "$2" = benchmarks.harness ]; then {write}; fi; exit 0\n')
    env = {**os.environ, "NO_VENV": "1", "PYTHON": str(fake), "BENCH_ARGS": "--rounds 1 --gpus 4"}
    # a JSON of an earlier run is there: it must not pass for this run's
    (tmp_path / "benchmarks" / "results").mkdir(parents=True, exist_ok=True)
    (tmp_path / "benchmarks" / "results" / "step-time.json").write_text("{}")
    out = subprocess.run(["bash", str(script), "bench"], capture_output=True, text=True, timeout=60, env=env,
                         cwd=tmp_path)
    calls = [c for c in (tmp_path / "calls").read_text().splitlines() if c != "--version"]
    assert calls == ["-m benchmarks.harness --out benchmarks/results --rounds 1 --gpus 4"], calls
    if writes:
        assert out.returncode == 0, out.stdout + out.stderr
        assert "results to archive: benchmarks/results/step-time.json" in out.stdout
    else:
        assert out.returncode == 1 and "FAIL: python -m benchmarks.harness wrote no" in out.stdout


# ------------------------------------------------------------------------------------------------------------
# ci/setup-venv.sh (README's first command) and tests/gpu/conftest.py
# ------------------------------------------------------------------------------------------------------------


def _setup_venv_sandbox(tmp_path: Path, *, torch_present: bool, dry_run_pulls: list[str],
                        index_pulls: list[str] | None = None) -> Path:
    """A copy of ci/setup-venv.sh with a fake .venv python that logs its calls; no real install happens.

    ``pip install --dry-run`` reports torch plus ``dry_run_pulls``, or plus ``index_pulls`` when an
    ``--index-url`` is given (default: the same as without).
    """
    (tmp_path / "ci").mkdir(parents=True)
    shutil.copy(SETUP_VENV, tmp_path / "ci" / "setup-venv.sh")
    marker = tmp_path / "torch-installed"
    if torch_present:
        marker.touch()

    def report(names: list[str]) -> str:
        return json.dumps({"install": [{"metadata": {"name": n}} for n in ["torch", *names]]})

    plain, indexed = report(dry_run_pulls), report(dry_run_pulls if index_pulls is None else index_pulls)
    _fake_python(tmp_path / ".venv" / "bin" / "python", f"""echo "$@" >> "{tmp_path}/calls"
if [ "$1" = - ]; then exec "{sys.executable}" "$@"; fi
if [ "$1" = -c ]; then [ -e "{marker}" ] && exit 0; exit 1; fi
if [ "$2 $3" = "pip install" ]; then
    case " $* " in
        *" --dry-run "*)
            body='{plain}'; case " $* " in *" --index-url "*) body='{indexed}' ;; esac
            prev=; for a in "$@"; do [ "$prev" = --report ] && echo "$body" > "$a"; prev="$a"; done ;;
        *" torch==2.13.0"*) touch "{marker}" ;;
    esac
fi
exit 0
""")
    return tmp_path / "ci" / "setup-venv.sh"


def _run_setup(script: Path, tmp_path: Path, *, gpu: bool, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpu:
        _fake_python(bin_dir / "nvidia-smi", 'echo "GPU 0: NVIDIA H200 (UUID: GPU-x)"\n')
    path = f"{bin_dir}:/usr/bin:/bin"  # no real nvidia-smi
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env={"PATH": path, "HOME": str(tmp_path), **env})


def _installs(tmp_path: Path) -> list[str]:
    return [c for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("-m pip install")]


def test_setup_venv_installs_cpu_torch_first_then_the_package_with_plot(tmp_path):
    script = _setup_venv_sandbox(tmp_path, torch_present=False, dry_run_pulls=["filelock"])
    out = _run_setup(script, tmp_path, gpu=False)
    assert out.returncode == 0, out.stdout + out.stderr
    installs = _installs(tmp_path)
    assert installs[0].startswith("-m pip install --quiet --dry-run") and installs[0].endswith(" torch==2.13.0")
    assert installs[1:] == ["-m pip install --progress-bar off torch==2.13.0", "-m pip install --progress-bar off -e .[plot]"]
    assert "no NVIDIA GPU: installing the CPU build of torch==2.13.0" in out.stdout
    # the long installs say what they do and are not silenced (pip lists what it collects and installs)
    assert "downloading and installing the CPU build of torch==2.13.0" in out.stdout
    assert "installing the package and its dependencies: pip install -e .[plot]" in out.stdout
    assert not [c for c in installs if "--quiet" in c and "--dry-run" not in c]


def test_setup_venv_takes_torch_from_the_cpu_index_when_pypi_serves_a_cuda_build(tmp_path):
    """What a CPU-only Linux machine on PyPI sees: the default torch pulls nvidia-* wheels; the CPU index not."""
    script = _setup_venv_sandbox(tmp_path, torch_present=False, dry_run_pulls=["nvidia-cublas-cu12"],
                                 index_pulls=[])
    out = _run_setup(script, tmp_path, gpu=False, TORCH_CPU_INDEX_URL="file:///cpu-wheels")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "serves a CUDA build of torch==2.13.0 here (it pulls: nvidia-cublas-cu12)" in out.stdout
    installs = _installs(tmp_path)
    assert [("--dry-run" in c, "--index-url file:///cpu-wheels" in c) for c in installs[:2]] == [(True, False),
                                                                                              (True, True)]
    assert installs[2:] == ["-m pip install --progress-bar off --index-url file:///cpu-wheels torch==2.13.0",
                            "-m pip install --progress-bar off -e .[plot]"]


def test_setup_venv_stops_before_downloading_a_cuda_torch_on_a_cpu_machine(tmp_path):
    script = _setup_venv_sandbox(tmp_path, torch_present=False, dry_run_pulls=["nvidia-cublas-cu12", "triton"])
    out = _run_setup(script, tmp_path, gpu=False, TORCH_CPU_INDEX_URL="file:///cpu-wheels")
    assert out.returncode == 1
    assert "STOP: no CPU build of torch==2.13.0 found" in out.stderr and "nvidia-cublas-cu12" in out.stderr
    assert "TORCH_INDEX_URL=<index>" in out.stderr
    assert all("--dry-run" in c for c in _installs(tmp_path))  # nothing was installed
    # a given TORCH_INDEX_URL is used for the torch install (and only it), with no fallback
    again = tmp_path / "again"
    script = _setup_venv_sandbox(again, torch_present=False, dry_run_pulls=["nvidia-cublas-cu12"], index_pulls=[])
    out = _run_setup(script, again, gpu=False, TORCH_INDEX_URL="file:///mine")
    assert out.returncode == 0, out.stdout + out.stderr
    installs = _installs(again)
    assert len(installs) == 3 and "--index-url file:///mine" in installs[0]
    assert installs[1:] == ["-m pip install --progress-bar off --index-url file:///mine torch==2.13.0",
                            "-m pip install --progress-bar off -e .[plot]"]


def test_setup_venv_on_a_gpu_machine_and_with_torch_present(tmp_path):
    script = _setup_venv_sandbox(tmp_path, torch_present=False, dry_run_pulls=["nvidia-cublas-cu12"])
    out = _run_setup(script, tmp_path, gpu=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _installs(tmp_path) == ["-m pip install --progress-bar off torch==2.13.0", "-m pip install --progress-bar off -e .[plot]"]

    kept = tmp_path / "kept"
    script = _setup_venv_sandbox(kept, torch_present=True, dry_run_pulls=[])
    out = _run_setup(script, kept, gpu=False)
    assert out.returncode == 0 and "keeping the torch already in .venv" in out.stdout
    assert _installs(kept) == ["-m pip install --progress-bar off -e .[plot]"]


def test_gpu_tests_are_not_collected_on_a_cpu_machine_nor_reported_as_skipped():
    """Without CUDA, tests/gpu is left out (header says so) instead of adding skips to every CPU stage."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co", "-rs",
                           "-m", "not gpu and not nemo", "tests/gpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 5, done.stdout + done.stderr  # nothing collected (the gpu stage refuses CPU first)
    n = len(list((ROOT / "tests" / "gpu").glob("test_*.py")))
    assert f"tests/gpu: {n} test files not collected: no CUDA device" in done.stdout
    assert "skipped" not in done.stdout.lower(), done.stdout
