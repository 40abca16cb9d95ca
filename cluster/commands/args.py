"""Command-line options shared by the sub-commands, with their allowed values taken from `cluster.config`."""

from __future__ import annotations

import argparse
from typing import get_args

import torch

from cluster.commands.aliases import add_speculative_aliases
from cluster.config import (
    MAX_SPECULATIVE_STEPS,
    AttentionBackendName,
    CPImplName,
    CPStrategyName,
    DeviceName,
    DTypeName,
    KVCacheDTypeName,
)
from cluster.engine_limits import add_limit_arguments
from model_workers.kernels.registry import DEFAULT_ATTENTION_BACKEND
from cluster.http_api.reasoning import REASONING_PARSERS
from cluster.http_api.tool_parsers import TOOL_CALL_PARSERS
from cluster.serve_settings import EnginePlacement


def add_cp_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument("--cp-size", "--attn-cp-size", dest="cp_size", type=int, required=required, default=None,
                        help="context-parallel ranks (one Ray actor each); runs through Ray when given")
    parser.add_argument("--enable-prefill-cp", action="store_true",
                        help="SGLang's flag: accepted; prefill CP is on whenever --cp-size > 1")
    parser.add_argument("--cp-strategy", choices=get_args(CPStrategyName), default="interleave",
                        help="interleave (default, as SGLang advises for DSA models) or zigzag")
    parser.add_argument("--cp-impl", choices=get_args(CPImplName), default="auto")
    parser.add_argument("--ep-size", type=int, default=1,
                        help="expert parallelism: 1 (every rank holds every expert) or the cp size (each rank"
                             " holds n_routed_experts / cp_size experts; decode runs in lockstep)")
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")


def add_dtype_argument(parser: argparse.ArgumentParser, default: str, allow_auto: bool = True) -> None:
    """--dtype; `allow_auto=False` for benchmarks, which name the precision they measure."""
    choices = [name for name in get_args(DTypeName) if allow_auto or name != "auto"]
    parser.add_argument("--dtype", choices=choices, default=default,
                        help="weights and KV cache as stored: auto = the checkpoint's (bf16 on CUDA); bfloat16"
                             " computes in float32 on CPUs without bf16")


def add_kv_cache_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-dtype", choices=get_args(KVCacheDTypeName), default="auto",
                        help="KV cache format: auto (as --dtype), bfloat16, or fp8_e4m3 (c_kv and indexer keys in FP8"
                             " with a float32 scale per 128 values, k_pe in bf16: 656 B per token per layer at V3.2)")


def add_deterministic_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="batch-invariant ranks (SGLang's flag): a request's tokens and logprobs are bit-identical"
                             " whatever shares its batch, however it is chunked, whichever rank runs it (slower)")


def add_attention_backend_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attention-backend", choices=get_args(AttentionBackendName),
                        default=DEFAULT_ATTENTION_BACKEND,
                        help="the ranks' DSA kernel set (model_workers/kernels/registry.py): auto (triton on CUDA when"
                             " it imports, else torch), torch (the reference, CPU and CUDA), triton (CUDA; on a CPU"
                             " only in Triton's interpreter, TRITON_INTERPRET=1)")


def add_cuda_graph_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disable-cuda-graph", action="store_true",
                        help="run every decode step eagerly (SGLang's flag); by default a CUDA rank on the triton"
                             " kernel set replays plain decode steps from CUDA graphs captured per batch size")


def add_prefix_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Prefix caching is on by default; SGLang's and vLLM's flags turn it off (`prefix_caching_on`)."""
    parser.add_argument("--disable-radix-cache", action="store_true",
                        help="do not reuse cached prompt prefixes (SGLang's flag; prefix caching is on by default)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="vLLM's spelling: --no-enable-prefix-caching turns prefix caching off")


def prefix_caching_on(args: argparse.Namespace) -> bool:
    """Whether the flags leave prefix caching on; ValueError when they contradict each other."""
    disable, enable = getattr(args, "disable_radix_cache", False), getattr(args, "enable_prefix_caching", None)
    if disable and enable:
        raise ValueError("--disable-radix-cache and --enable-prefix-caching contradict each other: give one")
    return not disable and enable is not False


def add_device_argument(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--device", choices=get_args(DeviceName), default=default)


def add_speculative_argument(parser: argparse.ArgumentParser, default: int | str = 0, many: bool = False) -> None:
    """--speculative-num-steps: one k (`many=False`, with SGLang's and vLLM's spellings of it, resolved by
    `aliases.resolve_speculation`) or a comma list of k (a benchmark sweep)."""
    what = "a comma list of k" if many else "k"
    parser.add_argument("--speculative-num-steps", type=str if many else int, default=default if many else None,
                        help=f"MTP draft tokens per step ({what}, 0..{MAX_SPECULATIVE_STEPS}; 0 = plain decoding)")
    parser.add_argument("--speculative-token-map", default="auto",
                        help="the draft head's vocabulary: auto (the checkpoint's draft_vocab.json when it ships one),"
                             " none (the full vocabulary) or a token map file (JSON, or SGLang's .pt of token ids)")
    if not many:
        add_speculative_aliases(parser)


def add_placement_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-placement", choices=get_args(EnginePlacement), default="separate",
                        help="colocated: one deployment is HTTP app + engine; separate: DSAIngress -> DSAEngine")


def add_server_arguments(parser: argparse.ArgumentParser, dtype_default: str) -> None:
    """What describes a served engine (`serve`, and `bench serve` which starts or measures one): --model, the
    CP flags (cp_size 2), speculation, dtype, device and the engine placement."""
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the names clients send as `model` (several allowed; default: the folder's name)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="chat: return <think>...</think> as reasoning_content (DeepSeek-V3.2: deepseek_v3,"
                             " GLM-5: glm45)")
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="chat: parse the family's tool-call markup into tool_calls (DeepSeek-V3.2: deepseek_v32,"
                             " DeepSeek-V4: deepseek_v4, GLM-4.5/4.6: glm45, GLM-4.7/GLM-5: glm47)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='allow tool_choice "auto" (the default when a request has tools); needs'
                             ' --tool-call-parser')
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file (default: the checkpoint's chat_template.jinja, else the"
                             " template in tokenizer_config.json)")
    add_cp_arguments(parser)
    parser.set_defaults(cp_size=2)
    add_speculative_argument(parser)
    add_dtype_argument(parser, default=dtype_default)
    add_kv_cache_dtype_argument(parser)
    add_deterministic_argument(parser)
    add_attention_backend_argument(parser)
    add_cuda_graph_argument(parser)
    add_prefix_cache_arguments(parser)
    add_device_argument(parser, default="cuda" if torch.cuda.is_available() else "cpu")
    add_placement_argument(parser)
    add_limit_arguments(parser)


def int_list(text: str, flag: str, low: int, high: int) -> list[int]:
    """A comma list of integers in low..high; ValueError naming the flag otherwise."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not all(low <= v <= high for v in values):
        raise ValueError(f"{flag} values must be in {low}..{high}, got {text!r}")
    return values


def check_at_least_one(flag: str, value: int | None) -> None:
    """ValueError naming `flag` unless `value` is None (the default) or >= 1."""
    if value is not None and value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")


def apply_threads(threads: int | None) -> None:
    """--threads: torch's CPU thread count for this process (None: torch's choice)."""
    check_at_least_one("--threads", threads)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
