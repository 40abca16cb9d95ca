"""CP configuration: the user's choice (validated pydantic model) and its start-up resolution.

`resolve_cp_config` applies the rules of docs/architecture.md, 'Which implementation runs', once, against the
model's Hugging Face config.json (`hf_config`, as a dict), and returns a frozen `ResolvedCPConfig`. Every error is
one line naming the offending field and its allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cp_router.cp.padding import CP_IMPLS
from cp_router.cp.strategies import CP_STRATEGIES
from model_workers.kernels.registry import ATTENTION_BACKENDS
from model_workers.kv_format import KV_CACHE_DTYPES
from model_workers.precision import AUTO_DTYPE, STORAGE_DTYPES
from model_workers.spec import ModelSpec

# The allowed values of every enumerated setting, derived from the table that owns them; CLI `choices=` and the
# Serve YAML schema both come from these.
CPStrategyName = Literal[CP_STRATEGIES]
CPImplName = Literal[("auto", *CP_IMPLS)]
DTypeName = Literal[(AUTO_DTYPE, *STORAGE_DTYPES)]
KVCacheDTypeName = Literal[KV_CACHE_DTYPES]
AttentionBackendName = Literal[ATTENTION_BACKENDS]
DeviceName = Literal["cpu", "cuda"]
MAX_SPECULATIVE_STEPS = 4  # MTP draft tokens per decode step: 0 (plain decoding) .. 4


def check_speculative_steps(value: int, name: str = "speculative_num_steps") -> int:
    """The one range check of the speculative step count; `name` is the flag or field in the message."""
    if not 0 <= value <= MAX_SPECULATIVE_STEPS:
        raise ValueError(f"{name} must be in 0..{MAX_SPECULATIVE_STEPS}, got {value}")
    return value

# Non-DSA model types in the v2 family (they default to cp_impl=v2): the MiMo-V2 models.
V2_FAMILY_MODEL_TYPES = frozenset({"mimo_v2", "mimo_v2_flash"})
# Architectures whose name starts with this prefix belong to the MiMo-V2 family too.
MIMO_V2_ARCHITECTURE_PREFIX = "MiMoV2"
# Sub-configs that mark a multimodal model config.
MULTIMODAL_CONFIG_KEYS = ("vision_config", "audio_config", "video_config")


class CPConfig(BaseModel):
    """User-facing CP settings (CLI / Serve config)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enable_prefill_cp: bool = False
    cp_size: int = Field(default=1, ge=1)
    cp_strategy: CPStrategyName | None = None
    cp_impl: CPImplName = "auto"
    ep_size: int = Field(default=1, ge=1)  # 1, or cp_size: routed experts partitioned across the CP group

    @model_validator(mode="after")
    def _strategy_required(self) -> CPConfig:
        if self.enable_prefill_cp and self.cp_strategy is None:
            raise ValueError(
                "cp_strategy is required when enable_prefill_cp is true; allowed values: 'zigzag', 'interleave'"
            )
        if self.ep_size not in (1, self.cp_size):
            raise ValueError(f"ep_size={self.ep_size} is not supported with cp_size={self.cp_size};"
                             f" allowed values: 1, {self.cp_size} (experts partitioned across the CP group)")
        return self


def _error_line(error: Mapping[str, Any]) -> str:
    """One pydantic error as `field: message (got value)`; model-level errors already name their field."""
    if not error["loc"]:
        return error["msg"].removeprefix("Value error, ")
    field = ".".join(map(str, error["loc"]))
    if error["type"] == "extra_forbidden":
        return f"{field}: unknown field; allowed fields: {', '.join(CPConfig.model_fields)}"
    return f"{field}: {error['msg']} (got {error['input']!r})"


def parse_cp_config(fields: Mapping[str, Any]) -> CPConfig:
    """Build a CPConfig; a validation failure becomes one ValueError line naming field and allowed values."""
    try:
        return CPConfig(**fields)
    except ValidationError as err:
        raise ValueError("invalid CP config: " + "; ".join(map(_error_line, err.errors()))) from None


@dataclass(frozen=True)
class ResolvedCPConfig:
    """What the engine runs with; `impl` is never "auto"."""

    enabled: bool  # build CP metadata for prefill batches
    cp_size: int
    strategy: str | None  # "zigzag" | "interleave" (None only when CP is disabled)
    impl: str  # "legacy" | "v2"
    ep_size: int = 1  # 1 or cp_size

    @property
    def expert_parallel(self) -> bool:
        return self.ep_size > 1


def is_dsa_model(hf_config: Mapping[str, Any]) -> bool:
    """DeepSeek Sparse Attention models carry an indexer: `index_topk` in config.json."""
    return "index_topk" in hf_config


def is_mimo_v2_family(hf_config: Mapping[str, Any]) -> bool:
    if hf_config.get("model_type") in V2_FAMILY_MODEL_TYPES:
        return True
    architectures = hf_config.get("architectures") or ()
    return any(arch.startswith(MIMO_V2_ARCHITECTURE_PREFIX) for arch in architectures)


def is_multimodal(hf_config: Mapping[str, Any]) -> bool:
    return any(key in hf_config for key in MULTIMODAL_CONFIG_KEYS)


def default_cp_impl(cp: CPConfig, hf_config: Mapping[str, Any]) -> str:
    """The implementation chosen for cp_impl="auto".

    DSA models (MTP index-sharing ones such as GLM-5.2 included, they are not
    forced onto legacy): v2 only with prefill CP enabled and strategy
    interleave, else legacy. Non-DSA v2-family models: v2. Others: legacy.
    """
    if is_dsa_model(hf_config):
        return "v2" if cp.enable_prefill_cp and cp.cp_strategy == "interleave" else "legacy"
    return "v2" if is_mimo_v2_family(hf_config) else "legacy"


def _check_mimo_v2(cp: CPConfig, impl: str, hf_config: Mapping[str, Any]) -> None:
    """MiMo-V2 family with prefill CP under v2: zigzag only, text only."""
    if not (cp.enable_prefill_cp and impl == "v2" and is_mimo_v2_family(hf_config)):
        return
    if cp.cp_strategy != "zigzag":
        raise ValueError(
            f"cp_strategy={cp.cp_strategy!r} is not supported for MiMo-V2 models with cp_impl=v2;"
            " allowed values: 'zigzag'"
        )
    if is_multimodal(hf_config) and hf_config.get("language_only") is not True:
        raise ValueError(
            f"language_only={hf_config.get('language_only')!r} in the model config: multimodal MiMo-V2"
            " models with prefill CP and cp_impl=v2 must be text only; allowed values: true"
        )


def resolve_cp_config(cp: CPConfig, hf_config: Mapping[str, Any]) -> ResolvedCPConfig:
    """Resolve cp_impl="auto" once at start-up (an explicit cp_impl always wins) and check the family rules."""
    impl = default_cp_impl(cp, hf_config) if cp.cp_impl == "auto" else cp.cp_impl
    _check_mimo_v2(cp, impl, hf_config)
    _check_expert_split(cp.ep_size, hf_config)
    return ResolvedCPConfig(
        enabled=cp.enable_prefill_cp, cp_size=cp.cp_size, strategy=cp.cp_strategy, impl=impl, ep_size=cp.ep_size
    )


def _check_expert_split(ep_size: int, hf_config: Mapping[str, Any]) -> None:
    """ep_size must divide the model's routed experts: every rank owns the same contiguous block."""
    num_experts = hf_config.get("n_routed_experts") or 0
    if ep_size > 1 and num_experts % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide the model's n_routed_experts={num_experts}"
                         f" ({num_experts} % {ep_size} = {num_experts % ep_size}); allowed values: 1 or a divisor")


def resolve_cp_settings(settings: Any, model: ModelSpec) -> ResolvedCPConfig:
    """CP settings (CLI flags or ServeAppArgs: `cp_size`, `cp_strategy`, `cp_impl`, `ep_size`) resolved against the
    model's config.json as the edge read it, with prefill CP on; one-line errors naming the field."""
    fields = {"enable_prefill_cp": True, "cp_size": settings.cp_size, "cp_strategy": settings.cp_strategy,
              "cp_impl": settings.cp_impl, "ep_size": settings.ep_size}
    return resolve_cp_config(parse_cp_config(fields), model.raw)
