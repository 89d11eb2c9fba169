#!/usr/bin/env bash
# GPU smoke test (not in CI): Transformer Engine FP8 training, export, a real SGLang server,
# log-prob agreement and weight updates. Needs an NVIDIA GPU and `pip install -e '.[gpu]'`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
exec "$PYTHON" tools/gpu_smoke.py "$@"
