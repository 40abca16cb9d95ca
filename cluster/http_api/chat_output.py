"""One chat choice's generated text -> its reasoning, content and tool calls, delta by delta or whole.

The reasoning parser (when set) takes the thinking off first; the rest is the answer, which the tool-call
stream (when the request has tools to parse) splits into content and calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.http_api.reasoning import ReasoningSplitter
from cluster.http_api.tool_stream import EmittedCall, ToolCallSetup, ToolCallStream


@dataclass(frozen=True)
class ChatPiece:
    reasoning: str | None  # None: no reasoning parser, or (whole) the output had no reasoning part
    content: str
    calls: list[EmittedCall]


class ChatOutputSplitter:
    def __init__(self, reasoning: bool | None, tools: ToolCallSetup | None):
        """`reasoning`: None without a reasoning parser, else whether the prompt left the model thinking."""
        self.reasoning = None if reasoning is None else ReasoningSplitter(reasoning)
        self.tools = None if tools is None else ToolCallStream(tools)

    def feed(self, text: str, final: bool = False) -> ChatPiece:
        thought = None
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, final)
        calls: list[EmittedCall] = []
        if self.tools is not None:
            text, calls = self.tools.feed(text, final)
        return ChatPiece(thought, text, calls)

    def whole(self, text: str) -> ChatPiece:
        """The whole output at once; its reasoning is None when it had no reasoning part."""
        piece = self.feed(text, final=True)
        had_reasoning = self.reasoning is not None and self.reasoning.had_reasoning
        return piece if had_reasoning else ChatPiece(None, piece.content, piece.calls)

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called


def finish_reason(reason: str | None, splitter: ChatOutputSplitter) -> str | None:
    """OpenAI's "tool_calls" when the choice stopped after calling tools."""
    return "tool_calls" if reason == "stop" and splitter.called else reason
