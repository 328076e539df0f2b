# The two commands the README gives: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: install model demo test lint clean system-deps openvino-exporter

# INSTALLER=uv (default) or pip. uv resolves and installs the same requirements in ~8 s where pip takes ~78 s
# (measured on 2 cores into a new venv, uv's cache empty); pip stays in the venv either way (`models pull` uses
# `pip download`). uv does not read pip's configuration, so the find-links pip is given (where a machine keeps
# wheels such as the pinned CPU torch) are handed on to it.
# Bytecode is compiled at install (uv does not by default; pip's --compile is its default, asked for anyway):
# where PYTHONDONTWRITEBYTECODE is set, nothing would ever write it, and every process (each CLI call, each
# spawned rank, each test subprocess) compiled torch and transformers from source again: `import infer_tune.cli`
# 5.70 s without .pyc files, 2.82 s with; the suite 453 s -> 311 s on 2 cores. ~35 s once, at install.
INSTALLER ?= uv
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# one resolve for the project, its dev extra and the pinned torch (a separate `pip install torch` first resolved
# and checked torch twice)
$(VENV)/.installed: pyproject.toml | $(BIN)/python
ifeq ($(INSTALLER),uv)
	test -x $(BIN)/uv || $(BIN)/pip install --quiet uv
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python $(addprefix --find-links ,$(FIND_LINKS)) \
		-e ".[dev,openvino]" "$(TORCH_SPEC)"
else
	$(BIN)/pip install --quiet --compile -e ".[dev,openvino]" "$(TORCH_SPEC)"
endif
	touch $@

install: $(VENV)/.installed

# Debian packages the tests use (chromium for the report's browser test, bubblewrap for the code sandbox)
system-deps:
	@sh scripts/install-system-deps.sh

model: install
	$(BIN)/infer-tune models pull smollm2-135m

# OpenVINO's exporter (optimum-intel pins transformers<5.6): its own venv under $$INFER_TUNE_HOME/tools, made
# once (~50 s, 1.6 GB; docs/engines.md); the tests that run OpenVINO for real on the default model need it
openvino-exporter: install
	$(BIN)/python -c "from infer_tune.engines import openvino; print(openvino.ensure_exporter())"

# The main job: every technique once on SmolLM2-135M (the `quick` recipe: quantization, KV cache,
# batching, speculative decoding, MoE expert placement on the MoEfied demo model), each stage against
# its own baseline measured in the same session, then one combined report with the claims table and
# the recommended configuration. --resume: a rerun continues where an interrupted one stopped.
DEMO_OUT ?= runs/demo
DEMO_RECIPE ?= quick
demo: model
	$(BIN)/infer-tune experts build-demo
	$(BIN)/infer-tune experts profile --model moe-demo --suite chat --limit 8 --out $(DEMO_OUT) \
		--save $(DEMO_OUT)/moe-demo-load.json
	$(BIN)/infer-tune bench --recipe $(DEMO_RECIPE) --out $(DEMO_OUT) --resume
	@echo "report: $(DEMO_OUT)/leaderboard.html (.md, .csv); results: $(DEMO_OUT)/<run-id>/result.json"

# two pytest-xdist workers, one per core: whole files to a worker, the sandbox tests on one (tests/conftest.py).
# A worker that dies (a signal, the OOM killer) ends the run at once, naming its test, with what faulthandler wrote
# (tests/conftest.py): pytest-xdist 3.8's loadgroup scheduler can wait forever for a replaced worker's work.
test: model system-deps openvino-exporter
	$(BIN)/python -m pytest -q -ra -n 2 --dist loadgroup --max-worker-restart 0

lint: install
	$(BIN)/ruff check infer_tune tests bench

clean:
	rm -rf $(VENV) runs
