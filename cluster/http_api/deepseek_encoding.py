"""DeepSeek-V3.2's chat encoding, which the checkpoint ships as Python rather than as a Jinja template.

Written from its documented format:

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜><｜User｜>...

A user turn is `<｜User｜>{content}<｜Assistant｜>` followed by the think opener of the answer after it: `<think>`
after the last user turn in thinking mode (`chat_template_kwargs` `{"thinking": true}`, or `thinking_mode:
"thinking"`), `</think>` otherwise. An assistant turn is `{reasoning}</think>{content}{calls}<｜end▁of▁sentence｜>`
in thinking mode after the last user turn and `{content}{calls}<｜end▁of▁sentence｜>` otherwise (earlier turns
drop their reasoning). System (and OpenAI's developer) content is written as it is, where it stands.

Tools: the first message's system part (an empty one when the conversation starts otherwise) gains a `## Tools`
section listing the functions as JSON schemas, in the DSML wording the model was trained with. An assistant's calls are a DSML block (tool_parsers.py) after its content; the tool
results that answer them follow as `<function_results><result>...</result>...</function_results>`, closed by
the think opener of the answer that comes next.
"""

from __future__ import annotations

import json
from typing import Any

from cluster.http_api.errors import bad_request
from cluster.http_api.reasoning import THINK_END, THINK_START
from cluster.http_api.tool_parsers import DSML

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
MODEL_TYPES = frozenset({"deepseek_v32"})  # checkpoints that get this encoding when they ship no template

TOOLS_SECTION = f"""## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply to \
the user:
<{DSML}function_calls>
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
</{DSML}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects \
should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" \
for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking \
block. Here is an example:

<{DSML}function_calls>
...
</{DSML}function_calls>

<function_results>
...
</function_results>

{THINK_START}...thinking about results{THINK_END}

Here are the functions available in JSONSchema format:
<functions>
{{schemas}}
</functions>
"""


def thinking_enabled(kwargs: dict[str, Any]) -> bool:
    """`chat_template_kwargs`: {"thinking": true} (vLLM's spelling for DeepSeek) or {"thinking_mode": "thinking"}."""
    return bool(kwargs.get("thinking")) or kwargs.get("thinking_mode") == "thinking"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_section(tools: list[dict[str, Any]]) -> str:
    schemas = "\n".join(_json(tool.get("function", tool)) for tool in tools)
    return TOOLS_SECTION.replace("{schemas}", schemas)


def dsml_calls(calls: list[dict[str, Any]]) -> str:
    """An assistant's calls ({"function": {"name", "arguments": {...}}}) as the DSML block it writes."""
    invokes = []
    for call in calls:
        function = call.get("function", call)
        parameters = [f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
                      f'{value if isinstance(value, str) else _json(value)}</{DSML}parameter>'
                      for key, value in function["arguments"].items()]
        invokes.append(f'<{DSML}invoke name="{function["name"]}">\n' + "\n".join(parameters) + f"\n</{DSML}invoke>")
    return f"\n\n<{DSML}function_calls>\n" + "\n".join(invokes) + f"\n</{DSML}function_calls>"


class DeepSeekV32Encoding:
    """Renders OpenAI messages (`ChatMessage.for_template` dicts) the way DeepSeek-V3.2 was trained to read
    them; the same `render` interface as `chat_template.ChatTemplate`."""

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               **kwargs: Any) -> str:
        thinking = thinking_enabled(kwargs)
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        tools_at = 0 if messages and messages[0]["role"] in ("system", "developer") else -1  # -1: before the first
        parts = [BOS, "\n\n" + tools_section(tools) if tools and tools_at < 0 else ""]
        for i, message in enumerate(messages):
            role, content = message["role"], message.get("content") or ""
            opener = THINK_START if thinking and i >= last_user else THINK_END
            if role in ("system", "developer"):
                parts.append(content + ("\n\n" + tools_section(tools) if tools and i == tools_at else ""))
            elif role == "user":
                parts.append(f"{USER}{content}{ASSISTANT}{opener if i == last_user else THINK_END}")
            elif role == "assistant":
                reasoning = f"{message.get('reasoning_content') or ''}{THINK_END}" if thinking and i > last_user else ""
                calls = dsml_calls(message["tool_calls"]) if message.get("tool_calls") else ""
                parts.append(f"{reasoning}{content}{calls}{EOS}")
            else:  # tool
                parts.append(self._tool_result(messages, i, opener))
        return "".join(parts)

    @staticmethod
    def _tool_result(messages: list[dict[str, Any]], index: int, opener: str) -> str:
        """One tool message: inside the function_results block that answers the assistant's calls before it."""
        first = index
        while first > 0 and messages[first - 1]["role"] == "tool":
            first -= 1
        calls = messages[first - 1].get("tool_calls") if first > 0 and messages[first - 1]["role"] == "assistant" \
            else None
        position = index - first + 1  # 1-based, among the results of those calls
        if not calls or position > len(calls):
            made = len(calls) if calls else 0
            raise bad_request(f"messages[{index}]: a tool message must answer a call of the assistant message before "
                              f"it ({made} call(s) there, this is result {position})", param="messages")
        last_of_run = index + 1 == len(messages) or messages[index + 1]["role"] != "tool"
        if last_of_run and position < len(calls):
            raise bad_request(f"messages[{index}]: the assistant made {len(calls)} tool calls but {position} "
                              f"result(s) follow; send one tool message per call", param="messages")
        text = ("\n\n<function_results>" if position == 1 else "") + f"\n<result>{messages[index]['content']}</result>"
        return text + f"\n</function_results>\n\n{opener}" if position == len(calls) else text
