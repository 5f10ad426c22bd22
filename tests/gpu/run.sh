#!/usr/bin/env bash
# The GPU checks of issue 13 (see tests/gpu/check.py and docs/guide/gpus.md). Needs one NVIDIA
# GPU; a fifth check runs only with two. About 3-5 minutes; stops after 8.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "tests/gpu/run.sh: no CUDA GPU here (torch.cuda.is_available() is False)" >&2
    exit 2
fi
exec timeout 480 "$PYTHON" tests/gpu/check.py "$@"
