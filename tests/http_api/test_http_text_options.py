"""Text options as vLLM has them: special tokens left out of the text by default, a stop string kept on
request, a stop token's own text left out (as vLLM), the tokenizer's BOS added to completion prompts
(add_special_tokens), up to 20 logprobs."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient
from tokenizers import Tokenizer, processors

from cluster.http_api.ingress import build_app
from cluster.serve_settings import IngressSettings
from cp_router.detokenize import IncrementalText
from cp_router.protocol import EngineRequest
from cp_router.request_stream import RequestStream
from model_workers.checkpoint.model_dir import resolve_model_dir
from model_workers.checkpoint.tokenizer import encode, load_tokenizer
from support.http_fakes import FakeEngine, write_checkpoint_files


def texts(tokenizer, ids: list[int], **options) -> str:
    text = IncrementalText(tokenizer, **options)
    out = ""
    for token_id in ids:
        text.add(token_id)
        out += text.release(final=False)
        if text.stopped:
            break
    return out + text.release(final=True)


def test_special_tokens_are_skipped_unless_asked_and_stop_strings_kept_on_request():
    tokenizer = load_tokenizer(resolve_model_dir(None))
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids = encode(tokenizer, "def f(x):") + [eos] + encode(tokenizer, " return x")
    assert texts(tokenizer, ids) == "def f(x): return x"
    assert texts(tokenizer, ids, skip_special_tokens=False) == "def f(x):<|endoftext|> return x"
    assert texts(tokenizer, ids, stop=("(x)",)) == "def f"
    assert texts(tokenizer, ids, stop=("(x)",), include_stop=True) == "def f(x)"


def test_a_stop_tokens_own_text_is_not_output_unless_include_stop_str_in_output():
    tokenizer = load_tokenizer(resolve_model_dir(None))
    ids = encode(tokenizer, "def f(x):")
    for include, expected in ((False, tokenizer.decode(ids[:-1])), (True, "def f(x):")):
        request = EngineRequest("r", (1,), max_tokens=8, stop_token_ids=(ids[-1],), skip_special_tokens=False,
                                include_stop_str_in_output=include)
        stream = RequestStream(request, tokenizer)
        stream.push(ids[:-1], [], None)
        stream.push(ids[-1:], [], "stop")  # the engine ended it on the stop token
        chunks = [stream.queue.get_nowait() for _ in range(2)]
        assert "".join(chunk.text for chunk in chunks) == expected and chunks[-1].token_ids == (ids[-1],)


def test_completion_prompts_get_the_tokenizers_bos_unless_add_special_tokens_is_false(tmp_path):
    folder = write_checkpoint_files(tmp_path)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    engine = FakeEngine()
    client = TestClient(build_app(engine, IngressSettings(model_dir=str(folder))))
    client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 1})
    client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 1, "add_special_tokens": False})
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1})
    bos, plain, chat = (r.prompt_token_ids for r in engine.requests)
    assert (bos, plain) == ((1, 3, 4), (3, 4))
    assert chat == (1, 5, 8, 3, 6, 8)  # the template writes its own BOS: none is added on top


def test_twenty_logprobs_and_the_options_reach_the_engine(tmp_path):
    folder = write_checkpoint_files(tmp_path)
    engine = FakeEngine()
    client = TestClient(build_app(engine, IngressSettings(model_dir=str(folder))))
    body = {"prompt": [3], "max_tokens": 1, "logprobs": 20, "skip_special_tokens": False,
            "include_stop_str_in_output": True, "stop": ["w1"]}
    assert client.post("/v1/completions", json=body).status_code == 200, json.dumps(body)
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 20}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    first, second = engine.requests
    assert (first.logprobs, first.skip_special_tokens, first.include_stop_str_in_output) == (20, False, True)
    assert second.logprobs == 20 and second.skip_special_tokens


def test_continuous_usage_stats_and_system_fingerprint(tmp_path):
    import openai

    from cluster.http_api.openai_responses import SYSTEM_FINGERPRINT

    folder = write_checkpoint_files(tmp_path)
    client = TestClient(build_app(FakeEngine(), IngressSettings(model_dir=str(folder))))
    body = {"prompt": "hello", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = [json.loads(e.removeprefix("data: ")) for e in client.post("/v1/completions", json=body).text.split("\n\n")
              if e and e != "data: [DONE]"]
    assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 3, 3]  # 3 chunks, then the usage chunk
    assert all(e["usage"]["prompt_tokens"] == 1 and e["system_fingerprint"] == SYSTEM_FINGERPRINT for e in events)
    whole = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 1}).json()
    parsed = openai.types.chat.ChatCompletion.model_validate(whole)
    assert parsed.system_fingerprint == SYSTEM_FINGERPRINT and SYSTEM_FINGERPRINT.startswith("fp_dsa_serve_")
