# The two commands of the README. Each creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/tokenbus: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

.PHONY: run test
run: $(BIN)/tokenbus
	$(BIN)/tokenbus up

test: $(BIN)/tokenbus
	sh tests/install-chromium.sh
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=40
