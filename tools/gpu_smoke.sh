#!/usr/bin/env bash
# GPU smoke test (not in CI): the actor on CUDA, Transformer Engine bf16 and FP8, a weight sync from a
# TE actor, a converted HF model loaded into a TE actor, a real SGLang server. Needs an NVIDIA GPU and
# the GPU install (docs/gpu.md).
#
#   bash tools/gpu_smoke.sh [--python PY] [--fp8 off|delayed|current] [--skip-sglang] [--workdir DIR]
#
# The Python is --python, else $PYTHON, else .venv-gpu/bin/python (`make install-gpu`), else python3
# (an NGC container's). Never the CPU venv .venv: it has no CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PY=$2; shift 2 ;;
    --python=*) PY=${1#--python=}; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if [[ -z "$PY" ]]; then
  if [[ -x .venv-gpu/bin/python ]]; then PY=.venv-gpu/bin/python; else PY=python3; fi
fi
echo "gpu_smoke: using $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
exec "$PY" tools/gpu_smoke.py "${ARGS[@]+"${ARGS[@]}"}"
