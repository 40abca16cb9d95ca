"""--reasoning-parser: the thinking of a chat completion as `reasoning_content`, apart from `content`, whole and
streamed (split anywhere, even inside `</think>`), on when the prompt opened the think block, off otherwise."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import openai
import pytest

from cluster.http_api.chat_output import ChatOutputSplitter
from cluster.http_api.ingress import build_app
from cluster.http_api.reasoning import ReasoningSplitter
from cluster.serve_settings import IngressSettings
from support.http_fakes import INFO, ScriptedEngine, write_deepseek_checkpoint

OUTPUT = ["Let", " me", " think", "</thi", "nk>", "The", " answer"]


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    piece = ChatOutputSplitter(in_reasoning, None).whole(text)
    return piece.reasoning, piece.content


def test_whole_and_piecewise_splits_agree_wherever_the_text_is_cut():
    text = "Let me think</think>The answer"
    assert split_reasoning(text, True) == ("Let me think", "The answer")
    assert split_reasoning(text, False) == (None, text)  # thinking off: all of it is the answer
    assert split_reasoning("<think>hm</think>ok", False) == ("hm", "ok")  # the output opened the block itself
    assert split_reasoning("still thinking", True) == ("still thinking", "")
    for cut in range(1, len(text)):
        splitter = ReasoningSplitter(True)
        pieces = [splitter.feed(text[:cut]), splitter.feed(text[cut:], final=True)]
        assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == ("Let me think", "The answer")


@pytest.fixture
def app(tmp_path):
    folder, _ = write_deepseek_checkpoint(tmp_path / "dsv32")
    engine = ScriptedEngine(OUTPUT, info=dataclasses.replace(INFO, vocab_size=16))
    return build_app(engine, IngressSettings(model_dir=str(folder), reasoning_parser="deepseek_v3"))


def test_reasoning_content_whole_and_streamed_through_the_openai_client(app):
    async def scenario():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http, max_retries=0)
        thinking = {"chat_template_kwargs": {"thinking": True}}
        messages = [{"role": "user", "content": "hello"}]
        whole = await client.chat.completions.create(model="tiny-dsa", messages=messages, extra_body=thinking)
        assert (whole.choices[0].message.reasoning_content, whole.choices[0].message.content) == ("Let me think",
                                                                                                 "The answer")
        stream = await client.chat.completions.create(model="tiny-dsa", messages=messages, stream=True,
                                                      extra_body=thinking)
        deltas = [chunk.choices[0].delta async for chunk in stream if chunk.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Let me think"
        assert "".join(d.content or "" for d in deltas) == "The answer"
        plain = await client.chat.completions.create(model="tiny-dsa", messages=messages)  # thinking off
        assert plain.choices[0].message.content == "".join(OUTPUT)
        assert getattr(plain.choices[0].message, "reasoning_content", None) is None

    asyncio.run(scenario())
