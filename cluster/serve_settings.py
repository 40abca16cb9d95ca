"""Settings of the Serve application: the ingress (`IngressSettings`) and the app builder's args (`ServeAppArgs`).

`ServeAppArgs` is the schema of `args:` in deploy/serve_config.yaml and in the RayService's serveConfigV2:
the Ray Serve app builder (`cluster.serve_app:app`) validates its args with it.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from cluster.config import (
    MAX_SPECULATIVE_STEPS,
    AttentionBackendName,
    CPImplName,
    CPStrategyName,
    DeviceName,
    DTypeName,
    KVCacheDTypeName,
)
from cluster.engine_limits import EngineLimits
from cluster.http_api.reasoning import REASONING_PARSERS
from cluster.http_api.tool_parsers import TOOL_CALL_PARSERS
from model_workers.checkpoint.draft_vocab import check_token_map_setting
from model_workers.kernels.registry import DEFAULT_ATTENTION_BACKEND

API_KEY_ENV = "DSA_SERVE_API_KEY"
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # as Kubernetes' default terminationGracePeriodSeconds
EnginePlacement = Literal["separate", "colocated"]


def check_tool_flags(tool_call_parser: str | None, enable_auto_tool_choice: bool) -> None:
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice (--enable-auto-tool-choice) needs tool_call_parser "
                         f"(--tool-call-parser {{{','.join(TOOL_CALL_PARSERS)}}})")


class IngressSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: str | None = None  # tokenizer.json / tokenizer_config.json; None: token-id prompts only
    chat_template: str | None = None  # a Jinja file replacing the checkpoint's template (ServeAppArgs fills it)
    api_key: SecretStr | None = None  # None: read DSA_SERVE_API_KEY; neither set: no authentication
    max_ongoing_requests: int = Field(256, ge=1)  # HTTP generation requests in flight; beyond: 429
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)  # larger request bodies: 413
    body_timeout_s: float = Field(30.0, gt=0)  # a request body not all received within this: 408 (slow senders)
    retry_after_s: int = Field(1, ge=1)  # the Retry-After of a 429
    # `replica` label of the ingress's own metrics; None: ingress-<Serve replica id> (outside Serve: hostname:pid)
    metrics_replica: str | None = Field(None, min_length=1)
    # Copy every dsa_serve metric (engine replicas' too) into Ray's metrics export (`ray_dsa_serve_*`, what
    # KubeRay's PodMonitor scrapes). Off: /metrics only; saves Ray's ~17 us of CPU per histogram observation (one
    # per generated token for the inter-token histogram) in the replica and the node's dashboard agent.
    ray_metrics_export: bool = True
    served_model_name: list[str] | None = Field(None, min_length=1)  # names `model` may take; None: the folder's
    allowed_origins: list[str] = Field(default_factory=list)  # CORS origins ("*": any); empty: no CORS headers
    reasoning_parser: Literal[REASONING_PARSERS] | None = None  # chat: <think>...</think> as reasoning_content
    tool_call_parser: Literal[TOOL_CALL_PARSERS] | None = None  # chat: the family's tool-call markup as tool_calls
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (vLLM's flag; needs tool_call_parser)
    request_id_header: bool = True  # set X-Request-Id on responses; off under Ray Serve, whose proxy sets it
    grammar_compile_timeout_s: float = Field(30.0, gt=0)  # a constraint not compiled within this: 400

    @model_validator(mode="after")
    def _auto_tool_choice_needs_a_parser(self) -> IngressSettings:
        check_tool_flags(self.tool_call_parser, self.enable_auto_tool_choice)
        return self

    def resolved_api_key(self) -> str | None:
        """The configured key, else env DSA_SERVE_API_KEY, else None (no authentication)."""
        configured = self.api_key.get_secret_value() if self.api_key is not None else ""
        return configured or os.environ.get(API_KEY_ENV) or None


class ServeAppArgs(EngineLimits):
    """What `serve run deploy/serve_config.yaml` passes to the app builder (CLI flags of `dsa-serve serve`);
    the capacity fields (max_model_len, num_kv_pages, ...) are `EngineLimits`'."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = None  # checkpoint folder; None: the embedded default model
    chat_template: str | None = None  # a Jinja chat template file; None: chat_template.jinja / tokenizer_config.json
    served_model_name: list[str] | None = Field(None, min_length=1)  # the `model` names; None: the folder's name
    reasoning_parser: Literal[REASONING_PARSERS] | None = None  # see IngressSettings
    tool_call_parser: Literal[TOOL_CALL_PARSERS] | None = None  # see IngressSettings
    enable_auto_tool_choice: bool = False  # see IngressSettings
    cp_size: int = Field(2, ge=1)  # ranks of one CP group = rank workers of one engine replica
    cp_strategy: CPStrategyName = "interleave"  # SGLang's advice for DSA models
    cp_impl: CPImplName = "auto"
    ep_size: int = Field(1, ge=1)  # 1, or cp_size: the routed experts partitioned across the CP group
    speculative_num_steps: int = Field(0, ge=0, le=MAX_SPECULATIVE_STEPS)
    # SGLang's flag: the draft head's vocabulary. auto: the checkpoint's draft_vocab.json if it ships one;
    # none: the full vocabulary; else a token map file (draft_vocab.json format, or SGLang's .pt of ids)
    speculative_token_map: str = "auto"
    dtype: DTypeName = "auto"  # the checkpoint's (bf16 on CUDA); float32 / bfloat16 force one
    kv_cache_dtype: KVCacheDTypeName = "auto"  # auto: keys in `dtype`; fp8_e4m3: docs/kv_cache.md, 'FP8 layout'
    enable_deterministic_inference: bool = False  # SGLang's name: batch-invariant ranks (bit-identical tokens)
    attention_backend: AttentionBackendName = DEFAULT_ATTENTION_BACKEND  # the ranks' kernel set (SGLang's flag)
    disable_cuda_graph: bool = False  # SGLang's flag: decode steps never replayed from CUDA graphs
    # Reuse cached prompt prefixes (vLLM's name; SGLang's disable_radix_cache: true turns it off too)
    enable_prefix_caching: bool = True
    disable_radix_cache: bool = False
    device: DeviceName = "cpu"
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    # A custom Ray resource (a worker group's rayStartParams `resources`) each engine replica's placement takes one
    # unit of: which nodes may hold its group. None: any node with the CPUs / GPUs.
    node_resource: str | None = Field(None, min_length=1)
    # "separate": DSAIngress replicas in front of DSAEngine replicas (scaled independently; every token
    # chunk crosses one more Ray stream). "colocated": one DSAServer deployment whose replica is both the
    # HTTP app and the engine (one process less per chunk; scale by replicas of the whole server).
    engine_placement: EnginePlacement = "separate"
    # With several DSAEngine replicas (separate placement), a prompt goes to the replica that was sent its longest
    # prefix unless that one is overloaded, else to the least-loaded one (cluster/engine_router.py); off: Serve's
    # power-of-two choice. Only with enable_prefix_caching. No effect colocated: Serve's proxy routes before the
    # body is read (docs/deployment.md, 'Prefix-aware routing').
    prefix_aware_routing: bool = True
    # Each HTTP replica also answers HTTP itself on this port, no Serve proxy hop (cluster/direct_ingress.py;
    # `dsa-serve serve --direct-ingress`); None: only through Serve's proxy.
    direct_ingress_port: int | None = Field(None, ge=1, le=65535)
    direct_ingress_host: str = "0.0.0.0"  # the address it binds (`dsa-serve serve` passes --host)
    drain_timeout_s: float = Field(DEFAULT_DRAIN_TIMEOUT_S, gt=0, description=(
        "how long requests in flight may run on after a stop (SIGTERM, a Serve redeploy or scale-down): the app "
        "then refuses new ones with 503 + Retry-After; also each deployment's graceful_shutdown_timeout_s"))
    # Prefill/decode disaggregation (docs/disaggregation.md): DSAPrefill replicas (CP groups of prefill_cp_size
    # ranks) prefill every prompt and hand it off to a DSAEngine replica (decode_dp_size ranks, DP-attention decode,
    # EP across them when ep_size > 1), which decodes it. Needs the separate placement.
    pd_disaggregation: bool = False
    prefill_cp_size: int | None = Field(None, ge=1)  # None: cp_size
    decode_dp_size: int = Field(1, ge=1)
    prefill_replicas: int = Field(1, ge=1)  # DSAPrefill's num_replicas (a config's own num_replicas wins)
    pd_min_prefill_tokens: int = Field(0, ge=0)  # a shorter prompt is prefilled by its decode group itself
    prefill_node_resource: str | None = Field(None, min_length=1)  # node_resource of the prefill groups
    decode_node_resource: str | None = Field(None, min_length=1)  # node_resource of the decode groups
    ingress: IngressSettings = IngressSettings()

    @field_validator("speculative_token_map")
    @classmethod
    def _token_map_exists(cls, value: str) -> str:
        return check_token_map_setting(value)

    @model_validator(mode="after")
    def _auto_tool_choice_needs_a_parser(self) -> ServeAppArgs:
        check_tool_flags(self.tool_call_parser, self.enable_auto_tool_choice)
        return self

    @model_validator(mode="after")
    def _disaggregation_needs_the_separate_placement(self) -> ServeAppArgs:
        if self.pd_disaggregation and self.engine_placement != "separate":
            raise ValueError("pd_disaggregation (--pd-disaggregation) needs engine_placement separate, got "
                             f"{self.engine_placement!r}")
        return self

    def group_args(self, kind: Literal["prefill", "decode"]) -> ServeAppArgs:
        """What one engine group of a disaggregated app runs with: its own rank count (EP across those ranks when
        ep_size > 1)."""
        prefill = kind == "prefill"
        size = (self.prefill_cp_size or self.cp_size) if prefill else self.decode_dp_size
        resource = (self.prefill_node_resource if prefill else self.decode_node_resource) or self.node_resource
        return self.model_copy(update={"cp_size": size, "ep_size": size if self.ep_size > 1 else 1,
                                       "pd_disaggregation": False, "node_resource": resource})

    @property
    def prefix_caching_enabled(self) -> bool:
        """The engines reuse cached prompt prefixes: enable_prefix_caching, unless SGLang's disable_radix_cache."""
        return self.enable_prefix_caching and not self.disable_radix_cache
