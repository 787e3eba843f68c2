# make setup : a venv in .venv with torch (CPU wheel here) and hybridengine built in place
# make demo  : set up, then run the main job (the example GRPO trainer on a tiny model; ~1 min on CPU)
# make test  : set up, then run the test suite on the CPU in TEST_WORKERS pytest-xdist processes (default 2;
#              what CI runs: .ci/run)
# make test-gpu : set up, then build the CUDA extension and run the whole suite on this machine's GPUs
#                 (bin/test_gpu.sh: pytest-xdist workers, the 2-GPU NCCL checks where 2 GPUs exist)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hybridengine-installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup demo test test-gpu clean

setup: $(STAMP)

# torch first (the extension builds against it), then the package with --no-build-isolation.
$(STAMP): pyproject.toml setup.py $(wildcard csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q setuptools wheel ninja
	MAX_JOBS=2 $(BIN)/pip install -q --no-build-isolation -e '.[dev,bench]'
	touch $@

demo: setup
	$(BIN)/hybridengine grpo --out grpo_out

TEST_WORKERS ?= 2

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests $(PYTEST_ARGS)

test-gpu: setup
	PYTHON=$(BIN)/python bash bin/test_gpu.sh $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info hybridengine/_C*.so
