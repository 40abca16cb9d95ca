"""docs/architecture.md, 'Which implementation runs': one table row per rule and per error."""

from typing import get_args

import pytest
from pydantic import ValidationError

from cluster.config import (
    CPConfig,
    CPImplName,
    CPStrategyName,
    ResolvedCPConfig,
    parse_cp_config,
    resolve_cp_config,
)
from cp_router.cp import CP_IMPLS, CP_STRATEGIES

DSA_V32 = {"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], "index_topk": 2048}
GLM5 = {"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "index_topk": 2048}
GLM52 = {**GLM5, "index_share_for_mtp_iteration": True}  # MTP index sharing
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}  # no indexer: not DSA
MIMO = {"model_type": "mimo_v2_flash", "architectures": ["MiMoV2FlashForCausalLM"]}
MIMO_BY_ARCH = {"model_type": "mimo_v2_next", "architectures": ["MiMoV2NextForCausalLM"]}
MIMO_MM_TEXT = {**MIMO, "vision_config": {"depth": 2}, "language_only": True}
MIMO_MM = {**MIMO, "vision_config": {"depth": 2}, "language_only": False}
MIMO_MM_NO_FLAG = {**MIMO, "vision_config": {"depth": 2}}


def cp(strategy=None, impl="auto", enable=True, cp_size=4):
    return {"enable_prefill_cp": enable, "cp_size": cp_size, "cp_strategy": strategy, "cp_impl": impl}


RULES = [
    # (rule, CP fields, model config, resolved impl)
    ("dsa: v2 with prefill CP + interleave", cp("interleave"), DSA_V32, "v2"),
    ("dsa (glm-5): v2 with prefill CP + interleave", cp("interleave"), GLM5, "v2"),
    ("dsa: legacy with zigzag", cp("zigzag"), DSA_V32, "legacy"),
    ("dsa: legacy without prefill CP", cp("interleave", enable=False), DSA_V32, "legacy"),
    ("dsa: legacy without CP or strategy", cp(None, enable=False), GLM5, "legacy"),
    ("v2 family non-dsa: v2", cp("zigzag"), MIMO, "v2"),
    ("v2 family non-dsa without CP: v2", cp(None, enable=False), MIMO, "v2"),
    ("v2 family detected by architecture", cp("zigzag"), MIMO_BY_ARCH, "v2"),
    ("other non-dsa: legacy", cp("interleave"), DEEPSEEK_V3, "legacy"),
    ("explicit legacy wins over v2 default", cp("interleave", "legacy"), DSA_V32, "legacy"),
    ("explicit v2 wins over legacy default", cp("zigzag", "v2"), DSA_V32, "v2"),
    ("explicit v2 wins for non-dsa", cp("interleave", "v2"), DEEPSEEK_V3, "v2"),
    ("explicit legacy wins for v2 family (no mimo restriction)", cp("interleave", "legacy"), MIMO, "legacy"),
    ("mtp index share not forced to legacy", cp("interleave"), GLM52, "v2"),
    ("mtp index share follows the dsa rule", cp("zigzag"), GLM52, "legacy"),
    ("mimo multimodal with language_only", cp("zigzag"), MIMO_MM_TEXT, "v2"),
    ("mimo multimodal without CP is not checked", cp(None, enable=False), MIMO_MM, "v2"),
]

ERRORS = [
    # (rule, CP fields, model config, words the one-line message must contain)
    ("mimo v2 (auto) needs zigzag", cp("interleave"), MIMO, ["cp_strategy", "'zigzag'"]),
    ("mimo v2 (explicit) needs zigzag", cp("interleave", "v2"), MIMO, ["cp_strategy", "'zigzag'"]),
    ("mimo v2 multimodal needs language_only", cp("zigzag"), MIMO_MM, ["language_only", "true"]),
    ("mimo v2 multimodal, flag missing", cp("zigzag"), MIMO_MM_NO_FLAG, ["language_only", "true"]),
    ("prefill CP without a strategy", cp(None), DSA_V32, ["cp_strategy", "'zigzag'", "'interleave'"]),
    ("unknown strategy", cp("ring"), DSA_V32, ["cp_strategy", "'zigzag'", "'interleave'"]),
    ("unknown impl", cp("zigzag", "v3"), DSA_V32, ["cp_impl", "'auto'", "'legacy'", "'v2'"]),
    ("cp_size below 1", cp("zigzag", cp_size=0), DSA_V32, ["cp_size", "greater than or equal to 1"]),
    ("unknown field", {**cp("zigzag"), "cp_mode": "x"}, DSA_V32, ["cp_mode", "cp_strategy", "cp_impl"]),
    ("ep_size neither 1 nor cp_size", {**cp("zigzag"), "ep_size": 2}, DSA_V32, ["ep_size=2", "cp_size=4", "1, 4"]),
    ("ep_size must divide the experts", {**cp("zigzag"), "ep_size": 4}, {**DSA_V32, "n_routed_experts": 6},
     ["ep_size=4", "n_routed_experts=6", "6 % 4 = 2"]),
]


@pytest.mark.parametrize("rule, fields, hf_config, impl", RULES, ids=[row[0] for row in RULES])
def test_resolution_rule(rule, fields, hf_config, impl):
    resolved = resolve_cp_config(parse_cp_config(fields), hf_config)
    expected = ResolvedCPConfig(
        enabled=fields["enable_prefill_cp"], cp_size=fields["cp_size"], strategy=fields["cp_strategy"], impl=impl
    )
    assert resolved == expected


@pytest.mark.parametrize("rule, fields, hf_config, words", ERRORS, ids=[row[0] for row in ERRORS])
def test_configuration_error(rule, fields, hf_config, words):
    with pytest.raises(ValueError) as err:
        resolve_cp_config(parse_cp_config(fields), hf_config)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_pydantic_model_rejects_directly_with_field_in_location():
    with pytest.raises(ValidationError) as err:
        CPConfig(enable_prefill_cp=True, cp_size=2, cp_strategy="ring")
    assert err.value.errors()[0]["loc"] == ("cp_strategy",)


def test_config_is_frozen_and_names_match_cp_router():
    config = CPConfig()
    with pytest.raises(ValidationError):
        config.cp_size = 2
    assert get_args(CPStrategyName) == CP_STRATEGIES
    assert get_args(CPImplName) == ("auto", *CP_IMPLS)


def test_expert_parallelism_resolves_with_the_cp_group():
    resolved = resolve_cp_config(parse_cp_config({**cp("zigzag"), "ep_size": 4}), {**DSA_V32, "n_routed_experts": 256})
    assert resolved.ep_size == 4 and resolved.expert_parallel
    assert not resolve_cp_config(parse_cp_config(cp("zigzag")), DSA_V32).expert_parallel
