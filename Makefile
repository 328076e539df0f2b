# The two commands the README gives: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: install model demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]" "$(TORCH_SPEC)"
	touch $@

install: $(VENV)/.installed

model: install
	$(BIN)/infer-tune models pull smollm2-135m

# The main job: the baseline and the technique runs on SmolLM2-135M, then one leaderboard.
demo: model
	$(BIN)/infer-tune bench --model smollm2-135m --suite chat --limit 4 --max-new-tokens 32 --out runs/demo
	@echo "result: runs/demo/<run-id>/result.json"

test: model
	$(BIN)/python -m pytest -q -ra

lint: install
	$(BIN)/ruff check infer_tune tests bench

clean:
	rm -rf $(VENV) runs
