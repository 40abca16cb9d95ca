"""The whole model on the Triton kernel set, in Triton's interpreter on CPU: greedy tokens equal the torch kernel
set's for DeepSeek-V3.2 (the default model through `generate`, and a tiny random one with an MTP layer, at C = 1
and over a C = 2 CP group), GLM-5 with shared-indexer layers and DeepSeek-V4, both KV formats, and MTP
speculation — prompts longer than index_topk, so the indexer selects. Float32 (the interpreter's bf16 arithmetic
is not a GPU's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cluster.engine_setup import run_all, start_local_engine
from cluster.engine_spec import EngineOptions
from support.engines import make_requests


def tokens(folder, backend: str, kv_cache_dtype: str = "auto", k: int = 0, lens=(70, 20), max_tokens: int = 4,
           vocab: int = 128) -> list[list[int]]:
    options = EngineOptions("float32", num_pages=16, page_size=16, num_speculative_steps=k,
                            kv_cache_dtype=kv_cache_dtype, attention_backend=backend)
    requests = make_requests(list(lens), max_tokens, vocab, prompt_seed=3, temperature=0.0, ignore_eos=True)
    return [result["token_ids"] for result in run_all(start_local_engine(folder, options), requests)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_mtp_speculation_on_triton_is_the_torch_plain_decode(reference_checkpoint, kv_cache_dtype):
    _, folder = reference_checkpoint("v32", mtp=True)  # index_topk 8
    plain = tokens(folder, "torch", kv_cache_dtype, lens=(20, 11), max_tokens=8)
    assert tokens(folder, "triton", kv_cache_dtype, k=2, lens=(20, 11), max_tokens=8) == plain


def test_glm5_shared_indexer_layers_decode_the_torch_tokens(reference_checkpoint):
    _, folder = reference_checkpoint("glm_shared")  # index_topk 6, layers 1 and 3 reuse the top-k before them
    assert tokens(folder, "triton", lens=(18, 9), max_tokens=8) == tokens(folder, "torch", lens=(18, 9), max_tokens=8)


def test_generate_with_the_triton_backend_in_the_interpreter_prints_the_torch_tokens():
    """`TRITON_INTERPRET=1 dsa-serve generate --attention-backend triton` on the default model with FP8 rows (16
    heads, index_topk 64: the 70-token prompt is scored and selected)."""
    prompt = ",".join(str(3 + 7 * i % 500) for i in range(70))
    runs = []
    for backend in ("triton", "torch"):
        done = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--prompt-ids", prompt,
                               "--max-tokens", "3", "--dtype", "float32", "--kv-cache-dtype", "fp8_e4m3",
                               "--attention-backend", backend, "--json"],
                              env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout)["token_ids"])
    assert runs[0] == runs[1] and len(runs[0]) == 3


def test_deepseek_v4_on_the_triton_set_decodes_the_torch_tokens(tmp_path):
    """V4's attention stays on its torch code under the Triton set (docs/gpu.md); its routed experts run the
    grouped-GEMM kernels (the quantized checkpoint's experts are dequantized at load; the kernels' FP8-weight path
    is tested in test_triton_experts.py), with MTP k = 1."""
    from support.v4_checkpoints import v4_checkpoint_with_mtp

    _, _, folder = v4_checkpoint_with_mtp(tmp_path / "v4", quantized=True)
    plain = tokens(folder, "torch", lens=(20, 9), max_tokens=6)
    assert tokens(folder, "triton", k=1, lens=(20, 9), max_tokens=6) == plain


def test_cp2_prefill_with_mtp_on_the_triton_set_decodes_the_torch_tokens(reference_checkpoint):
    """A C = 2 group (Ray + gloo, zigzag) whose ranks run the Triton set in the interpreter: the CP prefill's
    gathered rows feed the same kernels, and MTP k = 2 then gives the single-rank torch tokens."""
    import ray

    from cluster.config import ResolvedCPConfig
    from cluster.engine_setup import engine_over_workers
    from cluster.engine_spec import resolve_engine_spec
    from cluster.launch import engine_cpus, launch_group, start_ray

    _, folder = reference_checkpoint("v32", mtp=True)
    cp = ResolvedCPConfig(enabled=True, cp_size=2, strategy="zigzag", impl="v2")
    options = EngineOptions("float32", num_pages=16, page_size=16, num_speculative_steps=2,
                            attention_backend="triton")
    start_ray(min_cpus=engine_cpus(cp.cp_size))
    launched = launch_group(folder, cp, "float32", 16, 16, attention_backend="triton")
    try:
        engine = engine_over_workers(resolve_engine_spec(folder, cp, options), launched.workers)
        requests = make_requests([20, 11], 8, 128, prompt_seed=3, temperature=0.0, ignore_eos=True)
        got = [result["token_ids"] for result in run_all(engine, requests)]
    finally:
        launched.shutdown()
        ray.shutdown()
    assert got == tokens(folder, "torch", lens=(20, 11), max_tokens=8)
