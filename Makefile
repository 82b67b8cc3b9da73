# The two commands a newcomer needs (see README):
#   make demo   - set up .venv and run the main job on the embedded example
#   make test   - set up .venv and run the whole test suite against the real Envoy and nginx
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench bench-quick clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/confgen demo

test: $(STAMP)
	$(BIN)/ruff check confgen sidecar tests bench
	$(BIN)/mypy
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python -m bench run --out bench/results

bench-quick: $(STAMP)
	$(BIN)/python -m bench run --quick --out bench/results-quick

clean:
	rm -rf $(VENV) out build dist
