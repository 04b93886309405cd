# The two commands the README opens with: `make serve` and `make test`.
# Each creates .venv with the machine's python3.11 and installs what it needs.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: serve test typecheck unit bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/flowbroker serve

# mypy cannot follow setuptools' editable finder for the package-dir mapping, so it checks a
# symlinked view of the flowbroker namespace, by package name.
PACKAGES := broker client policies protocol transport
typecheck: $(STAMP)
	@mkdir -p build/typecheck/flowbroker
	@for p in $(PACKAGES); do ln -sfn ../../../$$p build/typecheck/flowbroker/$$p; done
	MYPYPATH=build/typecheck $(BIN)/mypy $(addprefix -p flowbroker.,$(PACKAGES))

unit: $(STAMP)
	$(BIN)/pytest

## The whole suite: type check, then every test.
test: typecheck unit

bench: $(STAMP)
	$(BIN)/python benchmarks/broker_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache
