#!/usr/bin/env bash
# One GPU-host session with real TransformerEngine (staged by ../shared/gpu-host/te/prepare.sh into .te/):
# install TE, then the FP8 and pipeline GPU tests, the pipeline-alignment benchmark, the step-time benchmark of
# the small preset (re-measure after capture changes), the capture/strategy GPU tests, and the recipe with --fp8.
# Every part has its own time limit and log; a short table is printed last. Results go to $OUT (or out/te_session).
set -u
OUT=${OUT:-out/te_session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
LOG="$OUT/session.log"
: > "$LOG"
declare -a ROWS
part() {  # part NAME SECONDS CMD...
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    echo "===== $name: $*" >> "$LOG"
    timeout "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    ROWS+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(grep -E '[0-9]+ (passed|failed)' "$LOG" | tail -1 | cut -c1-70)")")
    return $rc
}
part te_install 230 bash .te/final/install_on_host.sh || { tail -30 "$LOG"; exit 1; }
python3 -c "import torch, lightning, transformer_engine as te; print('versions: torch', torch.__version__, 'lightning', lightning.__version__, 'TE', te.__version__, torch.cuda.get_device_name())" >> "$LOG" 2>&1
part fp8_tests 130 env FP8_EVIDENCE_JSON="$OUT/fp8_refresh.json" python3 -m pytest tests/gpu/test_fp8_te.py -q -s -rs -p no:cacheprovider
part pp_bench 80 python3 benchmarks/pp_alignment.py --out "$OUT/pp_alignment.json"
part pp_tests 60 python3 -m pytest tests/gpu/test_pipeline_te.py -q -s -rs -p no:cacheprovider
part step_small 60 python3 benchmarks/step_time.py --presets small --compile-presets --out "$OUT/bench"
part capture_tests 60 python3 -m pytest tests/gpu/test_capture_gpu.py tests/gpu/test_strategy_gpu.py -q -p no:cacheprovider -x
part recipe_fp8 45 python3 -m recipes.gpt_pretrain --preset tiny --fp8 --compare --steps 120 --log-every 0 --out "$OUT/recipe_fp8"
grep -E "^(versions|FP8|PP|STALE|GPT|OVERHEAD|REFRESH|lazy|aligned)|first/median|ms/step|Targets|MET|MISSED|^mode|^eager|^graphed|loss parity" "$LOG" | cut -c1-200 | tail -40
printf '%s\n' "${ROWS[@]}"
