#!/usr/bin/env bash
# GPU host: the GPU test suite on this working tree (new.log names each test as it ends, so a run stopped by its
# time limit still tells what passed), and (with OLD=DIR) the same tests against an older copy of
# the package in DIR (a test written for a fix must fail there). Writes JUnit XML and logs
# under $OUT and prints one table last.
#
#   OUT=/tmp/out bash ci/gpu_tests.sh                          # tests/gpu on this tree
#   OLD=.old OLD_TESTS="$PWD/tests/gpu/test_stale_gpu.py" OUT=... bash ci/gpu_tests.sh   # test paths: absolute
#   TESTS="tests/gpu/test_stale_gpu.py tests/gpu/test_capture_gpu.py" OUT=... bash ci/gpu_tests.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/build/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 - <<'PY' | tee "$OUT/env.txt"
import torch, lightning, platform
print(f"python {platform.python_version()} torch {torch.__version__} lightning {lightning.__version__} "
      f"cuda {torch.version.cuda} gpu {torch.cuda.get_device_name() if torch.cuda.is_available() else None}")
PY
if [ -n "${OLD:-}" ]; then
    # The old package shadows this tree's: run from inside OLD (sys.path[0]) with the tests of this tree. pytest's
    # `pythonpath = ["."]` would put this checkout first again: emptied here, the checkout (recipes/) goes after OLD,
    # and NCG_PACKAGE_UNDER_TEST makes the session stop unless the old package is the one imported.
    OLD_ABS="$(cd "$OLD" && pwd)"
    (cd "$OLD" && NCG_PACKAGE_UNDER_TEST="$OLD_ABS" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
        timeout -k "${KILL_AFTER:-20}" "${OLD_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -o pythonpath= \
           ${OLD_TESTS:-$ROOT/tests/gpu/test_stale_gpu.py} -o junit_suite_name=old --junitxml="$OUT/old.xml" -rfE) \
        > "$OUT/old.log" 2>&1
    echo "old: exit $? ($(tail -n 1 "$OUT/old.log"))"
fi
# SIGKILL KILL_AFTER seconds after the SIGTERM: Lightning turns SIGTERM into an exception at the next batch end, pytest
# then goes on with the next test, and the limit would stop one test instead of the run.
timeout -k "${KILL_AFTER:-20}" "${NEW_TIMEOUT:-420}" python3 -m pytest -v -p no:cacheprovider ${TESTS:-tests/gpu} -rfEs \
    -o junit_suite_name=new --junitxml="$OUT/new.xml" > "$OUT/new.log" 2>&1
echo "new: exit $? ($(tail -n 1 "$OUT/new.log"))"
python3 - "$OUT" <<'PY'
import sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
def results(name):
    p = out / f"{name}.xml"
    if not p.exists():
        return {}
    r = {}
    for tc in ET.parse(p).iter("testcase"):
        key = tc.get("classname", "").split(".")[-1] + "::" + tc.get("name")
        kind = "pass"
        for child in tc:
            if child.tag in ("failure", "error"):
                kind = "FAIL"
            elif child.tag == "skipped":
                kind = "skip"
        r[key] = (kind, float(tc.get("time", 0)))
    return r
old, new = results("old"), results("new")
keys = sorted(set(old) | set(new), key=lambda k: (k not in old, k))
print(f"\n{'test':78s} {'old':>5s} {'new':>5s} {'s':>6s}")
for k in keys:
    o = old.get(k, ("-", 0))[0]
    n, t = new.get(k, ("-", 0))
    if o != "-" or n != "pass":
        print(f"{k[:78]:78s} {o:>5s} {n:>5s} {t:6.1f}")
tot = {s: sum(1 for v in new.values() if v[0] == s) for s in ("pass", "FAIL", "skip")}
print(f"new: {tot['pass']} passed, {tot['FAIL']} failed, {tot['skip']} skipped of {len(new)} "
      f"(tests passing in new and absent from old are not listed)")
PY
