"""The embedded default model: the files its card describes, transformers agrees with us, and it writes Python."""

import hashlib
import io
import json
import subprocess
import sys
import tokenize

import pytest
import torch

from cluster.engine_setup import run_all, start_local_engine
from cluster.engine_spec import EngineOptions
from cp_router.protocol import EngineRequest
from model_workers.checkpoint.model_dir import PACKAGED_MODEL_DIR
from model_workers.checkpoint.tokenizer import encode, load_tokenizer
from model_workers.training.model_card import CARD_FILES

HELD_OUT_PROMPTS = ["def __init__(self", "import os\n\n\ndef main(argv):\n    ", "class Reader:\n    def read(self, size"]


class Greedy:
    """The in-process engine on the default model, greedy."""

    def __init__(self):
        self.engine = start_local_engine(PACKAGED_MODEL_DIR, EngineOptions(num_pages=64, page_size=64))
        self.tokenizer = load_tokenizer(PACKAGED_MODEL_DIR)

    def encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)

    def generate(self, ids: list[int], max_tokens: int) -> dict:
        return run_all(self.engine, [EngineRequest("r", tuple(ids), max_tokens, temperature=0.0)])[0]


@pytest.fixture(scope="module")
def generator():
    return Greedy()


def test_shipped_files_match_the_model_card():
    card = json.loads((PACKAGED_MODEL_DIR / "model_card.json").read_text())
    for name in CARD_FILES:
        assert hashlib.sha256((PACKAGED_MODEL_DIR / name).read_bytes()).hexdigest() == card["sha256"][name], name
    size = sum((PACKAGED_MODEL_DIR / name).stat().st_size for name in CARD_FILES)
    assert size <= 25 * 1024 * 1024
    held_out = card["held_out"]
    assert held_out["mtp_step1_acceptance"] >= 0.5
    assert f"{held_out['loss']:.4f}" in (PACKAGED_MODEL_DIR / "MODEL_CARD.md").read_text()


def test_transformers_loads_it_and_greedy_output_is_identical(generator):
    from transformers import AutoTokenizer, DeepseekV32ForCausalLM

    reference = DeepseekV32ForCausalLM.from_pretrained(PACKAGED_MODEL_DIR, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(PACKAGED_MODEL_DIR)
    for prompt in HELD_OUT_PROMPTS:
        ids = generator.encode(prompt)
        assert hf_tokenizer(prompt, add_special_tokens=False)["input_ids"] == ids
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        ours = generator.generate(ids, 24)["token_ids"]
        eos = reference.config.eos_token_id
        if eos in expected:  # transformers pads after EOS; we stop there
            expected = expected[: expected.index(eos) + 1]
        assert ours == expected


def first_complete_lines(text: str) -> str:
    return text[: text.rfind("\n") + 1]


def python_tokens(source: str) -> list:
    """The tokens of `source`; a docstring the max_tokens cut left open is closed first (the cut, not the model,
    ended it there)."""
    try:
        return list(tokenize.generate_tokens(io.StringIO(source).readline))
    except tokenize.TokenError as exc:
        if "multi-line string" not in str(exc):
            raise
        return list(tokenize.generate_tokens(io.StringIO(source + '"""\n').readline))


def test_completion_of_a_held_out_prefix_is_plausible_python(generator):
    # A method's body: greedy decoding of a bare "def __init__(self" runs into one repeated argument list on this
    # small model, which is valid Python but a single line.
    prompt = "class Reader:\n    def read(self, size"
    result = generator.generate(generator.encode(prompt), 64)
    source = first_complete_lines(prompt + result["text"])
    assert source.count("\n") >= 2
    tokens = python_tokens(source)
    assert any(t.type == tokenize.NAME for t in tokens)
    assert not any(t.type == tokenize.ERRORTOKEN for t in tokens)


def test_generate_without_model_uses_the_default():
    cmd = [sys.executable, "-m", "cluster.cli", "generate", "--prompt", "def __init__(self", "--max-tokens", "32", "--json"]
    result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    assert len(result["token_ids"]) >= 1 and isinstance(result["text"], str)
