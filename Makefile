# Two commands matter: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# everything (make test); the service alone (make run): a venv with the first has the second
STAMP := $(VENV)/.installed
SERVICE_STAMP := $(VENV)/.installed-service

.PHONY: install install-service browser slurm ccache run test lint typecheck pytest bench clean

install: $(STAMP)

install-service: $(SERVICE_STAMP)

# a venv whose creation or whose installs were stopped part-way is made again (the script
# says why); INSTALLED ends a recipe's installs: the mark that they began goes, the stamps come
define VENV_READY
	scripts/venv-ready.sh $(VENV) $(PYTHON)
endef
define INSTALLED
	rm -f $(VENV)/.installing
	touch $(1)
endef

# `headroom serve` needs the package and its service extra only: no torch, no test tools
$(SERVICE_STAMP): pyproject.toml
	$(VENV_READY)
	if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then :; \
	else $(BIN)/python -m pip install --quiet -e ".[service]"; fi
	$(call INSTALLED,$(SERVICE_STAMP))

$(STAMP): pyproject.toml
	$(VENV_READY)
	# a venv made before the distribution's rename (headroom -> headroom-planner) drops the old name
	$(BIN)/python -m pip show headroom >/dev/null 2>&1 && $(BIN)/python -m pip uninstall -qy headroom || true
	rm -rf headroom.egg-info
	$(BIN)/python -m pip install --quiet "torch==2.13.0" numpy
	# dev pulls every extra (service, runtime, calibration, hf) and the test tools
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# DeepSpeed's own memory estimators, for the tests of framework deepspeed: its sdist
	# imports torch to build, so it builds against the torch above (an isolated build would
	# fetch the newest CUDA torch)
	$(BIN)/python -m pip install --quiet --no-build-isolation "deepspeed==0.19.8"
	# torchtitan's own model code, for the torchtitan activation profile, without the data,
	# logging and checkpoint packages it asks for (no trace imports them); triton because
	# importing its models imports it (only its asynchronous expert parallelism runs triton)
	# (tyro, which its config module imports, first: installed after torchtitan, its resolver
	# would report the packages --no-deps leaves out)
	$(BIN)/python -m pip install --quiet "tyro==1.0.17"
	$(BIN)/python -m pip install --quiet --no-deps "torchtitan==0.3.0" "triton==3.9.0" \
		"spmd_types==0.2.3"
	# Megatron-Core's own model code, for the megatron activation profile (its dependencies,
	# torch, numpy and packaging, are installed already; no Transformer Engine on a CPU)
	$(BIN)/python -m pip install --quiet --no-deps "megatron-core==0.16.1"
	# torchtune's model code (the torchtune activation profile) and chunked cross-entropy; its
	# modules import torchao (its NF4 tensor), so the torchao of torchtune 0.6.1's time; the
	# package's own __init__ imports its data stack, which calibration/torchtune.py skips
	$(BIN)/python -m pip install --quiet --no-deps "torchtune==0.6.1" "torchao==0.9.0"
	$(call INSTALLED,$(STAMP) $(SERVICE_STAMP))

run: install-service
	$(BIN)/headroom serve --host 127.0.0.1 --port 8000

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

browser:
	scripts/install-browser.sh

slurm:
	scripts/install-slurm.sh

ccache:
	scripts/install-ccache.sh

# three workers on two cores: the suite's tests wait on servers, Slurm daemons and stopped
# processes for about a fifth of their time, which a third worker fills (docs/PERFORMANCE.md:
# 10 min 15 s against 10 min 40 s for two, one commit); tests that share a thing of the
# machine stay on one worker (tests/scheduling.py); the few that assert a wall-clock bound
# (marked timing) run alone afterwards, on an otherwise idle machine
PYTEST_WORKERS ?= 3

pytest: install browser slurm ccache
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup -m "not timing"
	$(BIN)/python -m pytest -q -m timing

test: lint typecheck pytest

bench: install
	$(BIN)/python bench/estimate.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
