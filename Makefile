# The README's two commands are `make demo` and `make test`; both set up .venv first.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
export OMP_NUM_THREADS ?= 1
export NIXL_LOG_LEVEL ?= WARN
# vLLM 0.33.0's Python code (its CUDA wheel less the compiled files), for test-vllm033
VLLM033_DIR ?= $(VENV)/vllm-0.33
# pytest-xdist's workers: one a CPU, at most 4 (nproc obeys OMP_NUM_THREADS, exported above)
TEST_WORKERS ?= $(shell n=$$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc); echo $$(( n < 4 ? n : 4 )))

.PHONY: setup demo test test-vllm033 test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh
	touch $(STAMP)

demo: setup
	$(BIN)/python -m scripts.demo

# scripts/support/run_tests.sh: the parallel part on pytest-xdist's workers, the tests that
# must run alone, then test-vllm033; each part's wall time, the slowest tests (--durations)
# and the vLLM engines started, to keep .ci/run within 45 minutes on the slowest CPU kind
# (AVX2 runs vLLM's CPU kernels about 2x slower than AVX-512)
test: setup
	TEST_WORKERS=$(TEST_WORKERS) bash scripts/support/run_tests.sh

# tests/unit again on vLLM 0.33.0's own Python code, on CPU (no model runs: 0.33 has no
# CPU kernels); the code is fetched once (scripts/fetch_vllm033.sh), a failed fetch fails.
# Only the modules that reach vLLM's code run (tests/vllm_reach.py): the others prove
# nothing new on another vLLM.
test-vllm033: setup
	bash scripts/fetch_vllm033.sh $(VLLM033_DIR)
	VLLM_TARGET_DEVICE=cpu EXPECT_VLLM=0.33.0 VLLM_REACH_ONLY=1 PYTHONPATH=$(abspath $(VLLM033_DIR)):$(CURDIR) \
	  $(BIN)/python -m pytest -q -rs -p no:cacheprovider -n $(TEST_WORKERS) tests/unit

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
