# Set-up and entry points. Everything runs inside .venv, created on first use.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
TORCH_INDEX ?=    # e.g. https://download.pytorch.org/whl/cpu: PyPI's Linux torch is a CUDA build of several GB
TRITON  ?= triton==3.7.1
STAMP   := $(VENV)/.installed
SHARED  ?= ../shared/data

# Triton kernels run compiled where there is an NVIDIA GPU, in Triton's interpreter elsewhere.
TRITON_INTERPRET ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 0 || echo 1)

export HF_DATASETS_OFFLINE ?= 1
export HF_HUB_OFFLINE ?= 1

.PHONY: install quickstart test clean FORCE

# The install settings, rewritten only when they change: a new TORCH, TRITON or TORCH_INDEX reinstalls.
SETTINGS := $(VENV)/.install-settings
INSTALL_WITH := $(TORCH) $(TRITON) $(strip $(TORCH_INDEX))
$(SETTINGS): FORCE
	@mkdir -p $(VENV)
	@echo '$(INSTALL_WITH)' | cmp -s - $@ || echo '$(INSTALL_WITH)' > $@

$(STAMP): pyproject.toml $(SETTINGS)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" $(if $(strip $(TORCH_INDEX)),--index-url $(strip $(TORCH_INDEX)))  # pinned, first
	$(BIN)/pip install -q "$(TRITON)" -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

## The main job on the embedded default: prepare Gutenberg, train a small dense LM on CPU.
quickstart: $(STAMP)
	$(BIN)/python quickstart.py --shared $(SHARED)

## The test suite (CPU; GPU-only tests skip with a reason).
test: $(STAMP)
	TRITON_INTERPRET=$(TRITON_INTERPRET) $(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV) runs data
