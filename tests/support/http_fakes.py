"""Test doubles for the HTTP ingress: a tiny checkpoint folder (tokenizer + chat template), a deterministic
engine client that keeps the EngineClient contract, and a raw ASGI driver that can disconnect mid-response.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

from cp_router.metrics import ServeMetrics, track_stream
from cp_router.protocol import EngineChunk, EngineOverloadedError, EngineRequest, ModelInfo, TokenLogprob

WORDS = ["[UNK]", "<s>", "</s>", "hello", "world", "user", "assistant", "system", ":"]
VOCAB_SIZE = 64
MAX_MODEL_LEN = 32
FIRST_GENERATED_ID = len(WORDS)  # the fake engine generates only w<id> words
KV_PAGES = 16
CHAT_TEMPLATE = ("{{ bos_token }} {% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
INFO = ModelInfo(name="tiny-dsa", vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN, has_chat_template=True)


def write_checkpoint_files(folder: Path, chat_template: bool = True) -> Path:
    """tokenizer.json (word level: the words above, then w9..w63) and tokenizer_config.json."""
    vocab = {word: index for index, word in enumerate(WORDS)}
    vocab.update({f"w{index}": index for index in range(len(WORDS), VOCAB_SIZE)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def fake_token(request: EngineRequest, step: int) -> int:
    offset = sum(request.prompt_token_ids) + step + (request.seed or 0)
    return FIRST_GENERATED_ID + offset % (VOCAB_SIZE - FIRST_GENERATED_ID)


def fake_prompt_logprob(request: EngineRequest, position: int) -> TokenLogprob:
    """Prompt token `position` (>= 1): logprob -position, rank 2 behind token id + 1, then ids + 2, + 3, ..."""
    token, logprob = request.prompt_token_ids[position], -float(position)
    top = [((token + 1) % VOCAB_SIZE, logprob + 0.5), (token, logprob)]
    top += [((token + j) % VOCAB_SIZE, logprob - j) for j in range(2, request.prompt_logprobs)]
    return TokenLogprob(token, logprob, tuple(top[: request.prompt_logprobs]), rank=2)


class FakeEngine:
    """Deterministic EngineClient: token `fake_token(request, step)`, text " w<id>", one token per chunk, prompt
    logprobs `fake_prompt_logprob` on the first chunk when asked for.

    accept=False: reaching `generate` is a test failure. pause_after=k: after k tokens, wait for `abort`.
    overloaded: the first `__anext__` raises EngineOverloadedError. KV "pages" = active requests (rank 0).
    """

    def __init__(self, info: ModelInfo = INFO, accept: bool = True, pause_after: int | None = None,
                 overloaded: bool = False, metrics_replica: str = "engine-0"):
        self.info, self.accept, self.pause_after, self.overloaded = info, accept, pause_after, overloaded
        self.requests: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.flushes = 0  # POST /flush_cache calls that reached it
        self.active: dict[str, asyncio.Event] = {}
        self.metrics = ServeMetrics(metrics_replica, info.name)
        self.metrics.set_kv_pages(0, 0, KV_PAGES)

    async def generate(self, request: EngineRequest):
        if not self.accept:
            raise AssertionError(f"the engine was reached by {request}")
        if self.overloaded:
            raise EngineOverloadedError("waiting queue is full", retry_after_s=2)
        self.requests.append(request)
        async for chunk in track_stream(self.metrics, self._run(request)):
            yield chunk

    def _set_active(self, request_id: str, aborted: asyncio.Event | None) -> None:
        if aborted is None:
            self.active.pop(request_id, None)
        else:
            self.active[request_id] = aborted
        self.metrics.set_kv_pages(0, len(self.active), KV_PAGES)

    async def _run(self, request: EngineRequest):
        aborted = asyncio.Event()
        self._set_active(request.request_id, aborted)
        prompt_tokens = len(request.prompt_token_ids)
        try:
            for step in range(request.max_tokens):
                if step == self.pause_after:
                    await aborted.wait()
                if aborted.is_set():
                    yield EngineChunk((), "", "abort", prompt_tokens, step)
                    return
                token = fake_token(request, step)
                finish = "stop" if token in request.stop_token_ids else None
                finish = "length" if finish is None and step + 1 == request.max_tokens else finish
                logprobs = self._logprobs(request, token)
                prompt = None
                if step == 0 and request.prompt_logprobs is not None:
                    prompt = (None, *(fake_prompt_logprob(request, i) for i in range(1, prompt_tokens)))
                yield EngineChunk((token,), f" w{token}", finish, prompt_tokens, step + 1, logprobs, prompt)
                if finish:
                    return
                await asyncio.sleep(0)
        finally:
            self._set_active(request.request_id, None)

    @staticmethod
    def _logprobs(request: EngineRequest, token: int) -> tuple[TokenLogprob, ...] | None:
        if request.logprobs is None:
            return None
        top = tuple(((token - rank) % VOCAB_SIZE, -0.5 - rank) for rank in range(request.logprobs))
        return (TokenLogprob(token, -0.5, top),)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if request_id in self.active:
            self.active[request_id].set()

    def model_info(self) -> ModelInfo:
        return self.info

    async def metrics_text(self) -> str:
        return self.metrics.render()

    async def flush_cache(self) -> int:
        self.flushes += 1
        return 0

    async def check_health(self) -> None:
        return None


class ScriptedEngine(FakeEngine):
    """Emits `pieces` as its output text, one per chunk, the last one finishing with "stop" (token ids are
    placeholders); `pieces` may be replaced between requests."""

    def __init__(self, pieces: list[str], **kwargs):
        super().__init__(**kwargs)
        self.pieces = pieces

    async def _run(self, request):
        for step, piece in enumerate(self.pieces):
            finish = "stop" if step == len(self.pieces) - 1 else None
            yield EngineChunk((1,), piece, finish, len(request.prompt_token_ids), step + 1)
            await asyncio.sleep(0)


def http_scope(method: str, path: str, headers: dict[str, str], spec_version: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}


async def call_and_disconnect(app, path: str, payload: dict, after_body_messages: int,
                              spec_version: str = "2.3") -> list[dict]:
    """POST `payload`; the client leaves once it has received `after_body_messages` body messages (0: at once).

    Under ASGI spec 2.4 a send after the disconnect raises OSError, as servers do; before 2.4 the app learns
    it from `receive`. Returns the messages the app sent.
    """
    sent: list[dict] = []
    gone = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            if after_body_messages == 0:
                gone.set()
            return {"type": "http.request", "body": json.dumps(payload).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if gone.is_set() and spec_version >= "2.4":
            raise OSError("connection closed")
        sent.append(message)
        if sum(m["type"] == "http.response.body" for m in sent) >= after_body_messages > 0:
            gone.set()

    await app(http_scope("POST", path, {"content-type": "application/json"}, spec_version), receive, send)
    return sent


DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                    "</think>", "<｜DSML｜function_calls>", "</｜DSML｜function_calls>", "<｜DSML｜invoke", "</｜DSML｜invoke>"]
DEEPSEEK_WORDS = ["[UNK]", "hello", "1+1=?", "Hello!", "helper.", 'name="get_weather">']


def write_deepseek_checkpoint(folder: Path, with_special_tokens: bool = True) -> tuple[Path, Tokenizer]:
    """A `deepseek_v32` folder (config.json + a word-level tokenizer, with DeepSeek-V3.2's chat tokens unless
    told otherwise): its chat goes through the built-in DeepSeek-V3.2 encoding."""
    folder.mkdir()
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(DEEPSEEK_WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if with_special_tokens:
        tokenizer.add_special_tokens(DEEPSEEK_SPECIAL)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    return folder, tokenizer


GLM_TEMPLATE = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n{% for tool in tools %}"
    "{{ tool.function | tojson(ensure_ascii=False) }}"
    "\n{% endfor %}{% endif %}{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|></think>{{ m.content }}{% for call in m.tool_calls or [] %}"
    "<tool_call>{{ call.function.name }}{% for k, v in call.function.arguments.items() %}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v if v is string else v | tojson }}</arg_value>{% endfor %}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response>{% endif %}{% endfor %}"
    "<|assistant|>{{ '<think>' if enable_thinking else '</think>' }}")
GLM_SPECIAL = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>",
               "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
               "<tool_response>", "</tool_response>", "<|endoftext|>"]


def write_glm_checkpoint(folder: Path) -> tuple[Path, Tokenizer]:
    """A GLM-5-like folder: chat_template.jinja (GLM's layout, tools included) beside a word-level tokenizer
    that carries GLM's chat and tool-call special tokens."""
    folder.mkdir()
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(DEEPSEEK_WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(GLM_SPECIAL)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (folder / "chat_template.jinja").write_text(GLM_TEMPLATE)
    (folder / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa"}))
    return folder, tokenizer
