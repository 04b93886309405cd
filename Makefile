# The two commands the README opens with: `make serve` and `make test`.
# Each creates .venv with the first Python >= 3.11 it finds (python3.11, 3.12, 3.13, then python3),
# or the one you name: `make test PYTHON=python3.13`.
PYTHON ?= $(shell for p in python3.11 python3.12 python3.13 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
	&& echo $$p && break; done)
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: serve test typecheck unit bench clean python system-tools

python:
	@test -n "$(PYTHON)" || { echo "make: no Python >= 3.11 found; install one, or name it: make test PYTHON=/path/to/python3.11" >&2; exit 1; }

# Serving needs only the package; the tests need their tools too (pytest, hypothesis, mypy, ...).
$(VENV)/.installed-serve: pyproject.toml | python
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | python
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,spark]'
	touch $@ $(VENV)/.installed-serve

serve: $(VENV)/.installed-serve
	$(BIN)/flowbroker serve $(ARGS)

# System tools the tests use: tshark (decodes our Aeron frames in tests/transport/test_tshark.py),
# ip (iproute2), chromium (the web console's browser test, tests/console/, drives it with Playwright),
# promtool and prometheus (tests/deploy: the alert rules and a real Prometheus scraping a real broker),
# systemd-analyze (tests/deploy: the unit file), java (a local Spark for the data source's tests,
# tests/spark/). Installed with apt when run as root, otherwise named, and the run stops at once.
SYSTEM_TOOLS := tshark:tshark ip:iproute2 chromium:chromium promtool:prometheus systemd-analyze:systemd \
	java:openjdk-17-jre-headless
system-tools:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $${t%%:*} >/dev/null 2>&1 || missing="$$missing $${t#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing system tools the tests need:$$missing"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "make test needs these Debian packages:$$missing (run as root to let make install them, or: sudo apt-get install$$missing)" >&2; \
	    exit 1; \
	  fi; \
	fi

# mypy cannot follow setuptools' editable finder for the package-dir mapping, so it checks a
# symlinked view of the flowbroker namespace, by package name. tests/ is a package (tests.broker...,
# strict but for unannotated test functions: pyproject.toml); benchmarks/ are scripts that import
# their neighbours by module name (`from procs import ...`), so that folder is on the path too.
PACKAGES := broker client policies protocol spark transport
typecheck: $(VENV)/.installed-test
	@mkdir -p build/typecheck/flowbroker
	@for p in $(PACKAGES); do ln -sfn ../../../$$p build/typecheck/flowbroker/$$p; done
	MYPYPATH=build/typecheck $(BIN)/mypy $(addprefix -p flowbroker.,$(PACKAGES))
	MYPYPATH=build/typecheck:benchmarks $(BIN)/mypy tests benchmarks

unit: $(VENV)/.installed-test system-tools
	$(BIN)/pytest

## The whole suite: type check, then every test.
test: system-tools typecheck unit

bench: $(VENV)/.installed-test
	$(BIN)/python benchmarks/broker_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache
