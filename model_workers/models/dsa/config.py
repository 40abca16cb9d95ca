"""The DSA family's configuration (DeepSeek-V3.2, GLM-5): a Hugging Face `config.json` parsed into a frozen dataclass.

Every field the DSA reference implementations use is read here; nothing downstream looks at the raw dict.
Errors name the field and what was expected, in one line.
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

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")  # DeepSeek-V3.2, GLM-5 / GLM-5.2
GLM_MODEL_TYPE = "glm_moe_dsa"


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse" per layer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]  # "full" | "shared" per layer
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    attention_bias: bool
    tie_word_embeddings: bool
    num_nextn_predict_layers: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    fp8_block_size: tuple[int, int] | None  # DeepSeek block-quantized FP8 weights, e.g. (128, 128)
    index_share_for_mtp_iteration: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the MLA cache: c_kv ‖ k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def interleaved_index_rope(self) -> bool:
        """GLM's indexer rotates interleaved pairs; DeepSeek-V3.2's uses the half-split layout."""
        return self.model_type == GLM_MODEL_TYPE


def parse_dsa_config(raw: dict[str, Any]) -> ModelConfig:
    """config.json of a DeepSeek-V3.2 / GLM-5 checkpoint (its model_type one of MODEL_TYPES) as a `ModelConfig`."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelConfigError(f"config.json model_type={model_type!r} is not a DSA model; allowed: "
                               f"{', '.join(MODEL_TYPES)}")
    if raw.get("q_lora_rank") is None:
        raise ModelConfigError("config.json q_lora_rank is required by DSA models (the indexer reads q_a's output)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"config.json hidden_act={act!r} is not supported; allowed: silu")
    layers = required_int(raw, "num_hidden_layers")
    return ModelConfig(
        model_type=model_type,
        vocab_size=required_int(raw, "vocab_size"),
        hidden_size=required_int(raw, "hidden_size"),
        intermediate_size=required_int(raw, "intermediate_size"),
        moe_intermediate_size=required_int(raw, "moe_intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=required_int(raw, "num_attention_heads"),
        q_lora_rank=required_int(raw, "q_lora_rank"),
        kv_lora_rank=required_int(raw, "kv_lora_rank"),
        qk_nope_head_dim=required_int(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=required_int(raw, "qk_rope_head_dim"),
        v_head_dim=required_int(raw, "v_head_dim"),
        n_routed_experts=int(raw.get("n_routed_experts") or raw.get("num_experts") or 0),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        mlp_layer_types=_mlp_layer_types(raw, layers),
        index_n_heads=required_int(raw, "index_n_heads"),
        index_head_dim=required_int(raw, "index_head_dim"),
        index_topk=required_int(raw, "index_topk"),
        indexer_types=_indexer_types(raw, layers),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_spec(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        attention_bias=bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        eos_token_ids=eos_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
        fp8_block_size=fp8_block_size(raw.get("quantization_config")),
        index_share_for_mtp_iteration=bool(raw.get("index_share_for_mtp_iteration", False)),
    )


def _mlp_layer_types(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    types = raw.get("mlp_layer_types")
    if types is None:
        n_dense = min(int(raw.get("first_k_dense_replace", 0) or 0), layers)
        types = ["dense"] * n_dense + ["sparse"] * (layers - n_dense)
    if len(types) != layers or any(t not in ("dense", "sparse") for t in types):
        raise ModelConfigError(f"config.json mlp_layer_types={types!r}: need {layers} entries of 'dense' / 'sparse'")
    return tuple(types)


def _indexer_types(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    types = raw.get("indexer_types")
    if types is None and raw.get("index_topk_pattern") is not None:
        pattern = raw["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None and raw.get("model_type") == GLM_MODEL_TYPE:
        freq = max(int(raw.get("index_topk_freq", 1)), 1)
        offset = int(raw.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if types is None:
        types = ["full"] * layers
    if len(types) != layers or any(t not in ("full", "shared") for t in types) or types[0] != "full":
        raise ModelConfigError(
            f"config.json indexer_types={types!r}: need {layers} entries of 'full' / 'shared', the first 'full'"
        )
    return tuple(types)


def _rope_spec(raw: dict[str, Any]) -> RopeSpec:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    return rope_spec_from(params, theta, raw)
