"""A chat template that takes tools, and a tool, for the tests of ``reroll serve``'s tool calling."""

from __future__ import annotations

# a Hermes-style template over the tiny role tokens: tools listed in the system turn, calls in
# <tool_call> blocks, results as <tool_response> in a user turn
HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    '\nCall a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>{% endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{% if not tools %}<|system|>{{ m.content }}{% endif %}"
    "{%- elif m.role == 'assistant' %}<|assistant|>{{ m.content }}{% for c in m.tool_calls or [] %}"
    '<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}<|user|><tool_response>{{ m.content }}</tool_response>"
    "{%- else %}<|user|>{{ m.content }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
        },
    },
}
