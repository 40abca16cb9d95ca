"""Command lines pasted from SGLang and vLLM start the same server configuration as ours; what we do not
support is one clear line; --config FILE.yaml takes flag names as keys; --dtype auto follows the checkpoint."""

import json

import pytest

from cluster import cli
from cluster.commands.serve import app_args
from model_workers.checkpoint.model_dir import resolve_model_dir
from model_workers.precision import resolve_dtype_name

SGLANG = ["serve", "--attn-cp-size", "4", "--enable-prefill-cp", "--cp-strategy", "interleave",
          "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
          "--speculative-num-draft-tokens", "2"]
VLLM = ["serve", "--cp-size", "4", "--speculative-config", '{"method":"mtp","num_speculative_tokens":1}']
OURS = ["serve", "--cp-size", "4", "--speculative-num-steps", "1"]


def settings(argv: list[str]):
    return app_args(cli.build_parser().parse_args(argv))


def test_sglang_and_vllm_command_lines_give_our_configuration():
    ours = settings(OURS)
    assert settings(SGLANG) == ours == settings(VLLM)
    assert (ours.cp_size, ours.cp_strategy, ours.speculative_num_steps, ours.dtype) == (4, "interleave", 1, "auto")
    assert settings(["serve", "--speculative-algorithm", "NEXTN", "--speculative-num-draft-tokens", "3"]
                    ).speculative_num_steps == 2
    assert settings(["serve"]).speculative_num_steps == 0


@pytest.mark.parametrize("argv, message", [
    (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2", "--speculative-eagle-topk", "4"],
     "--speculative-eagle-topk 4 is not supported; allowed: 1"),
    (["--speculative-algorithm", "LOOKAHEAD", "--speculative-num-steps", "2"],
     "--speculative-algorithm LOOKAHEAD is not supported; allowed: EAGLE, NEXTN, MTP"),
    (["--speculative-num-steps", "2", "--speculative-num-draft-tokens", "2"], "the speculative draft counts disagree"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'], "method 'ngram' is not supported"),
    (["--speculative-config", '{"method": "eagle", "model": "x/y", "num_speculative_tokens": 2}'],
     "model not supported; allowed keys: method, num_speculative_tokens"),
    (["--speculative-algorithm", "MTP"], "needs a draft count"),
])
def test_what_we_do_not_support_is_one_line_and_exit_2(capsys, argv, message):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsa-serve serve: error: ") and message in err and err.count("\n") == 1


def test_config_file_takes_flag_names_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("cp_size: 3\nmax_model_len: 4000\nserved_model_name: [a, b]\nenable_prefill_cp: true\n"
                      "speculative_config: {method: mtp, num_speculative_tokens: 2}\n")
    argv = cli.expand_config_file(["serve", "--config", str(config), "--cp-size", "2"])
    got = settings(argv)
    assert (got.cp_size, got.max_model_len, got.served_model_name, got.speculative_num_steps) == (2, 4000, ["a", "b"],
                                                                                                 2)
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 2}


def test_dtype_auto_is_the_checkpoints_dtype_and_bf16_on_cuda(tmp_path):
    assert resolve_dtype_name("auto", resolve_model_dir(None)) == "bfloat16"  # the shipped model is stored in bf16
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert resolve_dtype_name("auto", tmp_path) == "float32"
    assert resolve_dtype_name("auto", tmp_path, "cuda") == "bfloat16"
    assert resolve_dtype_name("float32", tmp_path, "cuda") == "float32"  # an explicit choice wins


def test_vllm_tool_and_reasoning_flags_reach_the_ingress(capsys):
    from cluster.serve_app import ingress_settings

    got = settings(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v32", "--reasoning-parser",
                    "deepseek_v3"])
    ingress = ingress_settings(got, resolve_model_dir(None))
    assert (ingress.tool_call_parser, ingress.enable_auto_tool_choice, ingress.reasoning_parser) == (
        "deepseek_v32", True, "deepseek_v3")
    assert cli.main(["serve", "--enable-auto-tool-choice"]) == 2
    err = capsys.readouterr().err
    assert "--enable-auto-tool-choice) needs tool_call_parser (--tool-call-parser {deepseek_v32," in err
    assert err.count("\n") == 1


def test_deterministic_inference_flag_reaches_the_engine_options():
    from cluster.replica_engine import engine_options

    got = settings(["serve", "--enable-deterministic-inference"])
    assert got.enable_deterministic_inference and engine_options(got, resolve_model_dir(None)).deterministic
    assert not engine_options(settings(["serve"]), resolve_model_dir(None)).deterministic


def test_prefix_caching_is_on_and_sglang_or_vllm_flags_turn_it_off():
    assert settings(["serve"]).prefix_caching_enabled
    off = [settings(["serve", flag]) for flag in ("--disable-radix-cache", "--no-enable-prefix-caching")]
    assert [s.prefix_caching_enabled for s in off] == [False, False]
    assert settings(["serve", "--enable-prefix-caching"]).prefix_caching_enabled
    with pytest.raises(ValueError, match="--disable-radix-cache and --enable-prefix-caching contradict"):
        settings(["serve", "--disable-radix-cache", "--enable-prefix-caching"])
