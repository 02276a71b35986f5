"""Chat templates: the one place a prompt becomes what the model reads, for every pipeline.

``PromptFormat`` turns the text a row's ``prompt_template`` renders (the user message) into the
model's input: with the tokenizer's chat template, ``[system?, user]`` rendered with the generation
prompt; without one, the text itself. RLVR, SFT, evaluation and the agentic episodes all go through
it (``data.chat_template: auto | true | false``; ``auto`` uses the template when the tokenizer has
one), so a row is rendered the same way wherever it is used. ``end_of_response`` is what ends an
assistant answer in that format (the template's end-of-turn token, or ``eos`` for raw text): SFT
targets end with it, so the policy learns to stop where the engine stops. ``conversation`` is the
same rendering for a whole chat request (``reroll serve``): a served model reads a request as the run
that trained it read its prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

ChatTemplateSetting = Literal["auto", True, False]

_MARK = "\u2063MARK\u2063"  # content no template will produce on its own


class ChatTemplateError(ValueError):
    """The tokenizer cannot render chats the way the config asks."""


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template (``tokenizer.chat_template`` set)."""
    return bool(getattr(tokenizer, "chat_template", None))


def uses_chat_template(tokenizer: Any, setting: ChatTemplateSetting) -> bool:
    """``setting`` resolved for ``tokenizer``: ``auto`` is whether it has a template; ``true`` without
    one is an error saying how to fix it."""
    if setting == "auto":
        return has_chat_template(tokenizer)
    if setting and not has_chat_template(tokenizer):
        raise ChatTemplateError(
            "data.chat_template is true but the tokenizer has no chat template (tokenizer_config.json "
            "'chat_template' or chat_template.jinja): use a chat/instruct model, set "
            "data.chat_template=auto to fall back to raw prompts, or false"
        )
    return bool(setting)


def chat_messages(
    text: str, system_prompt: str | None = None, *, role: str = "user", images: int = 0
) -> list[dict[str, Any]]:
    """The conversation a prompt starts: an optional system message, then ``text`` as ``role``'s; with
    ``images``, that message's content is that many image parts and then the text (the form
    vision-language chat templates place images from)."""
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if images:
        parts = [*({"type": "image"} for _ in range(images)), {"type": "text", "text": text}]
        return [*head, {"role": role, "content": parts}]
    return [*head, {"role": role, "content": text}]


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    generation_prompt: bool,
    tools: Sequence[dict[str, Any]] | None = None,
) -> str:
    """``messages`` through the tokenizer's chat template, as text (``apply_chat_template``), with the
    function specs ``tools`` where given."""
    if not has_chat_template(tokenizer):
        raise ChatTemplateError(
            "the tokenizer has no chat template, which multi-turn episodes need: use a chat/instruct "
            "model (or a tiny model built with its chat template, the default)"
        )
    extra = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt, **extra
    )


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The tokens the chat template puts after an assistant message's content (``<|im_end|>\\n`` for
    ChatML, ``<eos>`` for the tiny models); the first is the one the policy generates to stop."""
    probe = [{"role": "user", "content": "u"}]
    prompt = render_chat(tokenizer, probe, generation_prompt=True)
    full = render_chat(tokenizer, [*probe, {"role": "assistant", "content": _MARK}], generation_prompt=False)
    if not full.startswith(prompt) or _MARK not in full:
        raise ChatTemplateError(
            "the chat template does not render an assistant message after the generation prompt it "
            "added (the conversation is not append-only), so responses cannot be placed token-exactly: "
            "use a template that only appends"
        )
    tail = full.split(_MARK, 1)[1]
    return tokenizer.encode(tail, add_special_tokens=False) if tail else []


class PromptFormat:
    """How one run renders prompts and ends responses: raw text, or the tokenizer's chat template.

    ``PromptFormat(tokenizer, chat_template="auto", system_prompt=None)``; ``.chat`` says which was
    chosen. ``prompt(text)`` is the model input for a user message ``text``; ``end_of_response`` the
    token ids that close an answer (``[eos]`` for raw text).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: ChatTemplateSetting = "auto",
        system_prompt: str | None = None,
    ) -> None:
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        self.chat = uses_chat_template(tokenizer, chat_template)
        if system_prompt and not self.chat:
            raise ChatTemplateError(
                "data.system_prompt is set but no chat template is used (data.chat_template is false, or "
                "auto and the tokenizer has none), so there is nowhere to put it: put the text in "
                "data.prompt_template instead, or use a model with a chat template"
            )
        eos = tokenizer.eos_token_id
        end = end_of_turn_ids(tokenizer)[:1] if self.chat else []
        self.end_of_response: list[int] = end or ([eos] if eos is not None else [])

    def prompt(self, text: str, images: int = 0) -> str:
        """The model input for the user message ``text``, after ``images`` images (the chat template
        writes a placeholder for each, which the model's processor expands)."""
        if images and not self.chat:
            raise ChatTemplateError(
                "rows with images need a chat template that places them (a vision-language model's), but "
                "prompts are raw text (data.chat_template is false, or auto and the tokenizer has none): "
                "set data.chat_template to true or auto with such a model"
            )
        if not self.chat:
            return text
        messages = chat_messages(text, self.system_prompt, images=images)
        return render_chat(self.tokenizer, messages, generation_prompt=True)

    def conversation(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> str:
        """The model input for a chat request's ``messages``, rendered as ``prompt`` renders a row: with
        the chat template, the messages (after the system prompt, where they bring no system message of
        their own) with the generation prompt and ``tools``; as raw text, one user message's text, since
        a raw format has no way to write roles (a ``ChatTemplateError`` says so otherwise)."""
        if self.chat:
            head = (
                []
                if any(m.get("role") == "system" for m in messages)
                else chat_messages("", self.system_prompt)[:-1]
            )
            return render_chat(self.tokenizer, [*head, *messages], generation_prompt=True, tools=tools)
        if tools:
            raise ChatTemplateError(
                "tools are written into the prompt by a chat template, and this model reads raw prompts "
                "(data.chat_template is false, or auto and the tokenizer has none): send no tools"
            )
        roles = [m.get("role") for m in messages]
        if roles != ["user"]:
            raise ChatTemplateError(
                f"this model reads raw prompts (data.chat_template is false, or auto and the tokenizer has "
                f"none), so a chat request must hold one user message, whose text is the prompt; this one "
                f"has roles {roles}: send one user message, or the text itself to /v1/completions"
            )
        return messages[0].get("content") or ""

    def describe(self) -> str:
        """One line for the log: which format, and the system prompt when there is one."""
        if not self.chat:
            return "raw prompts (no chat template)"
        return "the tokenizer's chat template" + (" with a system prompt" if self.system_prompt else "")
