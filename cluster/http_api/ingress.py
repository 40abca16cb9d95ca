"""The HTTP ingress: an OpenAI-style FastAPI app over an `EngineClient` (see cp_router/protocol.py).

Routes: POST /v1/completions, POST /v1/chat/completions (404 unless the checkpoint has a chat template),
GET /v1/models, GET /health, GET /metrics, GET /openapi.json (openapi_schema.py), utility_routes.py's
(/v1/models/{id}, /tokenize, /detokenize, /version), and the chat planning's other APIs: POST /v1/responses
(responses_api.py), POST /v1/messages and /v1/messages/count_tokens (messages_api.py). The model answers to its
served names (`IngressSettings.served_model_name`, default its folder's). The /v1 routes need `Authorization: Bearer
<key>` (or `x-api-key: <key>`) when an API key is configured (IngressSettings.api_key or env DSA_SERVE_API_KEY);
/health and /metrics are open, for probes and scrapers. Everything is validated and tokenized here, before the
engine is reached. Once `app.state.admission` drains (middleware.Admission), generation routes and /health answer
503 + Retry-After.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable, TypeVar

from fastapi import FastAPI, Request, params
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from cluster.http_api.body import ModelT, read_json_body
from cluster.http_api.chat_requests import ChatCompletionRequest, tools_json
from cluster.http_api.choice_streams import plan_choices
from cluster.http_api.errors import MESSAGES_PATH, APIError, install_error_handlers
from cluster.http_api.grammar_check import GrammarCheck
from cluster.http_api.generation import ChunkWriter, Generation, respond_stream, respond_whole
from cluster.http_api.messages_api import MESSAGES_OPERATIONS, add_messages_routes
from cluster.http_api.middleware import AccessLogMiddleware, Admission, ConcurrencyLimitMiddleware, api_key_dependencies
from cluster.http_api.openai_format import ChatFormatter, CompletionFormatter, ResponseFormatter
from cluster.http_api.openai_requests import CompletionRequest, ModelLimits, SamplingRequest
from cluster.http_api.openai_responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from cluster.http_api.openapi_schema import JSONOperation, install_openapi
from cluster.http_api.prompt_encoding import EncodedPrompt, PromptEncoder
from cluster.http_api.reasoning import opens_reasoning
from cluster.http_api.responses_api import RESPONSES_OPERATIONS, RESPONSES_PATH, add_responses_routes
from cluster.http_api.tool_grammar import chat_grammar
from cluster.http_api.tool_stream import ToolCallSetup, tool_call_setup
from cluster.http_api.utility_routes import RequestIdMiddleware, add_utility_routes
from cluster.ray_metrics import replica_metrics
from cluster.serve_settings import IngressSettings
from cp_router.metrics import MetricsScrapeError, ServeMetrics, merge_metrics_text
from cp_router.protocol import EngineClient, ModelInfo, one_line
from model_workers.checkpoint.generation_config import sampling_defaults
from model_workers.checkpoint.tokenizer import CheckpointText

metrics_logger = logging.getLogger("dsa_serve.metrics")
JSON_OPERATIONS = {"/v1/completions": JSONOperation(CompletionRequest, CompletionResponse, CompletionResponse),
                   "/v1/chat/completions": JSONOperation(ChatCompletionRequest, ChatCompletionResponse,
                                                         ChatCompletionChunk),
                   **RESPONSES_OPERATIONS, **MESSAGES_OPERATIONS}
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", RESPONSES_PATH, MESSAGES_PATH})
SamplingRequestT = TypeVar("SamplingRequestT", bound=SamplingRequest)
# (request id, model, reasoning, tools) -> the output side: ChatFormatter, or the Responses / Messages formatters
FormatterFactory = Callable[[str, str, bool | None, ToolCallSetup | None], ResponseFormatter]


@dataclass(frozen=True)
class Ingress:
    engine: EngineClient
    settings: IngressSettings
    info: ModelInfo
    limits: ModelLimits
    encoder: PromptEncoder
    metrics: ServeMetrics
    started: int
    sampling_defaults: dict  # generation_config.json's, for the fields a request leaves out
    grammar_check: GrammarCheck  # structured outputs: every constraint compiles before its request is queued

    @property
    def names(self) -> tuple[str, ...]:
        """The names clients may send as `model` (the first is the one responses carry when a request names none)."""
        return tuple(self.settings.served_model_name or (self.info.name,))

    def check_model(self, requested: str | None) -> str:
        """The served name a request addresses; 404 model_not_found for any other name."""
        if requested is None:
            return self.names[0]
        if requested not in self.names:
            served = ", ".join(repr(name) for name in self.names)
            raise APIError(404, f"model {requested!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return requested

    def plan_completion(self, body: CompletionRequest) -> Generation:
        prompts = [self.encoder.encode(prompt, self.limits, add_special_tokens=body.add_special_tokens)
                   for prompt in body.prompts()]
        max_tokens = [self.limits.resolve_max_tokens(len(p.token_ids), body.max_tokens, body.min_tokens, "prompt")
                      for p in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        choices = plan_choices(request_id, prompts, max_tokens, body, body.logprobs, self.limits, body.grammar_spec())
        return Generation(request_id, choices, CompletionFormatter(request_id, self.check_model(body.model)),
                          sum(len(prompt.token_ids) for prompt in prompts), echo=body.echo,
                          prompt_logprobs=body.prompt_logprobs)

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[ChatCompletionRequest, EncodedPrompt,
                                                                 ToolCallSetup | None]:
        """The chat request's prompt and how its answer is searched for tool calls (the request as planned: with
        tools to parse, special tokens are kept)."""
        tools = tool_call_setup(body, self.settings.tool_call_parser, self.settings.enable_auto_tool_choice)
        if tools is not None:  # the markup may be special tokens (DeepSeek's DSML, GLM's <tool_call>): keep them
            body = body.model_copy(update={"skip_special_tokens": False})
        prompt = self.encoder.encode_chat(body.messages, self.limits, body.chat_template_kwargs, tools_json(body.tools),
                                          tools.forced_prefix if tools else "")
        return body, prompt, tools

    def plan_chat(self, body: ChatCompletionRequest, make_formatter: FormatterFactory = ChatFormatter,
                  id_prefix: str = "chatcmpl-") -> Generation:
        """`make_formatter(request_id, model, reasoning, tools)`: the output side (chat's own, or the Responses and
        Messages APIs', which plan their requests as chat requests); request ids are `id_prefix` + 32 hex digits."""
        body, prompt, tools = self.chat_prompt(body)
        max_tokens = self.limits.resolve_max_tokens(len(prompt.token_ids), body.requested_max_tokens,
                                                    body.min_tokens, "messages")
        request_id = f"{id_prefix}{uuid.uuid4().hex}"
        reasoning = opens_reasoning(prompt.text) if self.settings.reasoning_parser else None
        grammar = chat_grammar(body, tools, bool(reasoning), self.encoder.tokenizer)
        choices = plan_choices(request_id, [prompt], [max_tokens], body, body.engine_logprobs, self.limits, grammar)
        formatter = make_formatter(request_id, self.check_model(body.model), reasoning, tools)
        return Generation(request_id, choices, formatter,
                          len(prompt.token_ids), prompt_logprobs=body.prompt_logprobs)

    async def respond(self, request: Request, body: SamplingRequest, generation: Generation) -> Response:
        request.state.request_id = generation.request_id
        await self.check_grammar(generation)
        if body.stream:
            writer = ChunkWriter(generation.formatter, body.include_usage_in_stream, body.usage_in_every_chunk)
            return await respond_stream(request, self.engine, self.encoder, generation, writer)
        whole = await respond_whole(request, self.engine, self.encoder, generation)
        return JSONResponse(whole.model_dump(mode="json"))

    async def check_grammar(self, generation: Generation) -> None:
        """A constrained request's grammar compiled (a 400 if it does not) before the engine sees the request."""
        await self.grammar_check.check(generation.choices[0].request.grammar)

    async def read(self, request: Request, model: type[SamplingRequest]) -> SamplingRequest:
        body = self.with_sampling_defaults(await self.read_body(request, model))
        if body.user is not None:
            request.state.user = repr(body.user)
        return body

    async def read_body(self, request: Request, model: type[ModelT]) -> ModelT:
        """The JSON body as `model` (body.py's checks), addressed to a served model (404 otherwise)."""
        body = await read_json_body(request, model, self.settings.max_body_bytes, self.settings.body_timeout_s)
        self.check_model(getattr(body, "model", None))
        return body

    def with_sampling_defaults(self, body: SamplingRequestT) -> SamplingRequestT:
        """generation_config.json's sampling values for the fields the request left out."""
        unset = {key: value for key, value in self.sampling_defaults.items() if key not in body.model_fields_set}
        return body.model_copy(update=unset) if unset else body

    def model_list(self) -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=self.started, max_model_len=self.info.max_model_len)
                               for name in self.names])

    async def health(self) -> dict[str, str]:
        try:
            await self.engine.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure of the probe means "unhealthy"
            raise APIError(503, f"engine unhealthy: {one_line(exc)}", code="engine_unhealthy") from None
        return {"status": "ok"}

    async def metrics_text(self) -> str:
        """The ingress's metrics and those of every engine replica that answered: a replica that did not is
        logged and counted (dsa_serve:metrics_scrape_errors_total), never failing the scrape."""
        failed = 0
        try:
            engine_text = await self.engine.metrics_text()
        except MetricsScrapeError as partial:
            engine_text, failed, cause = partial.text, len(partial.failures), str(partial)
        except Exception as exc:  # noqa: BLE001 - no replica could be asked: the ingress's own metrics still answer
            engine_text, failed, cause = "", 1, f"engine metrics unavailable: {one_line(exc)}"
        if failed:
            self.metrics.count_scrape_errors(failed)
            metrics_logger.warning("metrics scrape: %s", cause)
        return merge_metrics_text([self.metrics.render(), engine_text])


def _open_ingress(engine_client: EngineClient, settings: IngressSettings, text: CheckpointText | None) -> Ingress:
    if not isinstance(engine_client, EngineClient):
        raise TypeError(f"engine_client: {type(engine_client).__name__} lacks EngineClient methods (generate, abort, "
                        "model_info, metrics_text, check_health)")
    info = engine_client.model_info()
    encoder = PromptEncoder.from_model_dir(settings.model_dir, settings.chat_template) if text is None \
        else PromptEncoder.from_text(text)
    if info.has_chat_template and encoder.chat_template is None:
        raise ValueError(f"model_dir: the engine's checkpoint has a chat template but {settings.model_dir!r} has no "
                         "tokenizer_config.json chat_template; point IngressSettings.model_dir at the checkpoint")
    metrics = replica_metrics("ingress", (settings.served_model_name or [info.name])[0], settings.metrics_replica,
                              settings.ray_metrics_export)
    return Ingress(engine_client, settings, info, ModelLimits(info.vocab_size, info.max_model_len), encoder, metrics,
                   int(time.time()), sampling_defaults(settings.model_dir),
                   GrammarCheck(encoder.tokenizer, info.vocab_size, settings.grammar_compile_timeout_s, metrics))


def _add_routes(app: FastAPI, ingress: Ingress, authorized: list[params.Depends]) -> None:
    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request) -> Response:
        body = await ingress.read(request, CompletionRequest)
        return await ingress.respond(request, body, ingress.plan_completion(body))

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request) -> Response:
        body = await ingress.read(request, ChatCompletionRequest)
        return await ingress.respond(request, body, ingress.plan_chat(body))

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> JSONResponse:
        return JSONResponse(ingress.model_list().model_dump(mode="json"))

    @app.get("/health")
    async def health() -> JSONResponse:
        app.state.admission.check_open()  # draining: 503, so load balancers stop sending here
        return JSONResponse(await ingress.health())

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(await ingress.metrics_text(), media_type=CONTENT_TYPE_LATEST)


def build_app(engine_client: EngineClient, settings: IngressSettings | None = None,
              text: CheckpointText | None = None) -> FastAPI:
    """The ingress FastAPI app over `engine_client`; raises ValueError on inconsistent settings.

    `text`: the checkpoint's tokenizer and chat template when this process has them loaded already (the
    colocated placement); otherwise they are read from `settings.model_dir`."""
    settings = settings or IngressSettings()
    ingress = _open_ingress(engine_client, settings, text)
    app = FastAPI(title="dsa-serve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_error_handlers(app)
    app.state.admission = Admission(settings.retry_after_s)  # the drain gate (cluster/serve_app.py drains it)
    app.add_middleware(ConcurrencyLimitMiddleware, paths=GENERATION_PATHS, limit=settings.max_ongoing_requests,
                       retry_after_s=settings.retry_after_s, admission=app.state.admission)
    app.add_middleware(AccessLogMiddleware, metrics=ingress.metrics)
    app.add_middleware(RequestIdMiddleware, add_header=settings.request_id_header)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    authorized = api_key_dependencies(settings.resolved_api_key())
    _add_routes(app, ingress, authorized)
    add_utility_routes(app, ingress, authorized)
    add_responses_routes(app, ingress, authorized)
    add_messages_routes(app, ingress, authorized)
    install_openapi(app, JSON_OPERATIONS)
    app.state.ingress = ingress
    return app
