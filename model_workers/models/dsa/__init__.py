"""The DSA family: DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 / GLM-5.2 (`glm_moe_dsa`) — MLA with the lightning
indexer and sparse top-k attention, DeepSeek MoE, MTP (NextN) layers (docs/models.md, 'DeepSeek-V3.2 and GLM-5').

`FAMILY` is this folder's entry in models/registry.py: config.py parses, model.py is the model, cache.py /
batch.py / backend.py run it over paged KV, checkpoint.py maps checkpoint names, capacity.py counts bytes.
"""

from model_workers.kv_format import KV_CACHE_DTYPES
from model_workers.models.dsa import backend, batch, cache, capacity, checkpoint, config, flops
from model_workers.models.family import ModelFamily

FAMILY = ModelFamily(
    name="dsa",
    title="DeepSeek-V3.2 / GLM-5",
    model_types=config.MODEL_TYPES,
    parse_config=config.parse_dsa_config,
    build_model=checkpoint.build_model,
    checkpoint_entries=checkpoint.checkpoint_entries,
    fp32_param_suffixes=checkpoint.FP32_PARAM_SUFFIXES,
    make_cache=cache.make_cache,
    make_backend=backend.DSABackend,
    local_batch=batch.local_batch,
    cp_batch=batch.cp_batch,
    kv_cache_dtypes=KV_CACHE_DTYPES,
    batch_invariant=True,
    checkpoint_tensors=capacity.checkpoint_tensor_list,
    plan_kv_dtypes=capacity.PLAN_KV_DTYPES,
    cache_bytes_per_token=capacity.kv_bytes_per_token,
    gather_bytes_per_token=capacity.kv_bytes_per_token,  # CP gathers move each token's stored KV rows
    kv_plan=capacity.kv_plan,
    kv_formulas=capacity.kv_formulas,
    kv_summary=capacity.kv_summary,
    prefill_flops=flops.prefill_flops,
    graph_batch=batch.ForwardBatch,
)
