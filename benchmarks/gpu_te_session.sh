#!/usr/bin/env bash
# The TransformerEngine measurements and tests on a GPU host (TE installed by .te/final/install_on_host.sh when it
# does not import). What it runs that the harness cannot: TransformerEngine FP8 models and pipeline stages.
#   bash benchmarks/gpu_te_session.sh [PART ...]     (default: all parts but fp8_scale, in this order)
# Parts: te_install multi_transpose fp8_tests fp8_overhead pp_bench pp_tests step_small capture_tests recipe_fp8
#        fp8_scale (one recipe per call: FP8_SCALE_RECIPES=delayed|current|block, resumed from $OUT/fp8_scale until
#        complete; python -m benchmarks.fp8_scale --plan says what is left)
# Every part has its own time limit and log; a short table is printed last. Results go to $OUT (or
# out/te_session). te_install is skipped when TE already imports.
set -u
OUT=${OUT:-out/te_session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
LOG="$OUT/session.log"
touch "$LOG"
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
te_ok() { python3 -c "import transformer_engine.pytorch" > /dev/null 2>&1; }
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(te_install multi_transpose fp8_tests fp8_overhead pp_bench pp_tests step_small capture_tests recipe_fp8)
for p in "${parts[@]}"; do
    case $p in
    te_install)
        te_ok || part te_install 230 bash .te/final/install_on_host.sh || { tail -30 "$LOG"; exit 1; }
        python3 -c "import torch, lightning, transformer_engine as te; print('versions: torch', torch.__version__, 'lightning', lightning.__version__, 'TE', te.__version__, torch.cuda.get_device_name())" >> "$LOG" 2>&1 ;;
    multi_transpose)
        part multi_transpose_tests 90 python3 -m pytest tests/gpu/test_multi_transpose_gpu.py -q -rs -p no:cacheprovider
        part multi_transpose_bench 90 python3 -m benchmarks.fp8_multi_transpose --out "$OUT/multi_transpose.json" ;;
    fp8_tests) part fp8_tests 300 env FP8_EVIDENCE_JSON="$OUT/fp8_te.json" python3 -X faulthandler -m pytest tests/gpu/test_fp8_te.py -q -s -rs -p no:cacheprovider ;;
    fp8_overhead) part fp8_overhead 280 python3 -m benchmarks.fp8_lightning --parts overhead --presets small medium --rounds 2 --out "$OUT/fp8_overhead.json" ;;
    pp_bench) part pp_bench 80 python3 -m benchmarks.pp_alignment --out "$OUT/pp_alignment.json" ;;
    pp_tests) part pp_tests 60 python3 -m pytest tests/gpu/test_pipeline_te.py -q -s -rs -p no:cacheprovider ;;
    step_small) part step_small 120 python3 -m benchmarks.harness --workloads gpt-small --variants eager ours --rounds 1 --out "$OUT/bench" ;;
    capture_tests) part capture_tests 60 python3 -m pytest tests/gpu/test_capture_gpu.py tests/gpu/test_strategy_gpu.py -q -p no:cacheprovider -x ;;
    fp8_scale) part fp8_scale 570 python3 -m benchmarks.fp8_scale --recipes ${FP8_SCALE_RECIPES:-delayed} \
        --rounds "${FP8_SCALE_ROUNDS:-2}" --budget-s 520 --out "$OUT/fp8_scale" --resume "$OUT/fp8_scale/fp8-scale.json" ;;
    recipe_fp8) part recipe_fp8 45 python3 -m recipes.gpt_pretrain --preset tiny --fp8 --compare --steps 120 --log-every 0 --out "$OUT/recipe_fp8" ;;
    *) echo "unknown part $p" >&2; exit 2 ;;
    esac
done
grep -E "^(versions|FP8|PP|STALE|GPT|OVERHEAD|REFRESH|lazy|aligned|==|reference|eager|graphed|arm |preset|tiny|small|medium|   )|first/median|ms/step|Targets|MET|MISSED|loss parity" "$LOG" | cut -c1-260 | tail -45
printf '%s\n' "${ROWS[@]}"
