"""One choice's answer split into content and tool calls, delta by delta (the tool-call parser's format).

Content is released as it comes, except a tail that may be the start of the format's opening marker (and the
whitespace before it). From the marker on, the text is the tool-call section: each call is released once it is
complete, with its own id. A section that ends (the choice finished) without one complete call was not a call
after all: it is released as content. A forced call (tool_choice "required" or a named function) had its opening written into the prompt;
the stream is primed with it, so the model's continuation is parsed as the rest of that call.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from cluster.http_api.chat_requests import ChatCompletionRequest
from cluster.http_api.errors import bad_request
from cluster.http_api.reasoning import partial_suffix
from cluster.http_api.tool_parsers import TOOL_CALL_PARSERS, ParamTypes, ParsedCall, ToolCallFormat, tool_call_format


@dataclass(frozen=True)
class ToolCallSetup:
    """How one chat request's answers are searched for tool calls."""

    format: ToolCallFormat
    param_types: ParamTypes
    forced_prefix: str = ""  # written into the prompt: the opening of a forced call ("" for tool_choice auto)
    parallel: bool = True  # parallel_tool_calls: False keeps the first call only


@dataclass(frozen=True)
class EmittedCall:
    index: int  # the call's position in this choice's tool_calls
    id: str
    call: ParsedCall


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    def __init__(self, setup: ToolCallSetup):
        self.setup = setup
        self.pending = setup.forced_prefix  # content held back (a possible marker start), or the forced opening
        self.section: str | None = None  # the text from the opening marker on, once it appeared
        self.searched = 0  # characters of `section` already searched for the end of a call
        self.emitted: list[EmittedCall] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[EmittedCall]]:
        """The next piece of the answer -> (content delta, calls completed by it)."""
        if self.section is not None:
            self.section += text
            return self._section_delta(final)
        text, self.pending = self.pending + text, ""
        start = text.find(self.setup.format.start)
        if start < 0:
            keep = 0 if final else self._held_back(text)
            self.pending = text[len(text) - keep:] if keep else ""
            return text[: len(text) - keep], []
        self.section = text[start:]
        content, calls = self._section_delta(final)
        return text[:start].rstrip() + content if calls or not final else text[:start] + content, calls

    def _held_back(self, text: str) -> int:
        """How much of the tail may belong to the markup: a start of the marker and the whitespace before it (the
        content before a call is released without its trailing whitespace)."""
        keep = partial_suffix(text, self.setup.format.start)
        body = text[: len(text) - keep]
        return keep + len(body) - len(body.rstrip())

    def _section_delta(self, final: bool) -> tuple[str, list[EmittedCall]]:
        """Parses the section again only when a call may have closed since the last search (a long argument
        streamed token by token would otherwise be re-parsed at every token)."""
        call_end = self.setup.format.call_end
        closed = self.section.find(call_end, max(0, self.searched - len(call_end) + 1)) >= 0
        self.searched = len(self.section)
        if not (closed or final):
            return "", []
        calls = self.setup.format.parse(self.section, self.setup.param_types)
        if not self.setup.parallel:
            calls = calls[:1]
        new = [EmittedCall(len(self.emitted) + i, new_call_id(), call)
               for i, call in enumerate(calls[len(self.emitted):])]
        self.emitted.extend(new)
        if final and not self.emitted:  # the markup never became a call: it was text
            return self.section, []
        return "", new

    @property
    def called(self) -> bool:
        return bool(self.emitted)


def tool_call_setup(body: ChatCompletionRequest, parser: str | None, auto_tool_choice: bool) -> ToolCallSetup | None:
    """How `body`'s answers are parsed (None: tool_choice "none", or no tools); a 400 naming the flags when this
    server cannot honour its tool_choice (vLLM's rule: "auto" needs --enable-auto-tool-choice as well)."""
    choice = body.effective_tool_choice
    if choice == "none":
        return None
    label = choice if isinstance(choice, str) else f"function {choice.function.name!r}"
    if parser is None:
        raise bad_request(f"tool_choice: {label} needs a tool-call parser; start the server with --tool-call-parser "
                          f"({', '.join(TOOL_CALL_PARSERS)})", param="tool_choice")
    if choice == "auto" and not auto_tool_choice:
        raise bad_request('tool_choice: "auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                          'to be set (or send tool_choice "required", "none" or a named function)', param="tool_choice")
    format = tool_call_format(parser)
    forced = "" if choice == "auto" else format.forced_prefix(None if choice == "required" else choice.function.name)
    return ToolCallSetup(format, body.tool_param_types(), forced, body.parallel_tool_calls)
