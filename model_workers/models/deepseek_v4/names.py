"""DeepSeek-V4 checkpoint names and formats (docs/models.md, 'Checkpoint formats').

Three spellings reach the loader, all mapped here onto our module names (which are `transformers`' module
names): the module names themselves (`model.layers.i.self_attn.q_a_proj.weight`, what `state_dict()` holds),
the release names (`layers.i.attn.wq_a.weight`, `embed.weight`, `head.weight`, `hc_head_fn`, `mtp.0.*` with
`e_proj` / `h_proj`), and the mix `transformers`' `save_pretrained` writes (release names under `model.`, with
`embed_tokens`, `hc_head.hc_*` and the main kv norm as `attn.norm`). Release FP8 linears carry a ue8m0
`.scale` per 128×128 block; routed experts may be FP4 (model_workers/checkpoint/quantized.py reads both).
"""

from __future__ import annotations

import re

_LAYER = re.compile(r"^(?:model\.)?(layers|mtp)\.(\d+)\.(.+)$")
_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight",
        "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
        "hc_head_scale": "model.hc_head.hc_scale", "model.head.weight": "lm_head.weight"}
# Inside a block, in order: (release / save_pretrained pattern, module name). Anchored at the block's start.
_BLOCK = [
    (r"attn_norm\.", "input_layernorm."), (r"ffn_norm\.", "post_attention_layernorm."),
    (r"hc_attn_(fn|base|scale)$", r"attn_hc.\1"), (r"hc_ffn_(fn|base|scale)$", r"ffn_hc.\1"),
    (r"attn\.attn_sink$", "self_attn.sinks"),
    (r"attn\.indexer\.compressor\.", "self_attn.compressor.indexer."),
    (r"attn\.indexer\.wq_b\.", "self_attn.compressor.indexer.q_b_proj."),
    (r"attn\.indexer\.weights_proj\.", "self_attn.compressor.indexer.scorer.weights_proj."),
    (r"attn\.(wq_a|q_norm|wq_b|wkv|kv_norm|norm|wo_a|wo_b)\.", lambda m: f"self_attn.{_ATTN[m.group(1)]}."),
    (r"attn\.", "self_attn."),
    (r"ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"ffn\.experts\.(\d+)\.(w[123])\.", lambda m: f"mlp.experts.{m.group(1)}.{_SWIGLU[m.group(2)]}."),
    (r"ffn\.shared_experts\.(w[123])\.", lambda m: f"mlp.shared_experts.{_SWIGLU[m.group(1)]}."),
    (r"ffn\.", "mlp."),
    (r"hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),  # the MTP block's own head
]
_ATTN = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj", "kv_norm": "kv_norm",
         "norm": "kv_norm", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
_COMPRESSOR = {"wkv.": "kv_proj.", "wgate.": "gate_proj.", "norm.": "kv_norm.", "ape": "position_bias"}
_SWIGLU = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_MTP_SHARED = re.compile(r"^(emb|head)\.")  # MTP copies of the shared embedding / head: not read
# Release tensors stored FP8 e4m3 with a ue8m0 scale per 128×128 block; routed experts: `expert_dtype`.
FP8_RELEASE = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123]|e_proj|h_proj)"
                         r"\.weight$")


def module_name(name: str, num_hidden_layers: int) -> str | None:
    """Our parameter name for checkpoint tensor `name` (its scale: the weight's name + `_scale_inv`), or None
    for tensors a V4 model does not read (MTP copies of the embedding / head)."""
    is_scale = name.endswith(".weight_scale_inv") or (name.endswith(".scale") and not name.endswith("_hc.scale"))
    base = re.sub(r"\.(scale|weight_scale_inv)$", ".weight", name) if is_scale else name
    if base in _TOP:
        base = _TOP[base]
    match = _LAYER.match(base)
    if match and (not base.startswith("model.layers.") or _is_release_block(match.group(3))):
        kind, index, rest = match.groups()
        if kind == "mtp" and _MTP_SHARED.match(rest):
            return None
        layer = int(index) + (num_hidden_layers if kind == "mtp" else 0)
        base = f"model.layers.{layer}.{_block_name(rest)}"
    return base + "_scale_inv" if is_scale else base


def _is_release_block(rest: str) -> bool:
    return rest.startswith(("attn.", "ffn.", "attn_norm", "ffn_norm", "hc_attn_", "hc_ffn_", "hc_head_"))


def _block_name(rest: str) -> str:
    for pattern, replacement in _BLOCK:
        renamed, count = re.subn("^" + pattern, replacement, rest)
        if count:
            rest = renamed
            break
    if rest.startswith("self_attn.compressor."):  # the compressors' own weight names
        head, _, tail = rest.partition("compressor.")
        prefix = "compressor.indexer." if tail.startswith("indexer.") else "compressor."
        tail = tail.removeprefix("indexer.")
        for old, new in _COMPRESSOR.items():
            if tail.startswith(old):
                tail = new + tail[len(old):]
                break
        rest = head + prefix + tail
    return rest


_TO_RELEASE = [  # our module names -> release names: the first pattern that matches inside a block
    (r"input_layernorm\.", "attn_norm."), (r"post_attention_layernorm\.", "ffn_norm."),
    (r"attn_hc\.(fn|base|scale)$", r"hc_attn_\1"), (r"ffn_hc\.(fn|base|scale)$", r"hc_ffn_\1"),
    (r"self_attn\.sinks$", "attn.attn_sink"),
    (r"self_attn\.compressor\.indexer\.q_b_proj\.", "attn.indexer.wq_b."),
    (r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.", "attn.indexer.weights_proj."),
    (r"self_attn\.compressor\.indexer\.", "attn.indexer.compressor."),
    (r"self_attn\.compressor\.", "attn.compressor."),
    (r"self_attn\.q_a_proj\.", "attn.wq_a."), (r"self_attn\.q_a_norm\.", "attn.q_norm."),
    (r"self_attn\.q_b_proj\.", "attn.wq_b."), (r"self_attn\.kv_proj\.", "attn.wkv."),
    (r"self_attn\.kv_norm\.", "attn.kv_norm."), (r"self_attn\.o_a_proj\.", "attn.wo_a."),
    (r"self_attn\.o_b_proj\.", "attn.wo_b."),
    (r"mlp\.gate\.e_score_correction_bias$", "ffn.gate.bias"), (r"mlp\.gate\.", "ffn.gate."),
    (r"mlp\.experts\.(\d+)\.gate_proj\.", r"ffn.experts.\1.w1."),
    (r"mlp\.experts\.(\d+)\.down_proj\.", r"ffn.experts.\1.w2."),
    (r"mlp\.experts\.(\d+)\.up_proj\.", r"ffn.experts.\1.w3."),
    (r"mlp\.shared_experts\.gate_proj\.", "ffn.shared_experts.w1."),
    (r"mlp\.shared_experts\.down_proj\.", "ffn.shared_experts.w2."),
    (r"mlp\.shared_experts\.up_proj\.", "ffn.shared_experts.w3."),
    (r"hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"mlp\.", "ffn."), (r"self_attn\.", "attn."),
]
_RELEASE_COMPRESSOR = [(r"kv_proj\.", "wkv."), (r"gate_proj\.", "wgate."), (r"kv_norm\.", "norm."),
                       (r"position_bias$", "ape")]


def release_name(name: str, num_layers: int) -> str:
    """The release name of our (transformers') tensor `name`: `module_name`'s inverse (per-expert names in)."""
    top = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
           "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    if name in top:
        return top[name]
    layer, rest = re.match(r"model\.layers\.(\d+)\.(.+)$", name).groups()
    for pattern, replacement in _TO_RELEASE:
        rest, count = re.subn("^" + pattern, replacement, rest)
        if count:
            break
    if ".compressor." in rest:
        head, tail = rest.rsplit("compressor.", 1)
        for pattern, replacement in _RELEASE_COMPRESSOR:
            tail = re.sub("^" + pattern, replacement, tail)
        rest = head + "compressor." + tail
    layer = int(layer)
    return f"mtp.{layer - num_layers}.{rest}" if layer >= num_layers else f"layers.{layer}.{rest}"


def count_v4_mtp_layers(names: set[str], num_hidden_layers: int) -> int:
    count = 0
    while (f"mtp.{count}.e_proj.weight" in names
           or f"model.layers.{num_hidden_layers + count}.e_proj.weight" in names):
        count += 1
    return count
