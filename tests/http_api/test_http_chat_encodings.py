"""Chat for the target families: DeepSeek-V3.2's built-in encoding (it ships no Jinja template), thinking on /
off through chat_template_kwargs, and the kwargs reaching a Jinja template (GLM-5's enable_thinking)."""

from __future__ import annotations

import dataclasses

from fastapi.testclient import TestClient

from cluster.http_api.deepseek_encoding import DeepSeekV32Encoding
from cluster.http_api.ingress import build_app
from cluster.serve_settings import IngressSettings
from support.http_fakes import DEEPSEEK_WORDS, INFO, FakeEngine, write_checkpoint_files, write_deepseek_checkpoint


def test_the_documented_deepseek_v32_example():
    messages = [{"role": "user", "content": "hello"},
                {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
                {"role": "user", "content": "1+1=?"}]
    encoding = DeepSeekV32Encoding()
    assert encoding.render(messages, thinking=True) == (
        "<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜></think>Hello! I am DeepSeek.<｜end▁of▁sentence｜>"
        "<｜User｜>1+1=?<｜Assistant｜><think>")  # earlier turns drop their reasoning
    chat = encoding.render([{"role": "system", "content": "Be brief."}, *messages])
    assert chat.startswith("<｜begin▁of▁sentence｜>Be brief.<｜User｜>hello") and chat.endswith("<｜Assistant｜></think>")
    kept = encoding.render([*messages, {"role": "assistant", "content": "2", "reasoning_content": "add"}],
                           thinking_mode="thinking")
    assert kept.endswith("<｜Assistant｜><think>add</think>2<｜end▁of▁sentence｜>")  # after the last user: kept


def test_deepseek_v32_chat_is_served_with_thinking_off_or_on(tmp_path):
    folder, tokenizer = write_deepseek_checkpoint(tmp_path / "dsv32")
    engine = FakeEngine()
    client = TestClient(build_app(engine, IngressSettings(model_dir=str(folder))))
    messages = [{"role": "user", "content": "hello"}]
    assert client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).status_code == 200
    thinking = {"messages": messages, "max_tokens": 1, "chat_template_kwargs": {"thinking": True}}
    assert client.post("/v1/chat/completions", json=thinking).status_code == 200
    plain, think = engine.requests
    ids = [tokenizer.token_to_id(t) for t in ("<｜begin▁of▁sentence｜>", "<｜User｜>")] + [vocab_id("hello")]
    assert list(plain.prompt_token_ids[:3]) == ids
    assert plain.prompt_token_ids[-2:] == (tokenizer.token_to_id("<｜Assistant｜>"), tokenizer.token_to_id("</think>"))
    assert think.prompt_token_ids[-1] == tokenizer.token_to_id("<think>")


def vocab_id(word: str) -> int:
    return DEEPSEEK_WORDS.index(word)


def test_a_deepseek_v32_folder_whose_tokenizer_lacks_the_chat_tokens_has_no_chat(tmp_path):
    folder, _ = write_deepseek_checkpoint(tmp_path / "plain", with_special_tokens=False)
    engine = FakeEngine(info=dataclasses.replace(INFO, has_chat_template=False))
    client = TestClient(build_app(engine, IngressSettings(model_dir=str(folder))))
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}]})
    assert response.status_code == 404 and response.json()["error"]["code"] == "chat_template_missing"


def test_chat_template_kwargs_reach_a_jinja_template(tmp_path):
    (tmp_path / "glm").mkdir()
    folder = write_checkpoint_files(tmp_path / "glm", chat_template=False)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if enable_thinking %}world{% else %}hello{% endif %}")
    engine = FakeEngine()
    client = TestClient(build_app(engine, IngressSettings(model_dir=str(folder))))
    for kwargs in ({"enable_thinking": True}, {}):
        client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1,
                                                  "chat_template_kwargs": kwargs})
    assert [r.prompt_token_ids for r in engine.requests] == [(3, 4), (3, 3)]
