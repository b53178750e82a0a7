# The README's two commands are `make demo` and `make test`; both set up .venv first.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
export OMP_NUM_THREADS ?= 1
export NIXL_LOG_LEVEL ?= WARN

.PHONY: setup demo test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh
	touch $(STAMP)

demo: setup
	$(BIN)/python -m scripts.demo

test: setup
	@$(BIN)/python -m scripts.env_report
	$(BIN)/python -m pytest -q -rs tests

test-fast: setup
	$(BIN)/python -m pytest -q tests/unit

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: setup
	@$(BIN)/python -m scripts.env_report
	$(BIN)/python -m scripts.bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
