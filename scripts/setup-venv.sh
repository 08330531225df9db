#!/usr/bin/env bash
# The project's virtualenv, as `make setup` (and so `make serve`, `make test`) builds it:
#   scripts/setup-venv.sh [PYTHON] [VENV]      (defaults: python3, .venv)
#
#   1. The virtualenv, and pip upgraded in it.
#   2. torch==2.13.0 first, pinned: on CPU machines it is the CPU build, and the project's
#      own `torch>=2.1` then adds nothing.
#   3. The project, editable, with its dev and ray extras (transformers, diffusers, the
#      server's and the tests' packages): a first install fetches about 3 GB in all.
#
# A line a step, and under it a line a package fetched with its size (scripts/pip-steps.sh);
# the last line says what the environment holds.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip-steps.sh

PYTHON="${1:-python3}"
VENV="${2:-.venv}"
TORCH_VERSION="2.13.0"
say() { echo "setup: $*"; }
trap 'say "FAILED (line $LINENO)"' ERR

say "creating $VENV with $("$PYTHON" --version 2>&1)"
"$PYTHON" -m venv "$VENV"
say "upgrading pip"
pip_steps "$VENV/bin/python" --upgrade pip
say "installing torch==$TORCH_VERSION (the largest download: minutes on a first install)"
pip_steps "$VENV/bin/python" "torch==$TORCH_VERSION"
say "installing omniflow[dev,ray] from $(pwd) (editable) and its dependencies"
pip_steps "$VENV/bin/python" -e '.[dev,ray]'
say "ready: $VENV ($(du -sh "$VENV" | cut -f1)): $("$VENV/bin/python" -c '
import importlib.metadata as m
print(", ".join(f"{p} {m.version(p)}" for p in ("torch", "transformers", "diffusers")))')"
