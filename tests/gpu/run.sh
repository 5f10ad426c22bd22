#!/usr/bin/env bash
# The GPU checks (tests/gpu/check.py, docs/guide/gpus.md): one NVIDIA GPU, at most 8 minutes, one
# JSON line per probe. Any Python with torch will do: PYTHON, else .venv/bin/python when there,
# else python3; the repository goes on PYTHONPATH, so unbroken need not be installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo '{"probe": "cuda", "ok": null, "error": "no CUDA GPU here (torch.cuda.is_available() is False)"}'
    exit 2
fi
exec timeout 480 "$PYTHON" tests/gpu/check.py "$@"
