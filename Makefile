# Two entry points: `make book` and `make test`. Both set up .venv first (idempotent).
# For the learner, on the same set-up: `make grade CH=06` (or CH=6) grades chapter 06 on your
# copies in exercises/ (CH= empty: every chapter; SOLUTIONS=1: the reference copies instead),
# `make chapter CH=06` runs chapter 06's notebook from the shell, and `make lab` opens the
# notebooks in JupyterLab (installed into the venv on first use).
# An active virtual environment ($VIRTUAL_ENV) is used as it is; otherwise .venv is created.
# Where the system Python already has torch (a GPU box), .venv sees it and keeps it;
# elsewhere torch==2.13.0 (the CPU build) is installed.
SHELL := /bin/bash
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.minivllm-installed

.PHONY: setup book test exercises grade chapter lab gpu-check clean mutations

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
# CH=7 and CH=07 name the same chapter: its graded tests are exercises/test_ch07_*.py, its
# notebook notebooks/07_*.ipynb.
CHAPTER = $(if $(filter 1 2 3 4 5 6 7 8 9,$(CH)),0$(CH),$(CH))
GRADED = $(if $(CH),$(or $(wildcard exercises/test_ch$(CHAPTER)_*.py),$(error CH=$(CH): no graded tests exercises/test_ch$(CHAPTER)_*.py)),exercises)
NOTEBOOK = $(if $(CH),$(or $(wildcard notebooks/$(CHAPTER)_*.ipynb),$(error CH=$(CH): no notebook notebooks/$(CHAPTER)_*.ipynb)),$(error say which chapter: make chapter CH=07))
grade: setup
	$(PY) -m pytest $(GRADED) -q -p no:cacheprovider $(if $(SOLUTIONS),--solutions)

# Run one chapter's notebook top to bottom from the shell, as Jupyter would, into
# _build/chapters/ (the notebook in notebooks/ is left as it is). MINIVLLM_LEARNER=07 make
# chapter CH=07 runs it on your answers of chapters 01-07.
chapter: setup
	@mkdir -p _build/chapters
	cd notebooks && $(abspath $(PY)) -c 'import sys, nbclient, nbformat; \
	  nb = nbformat.read(sys.argv[1], as_version=4); \
	  nbclient.NotebookClient(nb, timeout=-1, kernel_name="python3", resources={"metadata": {"path": "."}}).execute(); \
	  nbformat.write(nb, sys.argv[2]); print("ran", sys.argv[1], "into", sys.argv[2])' \
	  $(notdir $(NOTEBOOK)) $(abspath _build/chapters/$(notdir $(NOTEBOOK)))

lab: setup
	@$(PY) -c 'import jupyterlab' 2>/dev/null || $(PY) -m pip install -q jupyterlab
	$(VENV)/bin/jupyter lab notebooks/

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf _build exercises/.pytest_cache

# Every plausible wrong answer of tests/course/mutations/ graded against its chapter's tests
# (the CI test grades one per region); CH=07 for one chapter.
mutations: setup
	$(PY) scripts/check_mutations.py $(CHAPTER)
