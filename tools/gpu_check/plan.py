"""What the check runs, per mode: DeepSeek-V3.2 / GLM-5 shapes on a GPU ("gpu"), tiny shapes in Triton's interpreter
on a CPU ("dry", float32: the interpreter's bf16 arithmetic is not a GPU's), small launches of the real shapes on a
GPU under compute-sanitizer ("sanitizer"). Kernel cases come most important first (the issue's targets, then one
case of every kernel), so the deadline drops the least important ones; the extra cases (longer contexts, larger
batches) run after the model section, as time allows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MlaCase:
    label: str  # v32 (128 heads), glm5 (64 heads), tiny
    heads: int
    latent: int
    rope: int
    topk: int
    rows: int  # decode: requests of one query each; prefill: the queries of one request's chunk
    context: int  # keys of a request, the chunk's own included
    fp8: bool
    prefill: bool
    est_s: float = 8.0
    target: float | None = None  # issue target: this fraction of the matmul ceiling
    kind: str = "sparse_mla"

    @property
    def name(self) -> str:
        phase = f"prefill {self.rows} rows" if self.prefill else f"decode b{self.rows}"
        return f"sparse_mla {phase} {self.label} {'fp8' if self.fp8 else 'plain'} ctx {self.context}"


@dataclass(frozen=True)
class IndexerCase:
    label: str
    heads: int
    dim: int
    requests: int
    rows: int  # query rows per request (decode: 1; prefill: the chunk, sharing the request's keys)
    context: int
    topk: int
    fp8: bool
    est_s: float = 8.0
    target: float | None = None  # issue target: this fraction of the copy bandwidth ceiling
    kind: str = "indexer"

    @property
    def prefill(self) -> bool:
        return self.rows > 1

    @property
    def name(self) -> str:
        phase = f"prefill {self.rows} rows" if self.prefill else f"decode b{self.requests}"
        return f"indexer+topk {phase} {self.label} {'fp8' if self.fp8 else 'plain'} ctx {self.context}"


@dataclass(frozen=True)
class RowsCase:
    label: str  # latent (c_kv + k_pe) or index_key
    rows: int
    quantized: int
    plain: int
    est_s: float = 3.0
    kind: str = "fp8_rows"

    @property
    def name(self) -> str:
        return f"fp8_rows {self.label} {self.quantized}+{self.plain} x{self.rows}"


@dataclass(frozen=True)
class ExpertCase:
    label: str
    hidden: int
    inner: int
    experts: int
    top_k: int
    rows: int
    fp8: bool
    est_s: float = 8.0
    kind: str = "experts"

    @property
    def name(self) -> str:
        return f"experts {'fp8-block' if self.fp8 else 'dense'} {self.label} T{self.rows} E{self.experts}"


@dataclass(frozen=True)
class ModelPlan:
    name: str  # default | v32_random
    context: int  # tokens of each request before the timed decode steps
    batches: tuple[int, ...]
    warmup_steps: int
    timed_steps: int
    prefill_len: int
    prefill_reps: int
    page_size: int
    prefill_group: int  # requests per prefill forward while filling the contexts


@dataclass(frozen=True)
class Plan:
    mode: str
    dtype: torch.dtype
    rel_tol: float  # comparisons: max abs error <= rel_tol x max |reference|
    reps: int
    target_ms: float
    copy_mb: int
    host_mb: int
    matmul_n: int
    kernel_cases: tuple  # the core cases, most important first
    extra_cases: tuple  # run after the model section, as time allows
    models: tuple[ModelPlan, ...]
    v32_config: dict
    budget_s: float


def v32_config(tiny: bool, experts: int = 256) -> dict:
    """A 2-layer DeepSeek-V3.2 config.json (transformers' DeepseekV32Config defaults; layer 0 dense, layer 1 MoE;
    the release's YaRN rope), or a tiny one for the interpreter."""
    raw = dict(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], vocab_size=129280,
               hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=2,
               num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=experts,
               routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
               qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=1,
               norm_topk_prob=True, hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6,
               tie_word_embeddings=False, index_head_dim=128, index_n_heads=64, index_topk=2048,
               attention_bias=False, num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1,
               rope_scaling={"type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
               rope_theta=10000.0)
    if tiny:
        raw.update(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                   num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8, kv_lora_rank=64, q_lora_rank=64,
                   qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
                   num_experts_per_tok=2, index_head_dim=32, index_n_heads=4, index_topk=16)
    return raw


def _gpu_kernel_cases() -> tuple[tuple, tuple]:
    """(core: the targets and one case of every kernel at V3.2 / GLM-5 shapes; extra: more contexts and sizes)."""
    v32 = dict(label="v32", heads=128, latent=512, rope=64, topk=2048)
    glm = dict(label="glm5", heads=64, latent=512, rope=64, topk=2048)
    idx = dict(label="v32", heads=64, dim=128, topk=2048)
    core = (
        MlaCase(**v32, rows=32, context=32768, fp8=True, prefill=False, est_s=25, target=0.40),
        MlaCase(**v32, rows=8192, context=16384, fp8=True, prefill=True, est_s=25, target=0.40),
        IndexerCase(**idx, requests=32, rows=1, context=32768, fp8=True, est_s=20, target=0.50),
        RowsCase("latent", 65536, 512, 64, est_s=8), RowsCase("index_key", 65536, 128, 0, est_s=5),
        ExpertCase("v32", 7168, 2048, 64, 8, 32, fp8=False, est_s=15),
        ExpertCase("v32", 7168, 2048, 64, 8, 32, fp8=True, est_s=15),
        MlaCase(**v32, rows=32, context=32768, fp8=False, prefill=False, est_s=15),
        IndexerCase(**idx, requests=32, rows=1, context=32768, fp8=False, est_s=12),
        MlaCase(**v32, rows=1, context=32768, fp8=True, prefill=False, est_s=10),
        MlaCase(**v32, rows=8192, context=16384, fp8=False, prefill=True, est_s=20),
        MlaCase(**glm, rows=32, context=32768, fp8=True, prefill=False, est_s=6),
        MlaCase(**glm, rows=1, context=32768, fp8=False, prefill=False, est_s=10),
        IndexerCase(**idx, requests=1, rows=8192, context=8192, fp8=True, est_s=20),
    )
    extra = (
        MlaCase(**glm, rows=8192, context=16384, fp8=True, prefill=True, est_s=15),
        ExpertCase("v32", 7168, 2048, 64, 8, 4096, fp8=False, est_s=15),
        ExpertCase("v32", 7168, 2048, 64, 8, 4096, fp8=True, est_s=15),
        MlaCase(**v32, rows=32, context=8192, fp8=True, prefill=False, est_s=6),
        MlaCase(**v32, rows=32, context=131072, fp8=True, prefill=False, est_s=10),
        MlaCase(**v32, rows=32, context=131072, fp8=False, prefill=False, est_s=12),
        MlaCase(**v32, rows=1, context=131072, fp8=True, prefill=False, est_s=6),
        IndexerCase(**idx, requests=32, rows=1, context=131072, fp8=True, est_s=20),
    )
    return core, extra


def _tiny_kernel_cases() -> tuple[tuple, tuple]:
    tiny = dict(label="tiny", heads=16, latent=64, rope=32, topk=32)
    idx = dict(label="tiny", heads=4, dim=32, topk=16)
    core = (
        MlaCase(**tiny, rows=2, context=48, fp8=True, prefill=False, est_s=2, target=0.40),
        MlaCase(**tiny, rows=6, context=40, fp8=True, prefill=True, est_s=2, target=0.40),
        IndexerCase(**idx, requests=2, rows=1, context=96, fp8=True, est_s=2, target=0.50),
        RowsCase("latent", 40, 64, 32, est_s=1), RowsCase("index_key", 40, 32, 0, est_s=1),
        ExpertCase("tiny", 64, 48, 8, 2, 3, fp8=False, est_s=2),
        ExpertCase("tiny", 160, 72, 4, 2, 3, fp8=True, est_s=2),
        MlaCase(**tiny, rows=1, context=48, fp8=False, prefill=False, est_s=2),
        IndexerCase(**idx, requests=2, rows=1, context=96, fp8=False, est_s=2),
        MlaCase(**tiny, rows=6, context=40, fp8=False, prefill=True, est_s=2),
        IndexerCase(**idx, requests=1, rows=6, context=70, fp8=True, est_s=2),
    )
    extra = (
        MlaCase(label="tiny64h", heads=64, latent=32, rope=16, topk=16, rows=1, context=24, fp8=True, prefill=False,
                est_s=2),
        ExpertCase("tiny", 64, 48, 8, 2, 40, fp8=False, est_s=2),
    )
    return core, extra


def _sanitizer_cases() -> tuple[tuple, tuple]:
    """V3.2 / GLM-5 dims at small counts (multiples of 16, as the real launches): the kernels the GPU run compiled,
    so the memcheck pass mostly reuses Triton's cache and spends its time on the launches."""
    v32 = dict(label="v32-small", heads=128, latent=512, rope=64, topk=64)
    idx = dict(label="v32-small", heads=64, dim=128, topk=64)
    core = (
        MlaCase(**v32, rows=2, context=256, fp8=True, prefill=False),
        MlaCase(**v32, rows=8, context=128, fp8=True, prefill=True),
        MlaCase(**v32, rows=32, context=256, fp8=False, prefill=False),
        MlaCase(**v32, rows=8, context=128, fp8=False, prefill=True),
        MlaCase(label="glm5-small", heads=64, latent=512, rope=64, topk=64, rows=1, context=256, fp8=False,
                prefill=False),
        IndexerCase(**idx, requests=2, rows=1, context=256, fp8=True),
        IndexerCase(**idx, requests=2, rows=1, context=256, fp8=False),
        IndexerCase(**idx, requests=1, rows=16, context=128, fp8=True),
        RowsCase("latent", 48, 512, 64), RowsCase("index_key", 48, 128, 0),
        ExpertCase("v32-small", 7168, 2048, 4, 2, 3, fp8=False),
        ExpertCase("v32-small", 7168, 2048, 4, 2, 3, fp8=True),
    )
    return core, ()


def plan_for(mode: str) -> Plan:
    if mode == "gpu":
        models = (ModelPlan("default", 1024, (1, 32), 3, 12, 8192, 2, 64, 32),
                  ModelPlan("v32_random", 2304, (1, 32), 2, 8, 8192, 1, 64, 4))
        return Plan(mode, torch.bfloat16, 2.0 ** -6, 5, 20.0, 1024, 256, 8192, *_gpu_kernel_cases(), models,
                    v32_config(tiny=False), budget_s=370.0)
    tiny_models = (ModelPlan("default", 5, (1, 2), 0, 1, 8, 1, 8, 2),
                   ModelPlan("v32_random", 20, (1, 2), 0, 1, 20, 1, 8, 2))
    if mode == "dry":
        return Plan(mode, torch.float32, 1e-4, 2, 1.0, 32, 0, 256, *_tiny_kernel_cases(), tiny_models,
                    v32_config(tiny=True), budget_s=240.0)
    if mode == "sanitizer":
        return Plan(mode, torch.bfloat16, 2.0 ** -6, 1, 1.0, 0, 0, 0, *_sanitizer_cases(), (),
                    v32_config(tiny=True), budget_s=300.0)
    raise ValueError(f"mode must be gpu, dry or sanitizer, got {mode!r}")
