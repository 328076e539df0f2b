# The two commands the README gives: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: install model demo test lint clean system-deps

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]" "$(TORCH_SPEC)"
	touch $@

install: $(VENV)/.installed

# Debian packages the tests use (chromium for the report's browser test, bubblewrap for the code sandbox)
system-deps:
	@sh scripts/install-system-deps.sh

model: install
	$(BIN)/infer-tune models pull smollm2-135m

# The main job: baseline, every quantization method and the KV-cache variants on SmolLM2-135M,
# each measured against its baseline in the same session, then one combined leaderboard.
DEMO_OUT ?= runs/demo
DEMO_WORKLOAD ?= --suite chat --limit 4 --max-new-tokens 32
demo: model
	$(BIN)/infer-tune bench $(DEMO_WORKLOAD) --out $(DEMO_OUT)
	$(BIN)/infer-tune quantize --sweep bf16,int8-dynamic,int8-static,int4-weight,int4-rtn $(DEMO_WORKLOAD) --out $(DEMO_OUT)
	$(BIN)/infer-tune kv-cache --impl none,dynamic,static,quantized,offloaded --context-lengths 128,512 \
		--max-new-tokens 32 --min-iterations 1 --out $(DEMO_OUT)
	$(BIN)/infer-tune leaderboard $(DEMO_OUT)
	@echo "leaderboard: $(DEMO_OUT)/leaderboard.md (.csv, .html); results: $(DEMO_OUT)/<run-id>/result.json"

test: model system-deps
	$(BIN)/python -m pytest -q -ra

lint: install
	$(BIN)/ruff check infer_tune tests bench

clean:
	rm -rf $(VENV) runs
