"""DeepSeek-V3.2's chat encoding, which the checkpoint ships as Python rather than as a Jinja template.

Written from its documented format (tools, DSML, are not built yet):

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜><｜User｜>...

A user turn is `<｜User｜>{content}<｜Assistant｜>`; an assistant turn is `{reasoning}{content}<｜end▁of▁sentence｜>`
where the reasoning part is `<think>{reasoning}</think>` in thinking mode and just `</think>` otherwise. Turns
before the last user message drop their reasoning (`</think>` only), as the encoder's default `drop_thinking`.
The generation prompt after the last user turn opens `<think>` in thinking mode (`chat_template_kwargs`
`{"thinking": true}`, or `thinking_mode: "thinking"`) and closes it at once in chat mode (the default).
"""

from __future__ import annotations

from typing import Any

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK_START, THINK_END = "<think>", "</think>"
MODEL_TYPES = frozenset({"deepseek_v32"})  # checkpoints that get this encoding when they ship no template


def thinking_enabled(kwargs: dict[str, Any]) -> bool:
    """`chat_template_kwargs`: {"thinking": true} (vLLM's spelling for DeepSeek) or {"thinking_mode": "thinking"}."""
    return bool(kwargs.get("thinking")) or kwargs.get("thinking_mode") == "thinking"


class DeepSeekV32Encoding:
    """Renders OpenAI messages ({"role", "content", optional "reasoning_content"}) the way DeepSeek-V3.2 was
    trained to read them; the same `render` interface as `chat_template.ChatTemplate`."""

    def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        thinking = thinking_enabled(kwargs)
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        parts = [BOS]
        for i, message in enumerate(messages):
            role, content = message["role"], message.get("content") or ""
            if role in ("system", "developer"):
                parts.append(content)
            elif role == "user":
                parts.append(f"{USER}{content}{ASSISTANT}")
            else:  # assistant
                kept = thinking and i > last_user and message.get("reasoning_content")
                reasoning = f"{THINK_START}{message['reasoning_content']}{THINK_END}" if kept else THINK_END
                parts.append(f"{reasoning}{content}{EOS}")
        if messages and messages[-1]["role"] == "user":
            parts.append(THINK_START if thinking else THINK_END)
        return "".join(parts)
