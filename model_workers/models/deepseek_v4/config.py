"""DeepSeek-V4 configuration (`model_type: deepseek_v4`): both config.json forms read once into a frozen dataclass.

Two spellings reach us (docs/models.md, 'Configuration'): the `transformers` form (`layer_types`,
`mlp_layer_types`, `compress_rates`, `partial_rotary_factor`, nested `rope_parameters` {"main", "compress"})
and the release form (`compress_ratios` with trailing MTP entries, `num_hash_layers`, `qk_rope_head_dim`, a flat
YaRN `rope_scaling` that applies to the compressed layers only, `compress_rope_theta`). Both fold into
`V4Config`; errors are one line naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model_workers.models.common.config_fields import (
    ModelConfigError,
    RopeSpec,
    eos_ids,
    fp8_block_size,
    required_int,
    rope_spec_from,
)

MODEL_TYPE = "deepseek_v4"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
RELEASE_RATIOS = {0: SLIDING, 4: CSA, 128: HCA}  # `compress_ratios` entries -> layer type
HASH_MOE, MOE = "hash_moe", "moe"


@dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # nope + rope; one shared K = V head
    qk_rope_head_dim: int  # trailing interleaved-RoPE channels of every head
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]  # per main layer, one of LAYER_TYPES
    compress_rates: dict[str, int]  # {CSA: m, HCA: m'}
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    main_rope: RopeSpec  # sliding-only layers: rope_theta, no YaRN
    compress_rope: RopeSpec  # CSA / HCA layers: compress_rope_theta with YaRN, attention factor 1
    max_position_embeddings: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]  # per main layer: HASH_MOE (tid2eid routing) or MOE
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    fp8_block_size: tuple[int, int] | None = None  # FP8 e4m3 linears: the ue8m0 scale's block
    expert_dtype: str | None = None  # routed experts as stored: "fp4", "fp8", or None (as the rest)
    model_type: str = MODEL_TYPE
    index_share_for_mtp_iteration: bool = False  # GLM-5.2's MTP top-k reuse; V4's MTP block is sliding-only

    def compress_rate(self, layer_id: int) -> int:
        """m of a main layer's compressor (0 for sliding-only layers and for MTP layers)."""
        if layer_id >= self.num_hidden_layers or self.layer_types[layer_id] == SLIDING:
            return 0
        return self.compress_rates[self.layer_types[layer_id]]


def parse_v4_config(raw: dict[str, Any]) -> V4Config:
    layers = required_int(raw, "num_hidden_layers")
    heads, head_dim = required_int(raw, "num_attention_heads"), required_int(raw, "head_dim")
    rope_dim = _rope_dim(raw, head_dim)
    config = V4Config(
        vocab_size=required_int(raw, "vocab_size"), hidden_size=required_int(raw, "hidden_size"),
        num_hidden_layers=layers, num_attention_heads=heads, head_dim=head_dim, qk_rope_head_dim=rope_dim,
        q_lora_rank=required_int(raw, "q_lora_rank"), o_groups=required_int(raw, "o_groups"),
        o_lora_rank=required_int(raw, "o_lora_rank"), sliding_window=required_int(raw, "sliding_window"),
        layer_types=_layer_types(raw, layers), compress_rates=_compress_rates(raw),
        index_n_heads=required_int(raw, "index_n_heads"), index_head_dim=required_int(raw, "index_head_dim"),
        index_topk=required_int(raw, "index_topk"), main_rope=_main_rope(raw), compress_rope=_compress_rope(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 1048576)),
        hc_mult=required_int(raw, "hc_mult"), hc_sinkhorn_iters=required_int(raw, "hc_sinkhorn_iters"),
        hc_eps=float(raw.get("hc_eps", 1e-6)), mlp_layer_types=_mlp_layer_types(raw, layers),
        n_routed_experts=required_int(raw, "n_routed_experts"),
        num_experts_per_tok=required_int(raw, "num_experts_per_tok"),
        moe_intermediate_size=required_int(raw, "moe_intermediate_size"),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids(raw.get("eos_token_id")), bos_token_id=raw.get("bos_token_id"),
        fp8_block_size=fp8_block_size(raw.get("quantization_config")), expert_dtype=_expert_dtype(raw),
    )
    _check(raw, config)
    return config


def _rope_dim(raw: dict[str, Any], head_dim: int) -> int:
    """`qk_rope_head_dim` (release) or `partial_rotary_factor` · head_dim (transformers)."""
    if raw.get("qk_rope_head_dim") is not None:
        return int(raw["qk_rope_head_dim"])
    main = (raw.get("rope_parameters") or {}).get("main") or {}
    factor = raw.get("partial_rotary_factor", main.get("partial_rotary_factor"))
    if factor is None:
        raise ModelConfigError("config.json needs qk_rope_head_dim or partial_rotary_factor (the RoPE channels)")
    return int(round(float(factor) * head_dim))


def _layer_types(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        ratios = list(raw["compress_ratios"])
        if len(ratios) < layers:
            raise ModelConfigError(f"config.json compress_ratios has {len(ratios)} entries for {layers} layers")
        bad = sorted({r for r in ratios if r not in RELEASE_RATIOS})
        if bad:
            raise ModelConfigError(f"config.json compress_ratios holds {bad}; allowed: 0, 4, 128")
        types = [RELEASE_RATIOS[r] for r in ratios[:layers]]  # trailing entries: MTP / extra slots, ignored
    if types is None:
        raise ModelConfigError("config.json needs layer_types or compress_ratios (the per-layer attention type)")
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ModelConfigError(f"config.json layer_types={types!r}: need {layers} entries of {', '.join(LAYER_TYPES)}")
    return tuple(types)


def _compress_rates(raw: dict[str, Any]) -> dict[str, int]:
    rates = dict(raw.get("compress_rates") or {})
    csa = int(rates.get(CSA, raw.get("compress_rate_csa", 4)))
    hca = int(rates.get(HCA, raw.get("compress_rate_hca", 128)))
    if csa < 1 or hca < 1:
        raise ModelConfigError(f"config.json compress_rates={{CSA: {csa}, HCA: {hca}}}: rates must be >= 1")
    return {CSA: csa, HCA: hca}


def _main_rope(raw: dict[str, Any]) -> RopeSpec:
    main = dict((raw.get("rope_parameters") or {}).get("main") or {})
    theta = float(main.get("rope_theta", raw.get("rope_theta", 10000.0)))
    return rope_spec_from(main, theta, raw)


def _compress_rope(raw: dict[str, Any]) -> RopeSpec:
    """The nested `rope_parameters.compress`, else the release's flat `rope_scaling` + `compress_rope_theta`;
    YaRN here never scales the attention (attention_factor 1)."""
    nested = (raw.get("rope_parameters") or {}).get("compress")
    params = dict(nested if nested is not None else raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("compress_rope_theta", 160000.0)))
    params.setdefault("attention_factor", 1.0)
    return rope_spec_from(params, theta, raw)


def _mlp_layer_types(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    types = raw.get("mlp_layer_types")
    if types is None:
        hashed = min(int(raw.get("num_hash_layers", 0) or 0), layers)
        types = [HASH_MOE] * hashed + [MOE] * (layers - hashed)
    if len(types) != layers or any(t not in (HASH_MOE, MOE) for t in types):
        raise ModelConfigError(f"config.json mlp_layer_types={types!r}: need {layers} entries of hash_moe / moe")
    return tuple(types)


def _expert_dtype(raw: dict[str, Any]) -> str | None:
    value = raw.get("expert_dtype", (raw.get("quantization_config") or {}).get("expert_dtype"))
    if value not in (None, "fp4", "fp8"):
        raise ModelConfigError(f"config.json expert_dtype={value!r}; allowed: fp4, fp8")
    return value


def _check(raw: dict[str, Any], config: V4Config) -> None:
    """The shape rules of the architecture (one line each, naming the field)."""
    rules = [
        (raw.get("num_key_value_heads", 1) == 1, f"num_key_value_heads={raw.get('num_key_value_heads')!r}; allowed: 1"),
        (raw.get("n_shared_experts", 1) == 1, f"n_shared_experts={raw.get('n_shared_experts')!r}; allowed: 1"),
        (raw.get("hidden_act", "silu") == "silu", f"hidden_act={raw.get('hidden_act')!r}; allowed: silu"),
        (raw.get("scoring_func", "sqrtsoftplus") == "sqrtsoftplus",
         f"scoring_func={raw.get('scoring_func')!r}; allowed: sqrtsoftplus"),
        (config.head_dim % 2 == 0 and config.qk_rope_head_dim % 2 == 0 and config.qk_rope_head_dim <= config.head_dim,
         f"head_dim={config.head_dim}, qk_rope_head_dim={config.qk_rope_head_dim}: both even, rope <= head_dim"),
        (config.index_head_dim >= config.qk_rope_head_dim,
         f"index_head_dim={config.index_head_dim} must be >= qk_rope_head_dim={config.qk_rope_head_dim}"),
        (config.num_attention_heads % config.o_groups == 0,
         f"num_attention_heads={config.num_attention_heads} must divide into o_groups={config.o_groups}"),
        (config.num_experts_per_tok <= config.n_routed_experts,
         f"num_experts_per_tok={config.num_experts_per_tok} exceeds n_routed_experts={config.n_routed_experts}"),
    ]
    for ok, message in rules:
        if not ok:
            raise ModelConfigError(f"config.json {message}")
