"""Field parsers both config families share (DSA `ModelConfig`, DeepSeek-V4 `V4Config`): one-line errors that
name the field, the RoPE spec, EOS ids and the FP8 block size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ModelConfigError(ValueError):
    """A checkpoint's config.json cannot be served; the message names the field."""


@dataclass(frozen=True)
class RopeSpec:
    """RoPE parameters after normalising the `rope_parameters` / legacy `rope_scaling` spellings."""

    rope_type: str  # "default" | "yarn"
    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def required_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"config.json {key}={value!r}: a positive integer is required")
    return value


def rope_spec_from(params: dict[str, Any], theta: float, raw: dict[str, Any]) -> RopeSpec:
    """A RoPE spec from one `rope_parameters` / `rope_scaling` dict (`default` or `yarn`) and its theta."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeSpec(rope_type="default", theta=theta)
    if rope_type != "yarn":
        raise ModelConfigError(f"config.json rope_parameters.rope_type={rope_type!r}; allowed: default, yarn")
    max_pos = int(raw.get("max_position_embeddings", 4096))
    original = int(params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings") or max_pos)
    factor = params.get("factor")
    return RopeSpec(
        rope_type="yarn",
        theta=theta,
        factor=float(factor) if factor is not None else max_pos / original,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def fp8_block_size(quant: dict[str, Any] | None) -> tuple[int, int] | None:
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "fp8":
        raise ModelConfigError(f"config.json quantization_config.quant_method={method!r}; allowed: fp8")
    block = quant.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])
