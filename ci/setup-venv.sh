#!/usr/bin/env bash
# Create a virtual environment and install this package into it, with the torch build that fits the machine.
#
#   bash ci/setup-venv.sh                      .venv with the package and its plot extra (README's first command)
#   bash ci/setup-venv.sh .venv test,plot      the CI unit stage's environment (ci/stages.sh calls this)
#
# torch, before the package (so that `pip install -e .` finds it and keeps it; the package needs torch>=2.4):
#   - a torch the venv already has is kept, whatever its build;
#   - else on a machine with an NVIDIA GPU (`nvidia-smi -L` lists one): $TORCH_SPEC as pip finds it (on PyPI
#     that is a CUDA build);
#   - else (no GPU) the CPU build: pip is first asked what it would install (--dry-run, nothing downloaded). If
#     that is a CUDA build (it pulls nvidia-* packages, about 3 GB: what PyPI serves for Linux x86-64), the torch
#     install goes to PyPI's neighbour for CPU builds, PyTorch's CPU wheel index ($TORCH_CPU_INDEX_URL), asked
#     the same way first; if that too would be a CUDA build, or cannot be reached, the script stops and says so.
#
# Environment: PYTHON (interpreter that creates the venv; default python3), TORCH_SPEC (default torch==2.13.0),
# TORCH_INDEX_URL (package index for the torch install only; no fallback then), TORCH_CPU_INDEX_URL (the
# fallback index for the CPU build), CPU_TORCH=1 (install the CPU build even where a GPU is visible).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="${1:-.venv}"
EXTRAS="${2:-plot}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

say() { printf '[ci/setup-venv.sh] %s\n' "$*"; }

# The installs print what pip collects and installs (one line a package, no progress bars), so a long download
# shows what it is doing; only the dry runs that pick the torch build are quiet.
pip_install() { "$PY" -m pip install --progress-bar off "$@"; }

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# The torch install's own pip arguments (only the index, when one is given).
torch_pip_args=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    torch_pip_args=(--index-url "$TORCH_INDEX_URL")
fi

has_gpu() {
    [ "${CPU_TORCH:-0}" != 1 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

if installed="$("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda or "none")' 2>/dev/null)"; then
    say "keeping the torch already in $VENV: $installed"
elif has_gpu; then
    say "NVIDIA GPU found: installing $TORCH_SPEC as pip finds it (a CUDA build on PyPI: about 3 GB, minutes)"
    pip_install "${torch_pip_args[@]}" "$TORCH_SPEC"
else
    say "no NVIDIA GPU: installing the CPU build of $TORCH_SPEC"
    report="$(mktemp)"
    trap 'rm -f "$report"' EXIT
    # cuda_parts ARGS...: the nvidia-* packages pip would install for torch with ARGS (nothing is downloaded but
    # metadata); a CUDA build pulls ~3 GB of them that a CPU-only machine cannot use.
    cuda_parts() {
        "$PY" -m pip install --quiet --dry-run --ignore-installed --report "$report" "$@" "$TORCH_SPEC" || return 1
        "$PY" - "$report" <<'PY'
import json, sys
names = [i["metadata"]["name"] for i in json.load(open(sys.argv[1])).get("install", [])]
print(" ".join(n for n in names if n.lower().startswith("nvidia-")))
PY
    }
    say "asking pip which build of $TORCH_SPEC it would install (metadata only, nothing downloaded)"
    pulls="$(cuda_parts "${torch_pip_args[@]}")"
    if [ -n "$pulls" ] && [ -z "${TORCH_INDEX_URL:-}" ]; then
        cpu_index="${TORCH_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
        say "pip's index serves a CUDA build of $TORCH_SPEC here (it pulls: $pulls); asking the CPU wheel index $cpu_index"
        torch_pip_args=(--index-url "$cpu_index")
        pulls="$(cuda_parts "${torch_pip_args[@]}" || echo "(the index could not be read)")"
    fi
    if [ -n "$pulls" ]; then
        say "STOP: no CPU build of $TORCH_SPEC found (${torch_pip_args[*]:-default index}: $pulls), and this machine" \
            "has no NVIDIA GPU, so nothing was downloaded. Name an index that has one and run again:" \
            "TORCH_INDEX_URL=<index> bash ci/setup-venv.sh" >&2
        exit 1
    fi
    say "downloading and installing the CPU build of $TORCH_SPEC (about 200 MB; a minute or two)"
    pip_install "${torch_pip_args[@]}" "$TORCH_SPEC"
fi

say "installing the package and its dependencies: pip install -e .[$EXTRAS] (keeps that torch; about a minute)"
pip_install -e ".[$EXTRAS]"
"$PY" -c 'import torch; print("[ci/setup-venv.sh] ready:", torch.__version__, "| CUDA build:", torch.version.cuda or "no (CPU)", "| GPU visible:", torch.cuda.is_available())'
