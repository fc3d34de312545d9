#!/usr/bin/env bash
# The one script every CI stage runs: the Jenkinsfile's stages and .ci/run call exactly these commands.
#
#   ci/stages.sh lint          ruff on the package, recipes, tests, benchmarks and ci/
#   ci/stages.sh unit          CPU tests (not gpu, not nemo) in .venv          -> build/reports/unit.xml
#   ci/stages.sh transformers4 the same CPU tests on transformers 4.57 (the zoo-transformers4 extra) in
#                              .venv-transformers4                              -> build/reports/transformers4.xml
#   ci/stages.sh mutants       ci/mutants.py --tier cpu in .venv: planted breaks the tests must catch
#   ci/stages.sh nemo          NeMo 2.7.3 recipe tests in .venv-nemo, and the  -> build/reports/nemo.xml
#                              Lightning adapter's tests on its Lightning 2.4.0; then ci/mutants.py --tier nemo
#   ci/stages.sh gpu           tests/gpu on a CUDA machine                      -> build/reports/gpu.xml
#   ci/stages.sh convergence   eager vs graphed loss curves of the small recipe -> build/convergence/
#   ci/stages.sh bench         python -m benchmarks.harness (step-time table)   -> benchmarks/results/*.json
#   ci/stages.sh --list        the stage names, one a line
#
# Every stage fails (non-zero exit) on: a failed install, a failed test, and pytest's exit 5 (no test ran).
# Environment: PYTHON (interpreter that creates the venvs, default python3), REPORTS_DIR (default
# build/reports), CONVERGENCE_STEPS (default 200), CONVERGENCE_RTOL / CONVERGENCE_ATOL (see
# ci/check_convergence.py), BENCH_ARGS (extra arguments of python -m benchmarks.harness), NO_VENV=1 (gpu,
# convergence, bench: use $PYTHON as it is, with the package and its test deps already installed, e.g. on a
# GPU machine without network; nothing is installed).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

STAGES=(lint unit transformers4 mutants nemo gpu convergence bench)
PYTHON="${PYTHON:-python3}"
REPORTS_DIR="${REPORTS_DIR:-$ROOT/build/reports}"
TORCH_PIN="torch==2.13.0"  # also ci/setup-venv.sh's default (TORCH_SPEC)
# Measured: NeMo 2.7.3's LLM recipes install and build as configs on a CPU machine with exactly these pins
# (NeMo 2.7.3 pins lightning 2.4.0; without nvidia-modelopt the recipes are silently missing; nemo-run
# 0.11.1 imports only with leptonai 0.27.3).
NEMO_PINS=("$TORCH_PIN" "nemo-toolkit[lightning]==2.7.3" "megatron-core==0.16.1" "leptonai==0.27.3" nemo_run
           einops sentencepiece pandas datasets "huggingface-hub<1.0" "tiktoken==0.7.0" "tensorstore<0.1.72"
           "nvidia-modelopt==0.37.0" "anyio<=4.9.0")

say() { printf '[ci/stages.sh %s] %s\n' "${STAGE:-?}" "$*"; }

# make_venv DIR: create DIR with $PYTHON -m venv unless it already holds a python.
make_venv() {
    if [ ! -x "$1/bin/python" ]; then
        say "creating $1 with $($PYTHON --version 2>&1)"
        "$PYTHON" -m venv "$1"
    fi
}

# run_pytest NAME PYTHON ARGS...: pytest with JUnit XML; exit 5 (no test ran) is a failure.
run_pytest() {
    local name="$1" py="$2"
    shift 2
    mkdir -p "$REPORTS_DIR"
    local rc=0
    "$py" -m pytest "$@" -rfEs --junitxml="$REPORTS_DIR/$name.xml" -o junit_suite_name="$name" || rc=$?
    if [ "$rc" -eq 5 ]; then
        say "FAIL: pytest collected no test for stage '$name' (exit 5); a stage that runs nothing is not green"
        return 1
    fi
    return "$rc"
}

# unit_venv: sets PY to .venv's python, set up by ci/setup-venv.sh (the same script README's first command
# runs): torch 2.13.0 first (the CPU build on a machine without a GPU; a torch already in .venv is kept), then
# the package with its test, plot and zoo extras (matplotlib and transformers, so the PNG and Hugging Face tests run
# instead of skipping).
unit_venv() {
    if [ "${NO_VENV:-0}" = 1 ] && [ "$STAGE" != unit ] && [ "$STAGE" != mutants ]; then
        PY="$(command -v "$PYTHON")"
        say "NO_VENV=1: using $PY as it is ($("$PY" --version 2>&1)); installing nothing"
        return 0
    fi
    PYTHON="$PYTHON" TORCH_SPEC="$TORCH_PIN" bash ci/setup-venv.sh .venv "test,plot,zoo"
    PY=.venv/bin/python
}

stage_lint() {
    make_venv .venv
    .venv/bin/python -m pip install --quiet ruff
    local paths=()
    for p in nemo_cudagraph_plugin recipes tests benchmarks ci; do
        [ -e "$p" ] && paths+=("$p")
    done
    say "ruff $(.venv/bin/ruff --version) on ${paths[*]}"
    .venv/bin/ruff check "${paths[@]}"
}

stage_unit() {
    unit_venv
    say "the NeMo recipe tests (marker nemo) are deselected here: they run in the nemo stage, on real NeMo"
    cpu_tests unit
}

# cpu_tests NAME: the CPU test selection in $PY, with transformers' version said first.
cpu_tests() {
    say "transformers $("$PY" -c 'import transformers; print(transformers.__version__)' 2>&1 | tail -n 1)"
    # NCG_REQUIRE_PLOT=1: the PNG tests fail instead of skipping if matplotlib did not install.
    # NCG_REQUIRE_ZOO=1: the Hugging Face tests fail instead of skipping if transformers did not install.
    # NCG_REQUIRE_TRITON=1: the kernel tests in Triton's interpreter fail instead of skipping without Triton.
    NCG_REQUIRE_PLOT=1 NCG_REQUIRE_ZOO=1 NCG_REQUIRE_TRITON=1 run_pytest "$1" "$PY" -m "not gpu and not nemo"
}

# The unit stage's tests on the older transformers users still train with (4.57: no experts interface, the mask code
# before 5), so that neither version breaks unnoticed.
stage_transformers4() {
    PYTHON="$PYTHON" TORCH_SPEC="$TORCH_PIN" bash ci/setup-venv.sh .venv-transformers4 "test,plot,zoo-transformers4"
    PY=.venv-transformers4/bin/python
    cpu_tests transformers4
}

# Planted breaks (mutants) of the product code, each of which the CPU tests must catch; ci/mutants.py exits
# non-zero when a break goes unnoticed (or when it cannot run).
stage_mutants() {
    unit_venv
    if [ ! -f ci/mutants.py ]; then
        say "FAIL: ci/mutants.py does not exist"
        return 1
    fi
    "$PY" ci/mutants.py --tier cpu
}

stage_nemo() {
    make_venv .venv-nemo
    say "installing NeMo 2.7.3 + megatron-core 0.16.1 into .venv-nemo (about 200 s, 2.5 GB on a new machine)"
    # No fallback: if this install fails (no network, a pin gone), the stage fails.
    .venv-nemo/bin/python -m pip install --quiet "${NEMO_PINS[@]}" pytest -e .
    .venv-nemo/bin/python - <<'PY'
import importlib.metadata as md
for name in ("nemo-toolkit", "megatron-core", "nemo-run", "lightning", "torch"):
    print(f"[ci/stages.sh nemo] {name}=={md.version(name)}")
from nemo.collections import llm  # noqa: F401  (fails the stage here, not as a skip, if NeMo is broken)
assert hasattr(llm, "llama3_8b"), "nemo.collections.llm has no llama3_8b recipe (is nvidia-modelopt installed?)"
PY
    # NCG_REQUIRE_NEMO=1: the NeMo tests fail instead of skipping when NeMo cannot be imported. NeMo 2.7.3 pins
    # Lightning 2.4.0, the oldest the Lightning adapter supports, so the adapter's tests (the private shapes it relies
    # on, bit-for-bit parity with eager Lightning) run here on that version too; the unit stage runs the newest.
    NCG_REQUIRE_NEMO=1 run_pytest nemo .venv-nemo/bin/python -m "nemo or lightning_adapter"
    # Planted breaks of the NeMo flag that only these tests (real NeMo recipes) can catch.
    NCG_REQUIRE_NEMO=1 .venv-nemo/bin/python ci/mutants.py --tier nemo
}

stage_gpu() {
    unit_venv
    "$PY" -c "import torch, sys; ok = torch.cuda.is_available(); print('[ci/stages.sh gpu] torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if ok else 'NO GPU'); sys.exit(0 if ok else 'the gpu stage needs a CUDA device (agent label gpu)')"
    run_pytest gpu "$PY" -m gpu tests/gpu
}

stage_convergence() {
    unit_venv
    local out="$ROOT/build/convergence"
    rm -rf "$out"
    "$PY" -m recipes.gpt_pretrain --preset small --compare --steps "${CONVERGENCE_STEPS:-200}" \
        --out "$out"
    "$PY" ci/check_convergence.py "$out/results.json" \
        --rtol "${CONVERGENCE_RTOL:-0.02}" --atol "${CONVERGENCE_ATOL:-0.02}" --summary "$out/convergence.json"
}

stage_bench() {
    unit_venv
    mkdir -p benchmarks/results
    # NeMo 3.0.0's callback (a variant of the GPT workloads) is read from its wheel; without network (NO_VENV=1)
    # carry .bench/ instead: that variant is reported as failed, saying how to get the wheel, when it is missing.
    if [ "${NO_VENV:-0}" != 1 ] && ! ls .bench/nemo_toolkit-3.0.0-*.whl > /dev/null 2>&1; then
        say "downloading NeMo 3.0.0's wheel to .bench/ (its CUDAGraphCallback is a variant of the table)"
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: nemo-toolkit==3.0.0 -d .bench
    fi
    # A JSON left by an earlier run must not pass for this run's (a file's mtime cannot tell within one second).
    rm -f benchmarks/results/step-time.json
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words on purpose
    "$PY" -m benchmarks.harness --out benchmarks/results ${BENCH_ARGS:-}
    if [ ! -s benchmarks/results/step-time.json ]; then
        say "FAIL: python -m benchmarks.harness wrote no benchmarks/results/step-time.json"
        return 1
    fi
    say "results to archive: benchmarks/results/step-time.json (tables: step-time.page.md, step-time.readme.md)"
}

main() {
    if [ "$#" -ne 1 ]; then
        echo "usage: ci/stages.sh {$(IFS='|'; echo "${STAGES[*]}")|--list}" >&2
        return 2
    fi
    case "$1" in
        --list) printf '%s\n' "${STAGES[@]}"; return 0 ;;
        lint | unit | transformers4 | mutants | nemo | gpu | convergence | bench) ;;
        *)
            echo "ci/stages.sh: unknown stage '$1'; stages: ${STAGES[*]}" >&2
            return 2
            ;;
    esac
    STAGE="$1"
    STAGE_START=$SECONDS
    trap 'rc=$?; [ "$rc" -eq 0 ] || say "FAILED (exit $rc) after $((SECONDS - STAGE_START)) s"' EXIT
    say "start"
    "stage_$1"
    say "passed in $((SECONDS - STAGE_START)) s"
}

# Sourcing the script (tests do) defines the functions without running a stage.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    main "$@"
fi
