# minivllm: the two commands are `make book` and `make test`. Everything else is a convenience.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BOOK_STAMP := $(VENV)/.installed-book
DEV_STAMP := $(VENV)/.installed-dev
DEST ?= student
STUDENT_FLAGS ?=
# Chapters and tests are CPU programs: keep torch's threads predictable.
export OMP_NUM_THREADS ?= 2
# ... and sleep when idle, with no spin (minivllm's own default adds a short one: src/minivllm/
# __init__.py): the tests run two workers on the cores, and spinning threads hold a core the other
# worker's thread with work waits for
export OMP_WAIT_POLICY ?= PASSIVE
# The benchmarks and the server run minivllm as it ships: its own thread policy, unless you export
# one
AS_SHIPPED := $(if $(filter file,$(origin OMP_WAIT_POLICY)),env -u OMP_WAIT_POLICY,)
export PYTHONHASHSEED := 0

.PHONY: book html test lint lab notebooks student bench serve check-notebooks clean help gpu-check

help:
	@echo "make book       install, execute every chapter into the build, build the HTML book"
	@echo "                (book/_build/html); the committed notebooks stay as they are"
	@echo "make html       the HTML book from the committed notebooks, without executing (< 1 min)"
	@echo "make test       install, ruff (lint + format check), unit + property tests, strict nbval,"
	@echo "                the student-mode check"
	@echo "make lint       ruff check and ruff format --check (what make test runs first)"
	@echo "make lab        JupyterLab on chapters/"
	@echo "make notebooks  sync chapters/*.py -> .ipynb and execute in place (updates the committed"
	@echo "                notebooks; CHAPTERS=chapters/04_engine.py for some)"
	@echo "make student DEST=dir [EXERCISES=ch03.1,ch05.2] [STUDENT_FLAGS=--force]"
	@echo "                a course copy with those exercises (default: all) stubbed, and its own"
	@echo "                HTML book without their solutions (DEST/book/_build/html)"
	@echo "make bench      run the benchmarks (tables + JSON in benchmarks/results/); vllm_peer.py only"
	@echo "                where vLLM's venv exists (VLLM_PEER_PYTHON=...), then the scoreboard"
	@echo "make serve      the OpenAI-compatible server on http://127.0.0.1:8000 (PORT=..., Ctrl-C to stop)"
	@echo "make gpu-check  on an NVIDIA GPU machine: CUDA tests, engine tests, chapters, GPU benchmarks"

$(VENV)/bin/python:
	@echo "== creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# pip -q is silent for minutes on a fresh machine: say so before it starts.
$(BOOK_STAMP): pyproject.toml | $(VENV)/bin/python
	@echo "== installing minivllm and the book's dependencies into $(VENV) (a few minutes the first time)"
	$(PY) -m pip install -q -e ".[book]"
	touch $@

$(DEV_STAMP): pyproject.toml | $(VENV)/bin/python
	@echo "== installing minivllm and the dev dependencies into $(VENV) (a few minutes the first time)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@ $(BOOK_STAMP)

# The chapters run into the build (book/chapters/), not over the committed notebooks.
book: $(BOOK_STAMP)
	$(PY) tools/build_book.py --execute

html: $(BOOK_STAMP)
	$(PY) tools/build_book.py

LINTED := src tests benchmarks tools chapters examples book/scoreboard.py

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

# Two workers, each given whole files (a notebook's cells run in order, in one kernel); the chapters
# go first, so the long notebooks start early and the short test files fill in behind them.
# TEST_WORKERS=0 runs everything in this one process.
TEST_WORKERS ?= 2

test: lint
	$(PY) -m pytest -p no:randomly -n $(TEST_WORKERS) --dist loadfile \
		chapters book/scoreboard.ipynb tests --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg --durations=10

lab: $(BOOK_STAMP)
	$(VENV)/bin/jupyter lab chapters

notebooks: $(BOOK_STAMP)
	$(PY) tools/notebooks.py execute $(CHAPTERS)

check-notebooks: $(BOOK_STAMP)
	$(PY) tools/notebooks.py check

student: $(BOOK_STAMP)
	$(PY) tools/student.py $(DEST) --book $(if $(EXERCISES),--exercises $(EXERCISES)) $(STUDENT_FLAGS)

# vLLM's own virtualenv for benchmarks/vllm_peer.py: VLLM_PEER_PYTHON (the script reads it too), or
# the script's DEFAULT_VLLM_PYTHON. Its docstring says how to build it.
VLLM_PEER_PYTHON ?= $(shell sed -n 's/^DEFAULT_VLLM_PYTHON = "\(.*\)"$$/\1/p' benchmarks/vllm_peer.py)
# the runs the scoreboard's vLLM rows read: one and two forward processes, one engine and two
# replicas (vLLM's as two LLMs of one process each), and vLLM eager
VLLM_PEER_ARGS ?= --processes 1 2 --data-parallel 1 2 --vllm-modes compiled eager compiled-dp2-1proc

# Every benchmark in alphabetical order, except that scoreboard.py goes last, after vllm_peer.py
# has written the results/vllm_peer.json it reads (vllm_peer.py only where vLLM's venv exists).
bench: $(DEV_STAMP)  # the dev extra brings transformers, for the Hugging Face rows of throughput.py
	@set -e; for script in benchmarks/[!_]*.py; do \
		case $$script in */scoreboard.py|*/vllm_peer.py) continue;; esac; \
		echo "== $$script"; $(AS_SHIPPED) $(PY) $$script; \
	done; \
	if [ -x "$(VLLM_PEER_PYTHON)" ]; then \
		echo "== benchmarks/vllm_peer.py"; \
		VLLM_PEER_PYTHON="$(VLLM_PEER_PYTHON)" $(AS_SHIPPED) $(PY) benchmarks/vllm_peer.py \
			$(VLLM_PEER_ARGS); \
	else \
		echo "== benchmarks/vllm_peer.py skipped: no vLLM virtualenv at $(VLLM_PEER_PYTHON) (set" \
			"VLLM_PEER_PYTHON, or build it as benchmarks/vllm_peer.py's docstring says);" \
			"the scoreboard keeps the recorded benchmarks/results/vllm_peer.json"; \
	fi; \
	echo "== benchmarks/scoreboard.py"; $(AS_SHIPPED) $(PY) benchmarks/scoreboard.py

PORT ?= 8000
serve: $(BOOK_STAMP)
	$(AS_SHIPPED) $(VENV)/bin/minivllm serve --model target --host 127.0.0.1 --port $(PORT)

clean:
	rm -rf book/_build book/chapters

# On a machine with an NVIDIA GPU: the kernel grid, the engine's tests, the chapters and the GPU
# benchmarks in one command, JSON in benchmarks/results/gpu_check.json (tools/gpu_check.py says how
# to bring the pinned wheels to a machine without network). The GPU machines' own python3.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py $(GPU_CHECK_FLAGS)
