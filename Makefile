# make setup : a venv in .venv with torch (CPU wheel here) and hybridengine built in place, every version from
#              constraints.txt (EXTRAS=dev,bench,trl adds the trl extra)
# make demo  : set up, then run the main job (the example GRPO trainer on a tiny model)
# make test  : set up, then run the test suite on the CPU in TEST_WORKERS pytest-xdist processes (default 2;
#              PYTEST_ARGS=... picks files or adds flags; CI runs it: .ci/run)
# make test-latest : the same tests in .venv-latest, where everything is the newest release allowed (no lock)
# make lint  : ruff over the tree (pyproject.toml's [tool.ruff]; CI runs it)
# make lock  : rewrite constraints.txt from a fresh venv resolved today (the newest allowed releases)
# make setup-verl : the verl integration's venv, .venv-verl: the dev and verl extras, every version from
#                   constraints-verl.txt (verl 0.9.1 needs transformers < 5.11, so it has its own venv and lock)
# make test-verl  : set up .venv-verl, then run the verl tests there (VERL_TESTS; verl's trainer over a local
#                   Ray, a few minutes on 2 cores; CI runs it after the other jobs)
# make lock-verl  : rewrite constraints-verl.txt from a fresh venv resolved today
# make test-gpu : set up, then build the CUDA extension and run the whole suite on this machine's GPUs
#                 (bin/test_gpu.sh); the lock holds the CPU wheel of torch, so on a GPU machine run it unlocked
#                 with a CUDA torch: `make test-gpu LOCK=`
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS ?= dev,bench
# The exact version of every package the set-up installs (pip's own aside), for Python 3.11; LOCK= installs
# the newest allowed releases instead.
LOCK ?= constraints.txt
# The torch the set-up asks for: the CPU wheel on this machine (pip prefers 2.13.0+cpu over PyPI's CUDA
# build of 2.13.0); the lock pins which.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.hybridengine-installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

LOCKED := $(if $(LOCK),-c $(LOCK))
comma := ,
# $(call step,WHAT,COMMAND): one line before and one after each install (with its time), so a set-up that
# takes minutes says where it is; pip's own lines show each package as it comes.
step = @echo "== $(1)"; t0=$$(date +%s); $(2) && echo "== $(1): done in $$(( $$(date +%s) - t0 )) s"

.PHONY: setup demo test test-latest lint lock test-gpu setup-verl test-verl lock-verl clean FORCE

setup: $(STAMP)

# The stamp holds the extras installed; asking for others installs again.
ifneq ($(shell cat $(STAMP) 2>/dev/null),$(EXTRAS))
$(STAMP): FORCE
endif

# torch first (the extension builds against it), then the package with --no-build-isolation.
$(STAMP): pyproject.toml setup.py $(wildcard csrc/*) $(LOCK)
	$(call step,venv $(VENV) ($(PYTHON): $(shell $(PYTHON) --version 2>&1)),$(PYTHON) -m venv $(VENV))
	$(call step,$(TORCH),$(BIN)/pip install $(LOCKED) $(TORCH))
	$(call step,build tools,$(BIN)/pip install $(LOCKED) setuptools wheel ninja)
	$(call step,hybridengine[$(EXTRAS)] and the C++ extension,\
	  MAX_JOBS=2 $(BIN)/pip install $(LOCKED) --no-build-isolation -e '.[$(EXTRAS)]')
	echo '$(EXTRAS)' > $@

demo: setup
	$(BIN)/hybridengine grpo --out grpo_out

TEST_WORKERS ?= 2
# With no file in PYTEST_ARGS pytest runs testpaths (tests/, pyproject.toml).
TEST_CMD = -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

test: setup
	$(BIN)/python $(TEST_CMD)

lint: setup
	$(BIN)/ruff check .

# The newest release of everything the set-up installs, torch aside: the newest CPU wheel of torch that pip
# finds (pip index versions torch; PyPI's Linux wheels are CUDA builds); LATEST_TORCH=torch==X picks another.
# The extension is rebuilt in place (hybridengine/_C*.so) against this venv's torch: where it is another torch
# than the lock's, `touch setup.py && make setup` rebuilds it for .venv afterwards.
LATEST_VENV ?= .venv-latest
LATEST_BIN := $(LATEST_VENV)/bin
LATEST_TORCH ?=
UPGRADE := --upgrade --upgrade-strategy eager -c $(LATEST_VENV)/torch.txt

test-latest:
	$(call step,venv $(LATEST_VENV),$(PYTHON) -m venv $(LATEST_VENV) && $(LATEST_BIN)/pip install -q --upgrade pip)
	@torch='$(LATEST_TORCH)'; \
	if [ -z "$$torch" ]; then \
	  torch=torch==$$($(LATEST_BIN)/pip index versions torch 2>/dev/null | sed -n 's/^Available versions: //p' \
	    | tr ',' '\n' | tr -d ' ' | grep -m1 '+cpu$$'); \
	  [ "$$torch" != torch== ] || { echo "test-latest: pip finds no CPU wheel of torch; set LATEST_TORCH"; exit 1; }; \
	fi; \
	echo "$$torch" > $(LATEST_VENV)/torch.txt; echo "== test-latest: $$torch"
	$(call step,torch and build tools,$(LATEST_BIN)/pip install $(UPGRADE) torch setuptools wheel ninja)
	$(call step,hybridengine[$(EXTRAS)] and the C++ extension,\
	  MAX_JOBS=2 $(LATEST_BIN)/pip install $(UPGRADE) --no-build-isolation -e '.[$(EXTRAS)]')
	@$(LATEST_BIN)/python -c "import hybridengine._C" || { echo "test-latest: hybridengine._C does not import"; exit 1; }
	$(LATEST_BIN)/pip list --format=freeze | grep -i -E '^(torch|triton|transformers|kernels|numpy|huggingface.hub|trl|pytest)=='
	$(LATEST_BIN)/python $(TEST_CMD)

# A fresh venv with the newest allowed releases (torch as TORCH), frozen: the base set-up, then the trl extra's
# additions resolved within it. Commit constraints.txt after `make test` and `make test-latest` pass on it.
LOCK_VENV ?= /tmp/hybridengine-lock-venv
LOCK_BIN := $(LOCK_VENV)/bin
FREEZE := $(LOCK_BIN)/pip freeze --all --exclude-editable | grep -v -E '^(pip|hybridengine)=='

lock:
	rm -rf $(LOCK_VENV)
	$(call step,venv $(LOCK_VENV),$(PYTHON) -m venv $(LOCK_VENV))
	$(call step,$(TORCH) and build tools,$(LOCK_BIN)/pip install $(TORCH) setuptools wheel ninja)
	$(call step,hybridengine[dev$(comma)bench],\
	  MAX_JOBS=2 $(LOCK_BIN)/pip install --no-build-isolation -e '.[dev$(comma)bench]')
	{ echo "# make lock, $$(date -u +%Y-%m-%d), $$($(LOCK_BIN)/python --version) on $$(uname -m): every package"; \
	  echo "# that make setup installs (pip install -c $(LOCK)), the package itself and pip aside."; \
	  $(FREEZE); } > $(LOCK).new
	$(call step,hybridengine[dev$(comma)bench$(comma)trl] within the base lock,\
	  MAX_JOBS=2 $(LOCK_BIN)/pip install -c $(LOCK).new --no-build-isolation -e '.[dev$(comma)bench$(comma)trl]')
	{ echo; echo "# The trl extra's additions (make setup EXTRAS=dev,bench,trl; .ci/run installs them)."; \
	  $(FREEZE) | grep -v -x -F -f $(LOCK).new; } >> $(LOCK).new
	mv $(LOCK).new $(LOCK)
	@echo "== $(LOCK): $$(grep -c '==' $(LOCK)) packages"

# The verl integration: the same set-up in its own venv with its own lock, then its tests in one process (the
# loop tests start a local Ray cluster each, one at a time).
VERL_VENV ?= .venv-verl
VERL_LOCK ?= constraints-verl.txt
VERL_TESTS ?= tests/test_verl_rollout.py tests/test_verl_engine.py tests/test_verl_loop.py

setup-verl:
	$(MAKE) setup VENV=$(VERL_VENV) LOCK=$(VERL_LOCK) EXTRAS=dev,verl

test-verl: setup-verl
	$(VERL_VENV)/bin/pip list --format=freeze | grep -i -E '^(torch|transformers|verl|ray|tensordict)=='
	HE_REQUIRE_VERL=1 $(VERL_VENV)/bin/python -m pytest -q $(VERL_TESTS) $(PYTEST_ARGS)

lock-verl:
	rm -rf $(LOCK_VENV)-verl
	$(call step,venv $(LOCK_VENV)-verl,$(PYTHON) -m venv $(LOCK_VENV)-verl)
	$(call step,$(TORCH) and build tools,$(LOCK_VENV)-verl/bin/pip install $(TORCH) setuptools wheel ninja)
	$(call step,hybridengine[dev$(comma)verl],\
	  MAX_JOBS=2 $(LOCK_VENV)-verl/bin/pip install --no-build-isolation -e '.[dev$(comma)verl]')
	{ echo "# The verl extra's lock (make setup-verl: $(VERL_VENV), EXTRAS=dev,verl), $$($(LOCK_VENV)-verl/bin/python --version)"; \
	  echo "# on $$(uname -m), make lock-verl $$(date -u +%Y-%m-%d): every package it installs, the package itself and pip aside."; \
	  $(LOCK_VENV)-verl/bin/pip freeze --all --exclude-editable | grep -v -E '^(pip|hybridengine)=='; } > $(VERL_LOCK)
	@echo "== $(VERL_LOCK): $$(grep -c '==' $(VERL_LOCK)) packages"

test-gpu: setup
	PYTHON=$(BIN)/python bash bin/test_gpu.sh $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(VERL_VENV) build *.egg-info hybridengine/_C*.so
