"""`--reasoning-parser`: a chat completion's thinking returned as `reasoning_content`, apart from `content`.

DeepSeek-V3.2 (`deepseek_v3`, `deepseek_r1`) and GLM-5 (`glm45`) write their reasoning as `<think>...</think>`
before the answer. A completion is in reasoning from its start when its prompt opened the block (the template
ended with `<think>`: thinking on) or when its own text starts with `<think>`; the reasoning ends at the first
`</think>`. With thinking off (the prompt closed the block) everything is content. Streams are split delta by
delta: a tail that may be the start of `</think>` waits for the next delta.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "glm45")
THINK_START, THINK_END = "<think>", "</think>"


def opens_reasoning(prompt_text: str) -> bool:
    """The prompt leaves the model inside a think block (thinking on)."""
    return prompt_text.rstrip().endswith(THINK_START)


class ReasoningSplitter:
    """Splits one choice's text, fed in order, into (reasoning, content) pieces."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning, self.started = in_reasoning, False
        self.had_reasoning = in_reasoning  # the output has a reasoning part (the prompt or the output opened it)
        self.pending = ""  # text held back: the start of the output (`<think>`?) or a possible `</think>` prefix

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The next piece of output -> (reasoning delta, content delta)."""
        text = self.pending + text
        self.pending = ""
        if not self.started:
            if len(text) < len(THINK_START) and THINK_START.startswith(text) and not final:
                self.pending = text
                return "", ""
            self.started = True
            if text.startswith(THINK_START):
                self.in_reasoning, self.had_reasoning, text = True, True, text[len(THINK_START):]
        if not self.in_reasoning:
            return "", text
        end = text.find(THINK_END)
        if end >= 0:
            self.in_reasoning = False
            return text[:end], text[end + len(THINK_END):]
        keep = 0 if final else partial_suffix(text, THINK_END)
        self.pending = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], ""


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
