# The two commands of the README, each doing its own set-up in a local virtualenv.
#   make serve  serve the default pipeline (graphs/omni_chat.omni) on tiny built-in models
#               over an OpenAI-compatible HTTP API at http://127.0.0.1:$(PORT)/v1
#   make demo   one chat request through the same pipeline, its text and audio written to out/
#   make plan   compile the default pipeline for 2 H200s and print its plan
#   make test   run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEVICES ?= 2xH200
PORT ?= 8091

.PHONY: serve demo plan test lint setup

setup: $(VENV)/.ready

# scripts/setup-venv.sh: torch pinned first, then the project; a line a step and a line a
# package fetched, with its size.
$(VENV)/.ready: pyproject.toml
	bash scripts/setup-venv.sh $(PYTHON) $(VENV)
	touch $@

serve: setup
	$(VENV)/bin/omniflow run graphs/omni_chat.omni --tiny --port $(PORT)

demo: setup
	$(VENV)/bin/omniflow run graphs/omni_chat.omni --once --tiny --input prompt="Hello! Who are you?" \
		--param max_tokens=24 --param max_audio_tokens=240 --out out

plan: setup
	$(VENV)/bin/omniflow compile graphs/omni_chat.omni --devices $(DEVICES)

# -P: the working directory (this repository) stays off the front of sys.path, where its
# top-level kernels/ would shadow PyPI's `kernels`, which transformers imports. Two workers,
# a test file each (a module's server or interpreted jobs stay in one): much of a test's
# time is its processes starting or waiting on each other, so two cores take ~14 minutes
# where one worker took ~19. The slowest tests are listed at the end, so a suite drifting
# toward its time limit shows where.
TEST_WORKERS ?= 2
test: setup
	$(PY) -P -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
