"""The DeepSeek-V4 family (`deepseek_v4`): sliding-window attention with compressed (CSA / HCA) entries, the
lightning indexer over compressed keys, hyper-connection residual streams, hash-routed and learned MoE, an MTP
block (docs/models.md, 'DeepSeek-V4').

`FAMILY` is this folder's entry in models/registry.py: config.py parses both config.json spellings, model.py is
the model, cache.py / backend.py keep its paged entries and bounded per-request state, names.py and
checkpoint.py map its checkpoint names, capacity.py counts bytes, random_checkpoint.py writes random ones.
"""

from model_workers.models.deepseek_v4 import backend, cache, capacity, checkpoint, config, random_checkpoint
from model_workers.models.family import ModelFamily


def gather_bytes_per_token(v4_config: config.V4Config, kv_dtype: str) -> int:
    """What CP prefill all-gathers per token (cache.gather_bytes_per_token) with the config's MTP blocks."""
    return cache.gather_bytes_per_token(v4_config, v4_config.num_nextn_predict_layers,
                                        capacity.ELEMENT_BYTES[kv_dtype])


FAMILY = ModelFamily(
    name="deepseek_v4",
    title="DeepSeek-V4",
    model_types=(config.MODEL_TYPE,),
    parse_config=config.parse_v4_config,
    build_model=checkpoint.build_model,
    checkpoint_entries=checkpoint.checkpoint_entries,
    fp32_param_suffixes=checkpoint.FP32_PARAM_SUFFIXES,
    make_cache=cache.make_cache,
    make_backend=backend.V4Backend,
    local_batch=backend.local_batch,
    cp_batch=backend.cp_batch,
    kv_cache_dtypes=("auto", "bfloat16"),  # its compressed entries stay in a float dtype (no FP8 layout yet)
    batch_invariant=False,  # its compressed attention pools data-dependent shapes
    checkpoint_tensors=capacity.checkpoint_tensor_list,
    plan_kv_dtypes=capacity.PLAN_KV_DTYPES,
    cache_bytes_per_token=capacity.cache_bytes_per_token,
    gather_bytes_per_token=gather_bytes_per_token,
    kv_plan=capacity.kv_plan,
    kv_formulas=capacity.kv_formulas,
    kv_summary=capacity.kv_summary,
    random_checkpoint=random_checkpoint.write_random_v4,
    random_shapes=tuple(random_checkpoint.SHAPES),
    prefix_hit_rule=cache.prefix_hit_rule,
)
