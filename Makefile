# edgespec — the two commands: `make demo` and `make test`. Both start from nothing but Python.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.edgespec-installed

.PHONY: install models demo test test-fast lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The first install builds llama-cpp-python from source (about 10 minutes on 2 cores);
# pip's wheel cache makes later installs fast.
$(STAMP): pyproject.toml | $(BIN)/python
	@echo "installing edgespec[llama,dev] (first time: builds llama-cpp-python, ~10 min)"
	$(BIN)/python -m pip install --progress-bar off -e ".[llama,dev]"
	@touch $(STAMP)

install: $(STAMP)

models: install
	$(BIN)/edgespec models fetch

demo: models
	$(BIN)/edgespec demo

test: models
	$(BIN)/python -m pytest -q --durations=15

test-fast: install
	$(BIN)/python -m pytest -q -m "not real and not slow"

lint: install
	$(BIN)/ruff check edgespec tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
