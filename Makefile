# Two entry points: `make book` and `make test`. Both set up .venv first (idempotent).
# For the learner, on the same set-up: `make grade CH=06` grades chapter 06 on your copies
# in exercises/ (CH= empty: every chapter; SOLUTIONS=1: the reference copies instead), and
# `make lab` opens the notebooks in JupyterLab (installed into the venv on first use).
# An active virtual environment ($VIRTUAL_ENV) is used as it is; otherwise .venv is created.
# Where the system Python already has torch (a GPU box), .venv sees it and keeps it;
# elsewhere torch==2.13.0 (the CPU build) is installed.
SHELL := /bin/bash
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.minivllm-installed

.PHONY: setup book test exercises grade lab gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if [ ! -x $(PY) ]; then \
	  if python3 -c 'import torch' 2>/dev/null; then \
	    echo "system torch found: .venv will use it"; python3 -m venv --system-site-packages $(VENV); \
	  else python3 -m venv $(VENV); fi; \
	fi
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[book,test]"
	@touch $(STAMP)

book: setup
	$(PY) scripts/build_book.py

test: setup
	bash scripts/install_test_deps.sh
	$(PY) scripts/make_exercises.py --check
	$(PY) scripts/build_book.py
	# Two workers, one per core; a test file stays on one worker (its module fixtures: one
	# checkpoint, one server).
	$(PY) -m pytest -q -m "not gpu" -n 2 --dist loadfile tests
	# The notebooks under nbval, on the package and (through the learner switch) on the
	# reference copies in solutions/: two passes at once.
	bash scripts/test_notebooks.sh $(PY)

exercises: setup
	$(PY) scripts/make_exercises.py

CH ?=
SOLUTIONS ?=
grade: setup
	$(PY) -m pytest exercises -q -p no:cacheprovider $(if $(CH),-k ch$(CH)) $(if $(SOLUTIONS),--solutions)

lab: setup
	@$(PY) -c 'import jupyterlab' 2>/dev/null || $(PY) -m pip install -q jupyterlab
	$(VENV)/bin/jupyter lab notebooks/

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf _build exercises/.pytest_cache
