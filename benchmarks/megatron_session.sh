#!/usr/bin/env bash
# The Megatron-core test bed's arms in one run (megatron-core 0.16.1 + TransformerEngine 2.20.2 on one GPU). What it
# runs that the harness cannot: megatron-core's own graphs (benchmarks/megatron_bed.py).
#
#   OUT=/some/dir bash benchmarks/megatron_session.sh                   (carry .te/final and .whl)
#   OUT=/some/dir ARMS=bf16layer bash benchmarks/megatron_session.sh    (the per-layer set, below)
#   OUT=/some/dir ARMS=layerdiag bash benchmarks/megatron_session.sh    (why per-layer graphs differ, below)
#   OUT=/some/dir ARMS=1b RUN_BUDGET=540 bash benchmarks/megatron_session.sh   (the 1 B shape, below)
#
# Installs TE (.te/final/install_on_host.sh, slices already in /tmp/te) unless it imports, then the carried
# megatron-core wheel (.whl/), then runs the arms of benchmarks/megatron_bed.py, each in its own process with its
# own time limit (one failing or hanging arm does not stop the others), then the GPU test on the arms' records,
# then the report. Deadlines shorten or skip the last parts: RUN_BUDGET seconds after the installs (default 360)
# and TOTAL_BUDGET seconds from the start (default 530); the arms leave KEEP seconds (default 40) for the GPU test.
# Everything goes under $OUT (4 files): session.log, megatron_record.md, megatron_record.json, parts.tgz (each
# arm's JSON record). The short table is printed last.
#
# Arm sets (ARMS=):
#   default    FP8 primary weights: eager x2, per-layer, whole-iteration, the FP8 forced-sync gap, seed 000.
#   bf16layer  Without FP8 primary weights, where megatron-core's per-layer graphs can run (with FP8 primary
#              weights the first replay fails at megatron/core/transformer/cuda_graphs.py:587, copying a
#              Float8Tensor parameter onto itself; bf16 parameters make that copy a no-op). Two configs, each
#              with its own eager reference, second eager run (noise floor), per-layer, whole-iteration and seed
#              000 (--break-grad-added, then --guard-fused-wgrad): np_* = FP8 hybrid compute with bf16 primary
#              weights (--no-fp8-params), bf_* = bf16 (--fp8 none). np_* goes first; if its per-layer arm fails or
#              captures nothing, the bf_* set runs before the rest of np_*.
#   layerdiag  Why megatron-core 0.16.1's per-layer graphs are not bitwise with eager (first at step 1's gradients):
#              per config (dg_bf_* = bf16, dg_np_* = FP8 hybrid compute, bf16 weights) eager, per-layer graphs, and
#              per-layer graphs with --keep-graph-inputs (the layer graphs' forward input buffers kept out of
#              megatron-core's reuse pool, as core_v0.18.0 does), each with per-parameter main_grad fingerprints at
#              steps 0-2; then a second bf16 eager arm (the fingerprints' eager-vs-eager check).
#   1b         The 1 B shape (--shape 1b: 16 layers, hidden 2048, sequence 2048, 4 microbatches of 1) with FP8 primary
#              weights: eager, the whole-iteration graph, a second eager arm (noise floor), then per-layer graphs
#              (megatron-core 0.16.1 fails their first replay with FP8 primary weights; the record keeps why).
set -u
START=$SECONDS
RUN_START=$SECONDS
RUN_BUDGET=${RUN_BUDGET:-360}
TOTAL_BUDGET=${TOTAL_BUDGET:-530}
KEEP=0
ARMS=${ARMS:-default}
OUT=${OUT:-out/megatron_session}
mkdir -p "$OUT/parts"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 NVTE_ALLOW_NONDETERMINISTIC_ALGO=0
export TORCH_NCCL_ASYNC_ERROR_HANDLING=0 NCCL_GRAPH_REGISTER=0
LOG="$OUT/session.log"
: > "$LOG"
declare -a ROWS ORDER
say() { echo "[megatron_session $((SECONDS - START))s] $*" | tee -a "$LOG"; }

# part NAME LIMIT CMD...: run with min(LIMIT, time left - KEEP - 20 s); skipped when under 20 s are left.
part() {
    local name=$1 limit=$2 left left_total t0=$SECONDS rc
    shift 2
    ORDER+=("$name")
    left=$((RUN_BUDGET - (SECONDS - RUN_START) - KEEP - 20))
    left_total=$((TOTAL_BUDGET - (SECONDS - START) - KEEP - 20))
    [ "$left_total" -lt "$left" ] && left=$left_total
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        ROWS+=("$(printf '%-18s SKIPPED (budget)' "$name")")
        say "skip $name: ${left}s left"
        return 0
    fi
    echo "===== $name (limit ${limit}s): $*" >> "$LOG"
    BED_HANG_DUMP=$((limit - 8)) timeout -k 5 "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    ROWS+=("$(printf '%-18s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
    return 0
}

case "$ARMS" in
    default | bf16layer | layerdiag | 1b) ;;
    *) echo "ARMS=$ARMS: use ARMS=default, ARMS=bf16layer, ARMS=layerdiag or ARMS=1b" >&2; exit 2 ;;
esac
say "arm set: $ARMS"

# --- installs ------------------------------------------------------------------------------------------------
if python3 -c "import transformer_engine.pytorch" > /dev/null 2>&1; then
    say "TransformerEngine already imports: install skipped"
else
    part te_install 240 bash .te/final/install_on_host.sh
fi
whl=$(ls .whl/megatron_core-0.16.1-*.whl 2> /dev/null | head -1)
if python3 -c "import megatron.core, sys; sys.exit(0 if megatron.core.__version__ == '0.16.1' else 1)" > /dev/null 2>&1; then
    say "megatron-core 0.16.1 already installed"
elif [ -n "$whl" ]; then
    part mcore_install 60 python3 -m pip install -q --no-index --no-deps "$whl"
else
    say "no .whl/megatron_core-0.16.1-*.whl carried: the arms will fail to import megatron.core"
fi
python3 - >> "$LOG" 2>&1 <<'PY'
import torch
print("versions: torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")
for m in ("transformer_engine", "megatron.core"):
    try:
        mod = __import__(m, fromlist=["__version__"]); print("versions:", m, mod.__version__)
    except Exception as e:
        print("versions:", m, "FAILED", type(e).__name__, e)
PY
say "installs done"
RUN_START=$SECONDS

# --- the arms (priority order) -------------------------------------------------------------------------------
BED="python3 -X faulthandler benchmarks/megatron_bed.py"
P="$OUT/parts"
KEEP=40  # for the GPU test on the records
# layer_ok TAG: the arm wrote a record without error in which megatron-core captured per-layer graphs.
layer_ok() {
    python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); g = r.get("graphs") or {}
sys.exit(0 if r.get("error") is None and (g.get("layer_fwd_graphs") or 0) > 0 else 1)' "$P/$1.json" 2>> "$LOG"
}

default_arms() {
    MAIN="--steps 120 --verify-every 10 --param-gather-refresh"
    part eager_a 75 $BED --mode eager $MAIN --tag eager_a --out "$P/eager_a.json"
    part layer 90 $BED --mode layer $MAIN --tag layer --out "$P/layer.json"
    part full 90 $BED --mode full $MAIN --tag full --out "$P/full.json"
    part eager_b 75 $BED --mode eager $MAIN --tag eager_b --out "$P/eager_b.json"
    # FP8: a forced param sync every 10 steps (NeMo's save_checkpoint), without / with the completion-path refresh.
    FP8="--steps 60 --verify-every 0 --force-sync-every 10"
    part fp8_forced 60 $BED --mode eager $FP8 --tag fp8_forced --out "$P/fp8_forced.json"
    part fp8_forced_fixed 60 $BED --mode eager $FP8 --param-gather-refresh --tag fp8_forced_fixed --out "$P/fp8_forced_fixed.json"
    # Seed 000 (Megatron-LM #1279): per-layer graphs with megatron-core's grad_added_to_main_grad restore removed,
    # without and with the flag's decision.
    SEED="--mode layer --steps 40 --verify-every 0 --break-grad-added"
    part seed000_break 60 $BED $SEED --tag seed000_break --out "$P/seed000_break.json"
    part seed000_guard 60 $BED $SEED --guard-fused-wgrad --tag seed000_guard --out "$P/seed000_guard.json"
    # The old approach (force the all-gather + refresh after every step), for its ms/step; and the whole-iteration
    # graph with the all-gather left in the optimizer step (outside the graph), in case the overlapped one fails.
    part align_each_step 60 $BED --mode eager --steps 60 --verify-every 10 --align-every-step --tag align_each_step --out "$P/align_each_step.json"
    part full_sync_ag 70 $BED --mode full --steps 120 --verify-every 10 --no-overlap-param-gather --tag full_sync_ag --out "$P/full_sync_ag.json"
}

# ARMS=bf16layer: 120 steps everywhere (the data depend on the run length: one group per config), no FP8 checks
# (no FP8 primary weights), the default fused wgrad accumulation with NaN-poisoned placeholders (seed 000 detector).
NP="--fp8 hybrid --no-fp8-params --steps 120 --verify-every 0"
BF="--fp8 none --steps 120 --verify-every 0"
np_head() {
    part np_eager_a 60 $BED --mode eager $NP --tag np_eager_a --out "$P/np_eager_a.json"
    part np_layer 75 $BED --mode layer $NP --tag np_layer --out "$P/np_layer.json"
}
np_rest() {
    part np_eager_b 60 $BED --mode eager $NP --tag np_eager_b --out "$P/np_eager_b.json"
    part np_full 75 $BED --mode full $NP --tag np_full --out "$P/np_full.json"
    part np_seed000_break 60 $BED --mode layer $NP --break-grad-added --tag np_seed000_break --out "$P/np_seed000_break.json"
    part np_seed000_guard 60 $BED --mode layer $NP --break-grad-added --guard-fused-wgrad --tag np_seed000_guard --out "$P/np_seed000_guard.json"
}
bf_arms() {
    part bf_eager_a 60 $BED --mode eager $BF --tag bf_eager_a --out "$P/bf_eager_a.json"
    part bf_layer 75 $BED --mode layer $BF --tag bf_layer --out "$P/bf_layer.json"
    part bf_eager_b 60 $BED --mode eager $BF --tag bf_eager_b --out "$P/bf_eager_b.json"
    part bf_full 75 $BED --mode full $BF --tag bf_full --out "$P/bf_full.json"
    part bf_seed000_break 60 $BED --mode layer $BF --break-grad-added --tag bf_seed000_break --out "$P/bf_seed000_break.json"
    part bf_seed000_guard 60 $BED --mode layer $BF --break-grad-added --guard-fused-wgrad --tag bf_seed000_guard --out "$P/bf_seed000_guard.json"
}

# ARMS=layerdiag: same data and configs as bf16layer; fingerprints are taken outside the timed steps.
DG="--steps 120 --verify-every 0 --grad-fingerprints 3"
layerdiag_arms() {
    part dg_bf_eager 60 $BED --mode eager --fp8 none $DG --tag dg_bf_eager --out "$P/dg_bf_eager.json"
    part dg_bf_layer 75 $BED --mode layer --fp8 none $DG --tag dg_bf_layer --out "$P/dg_bf_layer.json"
    part dg_bf_keep 75 $BED --mode layer --fp8 none $DG --keep-graph-inputs --tag dg_bf_keep --out "$P/dg_bf_keep.json"
    part dg_np_eager 60 $BED --mode eager --fp8 hybrid --no-fp8-params $DG --tag dg_np_eager --out "$P/dg_np_eager.json"
    part dg_np_layer 75 $BED --mode layer --fp8 hybrid --no-fp8-params $DG --tag dg_np_layer --out "$P/dg_np_layer.json"
    part dg_np_keep 75 $BED --mode layer --fp8 hybrid --no-fp8-params $DG --keep-graph-inputs --tag dg_np_keep --out "$P/dg_np_keep.json"
    part dg_bf_eager_b 60 $BED --mode eager --fp8 none $DG --tag dg_bf_eager_b --out "$P/dg_bf_eager_b.json"
}

# ARMS=1b: 60 steps of the 1 B shape, FP8 transposes checked every 20 steps (outside the timed steps).
BIG="--shape 1b --verify-every 20 --param-gather-refresh"
big_arms() {
    part b1_eager_a 150 $BED --mode eager $BIG --tag b1_eager_a --out "$P/b1_eager_a.json"
    part b1_full 150 $BED --mode full $BIG --tag b1_full --out "$P/b1_full.json"
    part b1_eager_b 150 $BED --mode eager $BIG --tag b1_eager_b --out "$P/b1_eager_b.json"
    part b1_layer 120 $BED --mode layer $BIG --tag b1_layer --out "$P/b1_layer.json"
}

if [ "$ARMS" = default ]; then
    default_arms
elif [ "$ARMS" = 1b ]; then
    big_arms
elif [ "$ARMS" = layerdiag ]; then
    layerdiag_arms
else
    np_head
    if layer_ok np_layer; then
        say "np_layer captured per-layer graphs: the rest of np_*, then bf_*"
        np_rest
        bf_arms
    else
        say "np_layer failed or captured nothing: bf_* first, then the rest of np_*"
        bf_arms
        np_rest
    fi
fi
KEEP=0

# --- the GPU test on these records, and the report -------------------------------------------------------------
part gpu_test 60 env MEGATRON_BED_RECORDS="$P" python3 -m pytest tests/gpu/test_megatron_gpu.py -q -rs -p no:cacheprovider
# Every record this run wrote, in the order the arms ran (each is compared within its configuration group).
python3 benchmarks/megatron_bed.py report $(for a in "${ORDER[@]}"; do [ -f "$P/$a.json" ] && echo "$P/$a.json"; done) \
    --md "$OUT/megatron_record.md" --json "$OUT/megatron_record.json" > "$OUT/table.txt" 2>> "$LOG"
tar czf "$OUT/parts.tgz" -C "$OUT" parts && rm -rf "$P"
cat "$OUT/table.txt" >> "$LOG"
echo "----- tail of the log -----"
grep -E "^(versions|BED |[0-9]+ (passed|failed)|FAILED|ERROR|E  )|passed|failed" "$LOG" | cut -c1-220 | tail -25
printf '%s\n' "${ROWS[@]}"
cat "$OUT/table.txt"
rm -f "$OUT/table.txt"
