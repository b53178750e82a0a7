# The README's two commands are `make demo` and `make test`; both set up .venv first.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
export OMP_NUM_THREADS ?= 1
export NIXL_LOG_LEVEL ?= WARN
# vLLM 0.33.0's Python code (its CUDA wheel less the compiled files), for test-vllm033
VLLM033_DIR ?= $(VENV)/vllm-0.33

.PHONY: setup demo test test-vllm033 test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh
	touch $(STAMP)

demo: setup
	$(BIN)/python -m scripts.demo

# --durations: the slowest tests with their times, to keep the suite under an hour on the
# slowest CPU kind (AVX2 runs vLLM's CPU kernels about 2x slower than AVX-512)
test: setup
	@$(BIN)/python -m scripts.support.env_report
	EXPECT_VLLM=0.32.0 $(BIN)/python -m pytest -q -rs --durations=30 tests
	$(MAKE) --no-print-directory test-vllm033

# tests/unit again on vLLM 0.33.0's own Python code, on CPU (no model runs: 0.33 has no
# CPU kernels); the code is fetched once (scripts/fetch_vllm033.sh), a failed fetch fails.
test-vllm033: setup
	bash scripts/fetch_vllm033.sh $(VLLM033_DIR)
	VLLM_TARGET_DEVICE=cpu EXPECT_VLLM=0.33.0 PYTHONPATH=$(abspath $(VLLM033_DIR)):$(CURDIR) \
	  $(BIN)/python -m pytest -q -rs -p no:cacheprovider tests/unit

test-fast: setup
	$(BIN)/python -m pytest -q tests/unit

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: setup
	@$(BIN)/python -m scripts.support.env_report
	$(BIN)/python -m scripts.bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
