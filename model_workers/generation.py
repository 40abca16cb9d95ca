"""Single-process generation for the CLI: load a checkpoint, run prompt -> tokens through the paged cache."""

from __future__ import annotations

from pathlib import Path

import torch

from .kv_cache import PageTable
from .loader import load_model
from .runner import ExtendItem, ModelRunner
from .tokenizer import decode, encode, load_tokenizer

PACKAGED_MODEL_DIR = Path(__file__).resolve().parent / "default_model"


def resolve_model_dir(model_dir: str | Path | None) -> Path:
    """The given folder, or the embedded default model shipped with the package."""
    path = Path(model_dir) if model_dir is not None else PACKAGED_MODEL_DIR
    if not (path / "config.json").is_file():
        where = "--model" if model_dir is not None else "the embedded default model"
        raise FileNotFoundError(f"{where}: no config.json in {path}")
    return path


class LocalGenerator:
    def __init__(self, runner: ModelRunner, tokenizer, model_dir: Path):
        self.runner, self.tokenizer, self.model_dir = runner, tokenizer, model_dir

    @classmethod
    def from_checkpoint(cls, model_dir, dtype=torch.float32, device="cpu", num_pages: int = 512, page_size: int = 64):
        path = resolve_model_dir(model_dir)
        model = load_model(path, dtype=dtype, device=device, progress=False)
        return cls(ModelRunner(model, num_pages=num_pages, page_size=page_size, device=device), load_tokenizer(path), path)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"--prompt needs {self.model_dir / 'tokenizer.json'}; use --prompt-ids instead")
        return encode(self.tokenizer, text)

    def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0) -> dict:
        vocab = self.runner.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        stop_ids = set(self.runner.model.config.eos_token_ids)
        rng = torch.Generator().manual_seed(seed)
        table, out, finish = PageTable(), [], "length"
        try:
            hidden = self.runner.extend([ExtendItem(table, list(prompt_ids))])
            while len(out) < max_tokens:
                logits = self.runner.model.logits(hidden[-1:])[0]  # [vocab]
                token = pick_token(logits, temperature, rng)
                out.append(token)
                if token in stop_ids:
                    finish = "stop"
                    break
                if len(out) < max_tokens:
                    hidden = self.runner.extend([ExtendItem(table, [token])])
        finally:
            self.runner.release(table)
        result = {"token_ids": out, "prompt_tokens": len(prompt_ids), "finish_reason": finish}
        if self.tokenizer is not None:
            result["text"] = decode(self.tokenizer, out)
        return result


def pick_token(logits: torch.Tensor, temperature: float, rng: torch.Generator) -> int:
    """Greedy at temperature 0, else one draw from softmax(logits / temperature)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=rng))
