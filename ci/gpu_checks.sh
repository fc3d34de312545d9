#!/usr/bin/env bash
# GPU host: the NaN guard's one-launch check measured alone (benchmarks/nan_guard.py), the GPU tests
# that guard it and the engine, and the GPU tier of the mutation check (ci/mutants.py --tier gpu).
#
#   OUT=/tmp/out bash ci/gpu_checks.sh          (.te/final/install_on_host.sh installs TransformerEngine when it
#                                                 does not import: the FP8 mutant and test need it)
#
# Each part gets what is left of BUDGET seconds (default 540) minus what the later parts need at least; a part
# that cannot get its minimum is skipped and says so. NAN_BENCH=0 skips the guard benchmark, MUTANT_ARGS adds
# arguments (e.g. --only NAME,...), RESERVE_AFTER keeps seconds free at the end for a later command. Writes under $OUT: te_install.log, nan_guard.{txt,json},
# tests.log, tests.xml, mutants.log, mutants-gpu.md. Prints one table last.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/build/gpu_checks}"
BUDGET=${BUDGET:-540}
TESTS=${TESTS:-"tests/gpu/test_finite_gpu.py tests/gpu/test_can_fail_gpu.py tests/gpu/test_host_sync_gpu.py"}
S=tests/gpu/test_stale_gpu.py
C=tests/gpu/test_capture_gpu.py
EXTRA_K=${EXTRA_K:-"$C::test_nan_guard_names_parameter $C::test_nan_guard_skip_mode_keeps_parameters_finite \
$S::test_verify_steps_leaves_batchnorm_statistics_as_an_unverified_run \
$S::test_nan_guard_setup_in_the_sync_checked_warmup_is_not_a_false_host_sync"}
mkdir -p "$OUT"
export PYTHONPATH=$ROOT PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
START=$SECONDS
declare -a ROWS
left() { echo $((BUDGET - (SECONDS - START) - $1)); }
step() {  # step NAME MIN_S RESERVE_S CMD... : run with the time left minus RESERVE_S, if at least MIN_S
    local name=$1 min=$2 reserve=$3 t0=$SECONDS lim rc
    shift 3
    lim=$(left "$reserve")
    if [ "$lim" -lt "$min" ]; then
        ROWS+=("$(printf '%-12s SKIPPED (%s s left, needs %s)' "$name" "$lim" "$min")")
        return
    fi
    timeout -k 5 "$lim" "$@"
    rc=$?
    ROWS+=("$(printf '%-12s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
}

if ! python3 -c "import transformer_engine.pytorch" > /dev/null 2>&1 && [ -f .te/final/install_on_host.sh ]; then
    step te_install 100 300 bash -c "bash .te/final/install_on_host.sh > '$OUT/te_install.log' 2>&1"
fi
python3 - <<'PY' | tee "$OUT/env.txt"
import platform, torch, lightning
try:
    import triton; tv = triton.__version__
except Exception as e:  # noqa: BLE001
    tv = f"none ({type(e).__name__})"
try:
    import transformer_engine as te; tev = te.__version__
except Exception as e:  # noqa: BLE001
    tev = f"none ({type(e).__name__})"
print(f"python {platform.python_version()} torch {torch.__version__} lightning {lightning.__version__} triton {tv} "
      f"TE {tev} gpu {torch.cuda.get_device_name() if torch.cuda.is_available() else None}")
PY
[ "${NAN_BENCH:-1}" = 1 ] && step nan_guard 20 330 bash -c "python3 -m benchmarks.nan_guard --out '$OUT' > '$OUT/nan_guard.txt' 2>&1"
# shellcheck disable=SC2086
step gpu_tests 60 $((${RESERVE_AFTER:-5} + 165)) bash -c "python3 -m pytest -q -p no:cacheprovider $TESTS $EXTRA_K -rfEs --junitxml='$OUT/tests.xml' > '$OUT/tests.log' 2>&1"
step mutants 120 ${RESERVE_AFTER:-5} bash -c "python3 ci/mutants.py --tier gpu ${MUTANT_ARGS:-} --timeout 150 --out '$OUT/mutants-gpu.md' > '$OUT/mutants.log' 2>&1"

echo "----- nan_guard (µs per check, alone) -----"
tail -n 25 "$OUT/nan_guard.txt" 2> /dev/null
echo "----- GPU tests -----"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" 2> /dev/null | cut -c1-200 | head -20
tail -n 1 "$OUT/tests.log" 2> /dev/null
echo "----- mutants (GPU tier) -----"
tail -n 12 "$OUT/mutants.log" 2> /dev/null
printf '%s\n' "${ROWS[@]}"
