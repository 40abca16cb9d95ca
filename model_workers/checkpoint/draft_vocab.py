"""The draft vocabulary file a checkpoint ships (`draft_vocab.json`) and the `speculative_token_map` setting.

`draft_vocab.json`: {"token_ids": [...], ...} — the tokens the draft head proposes, most frequent first, with
how they were chosen. `speculative_token_map` (SGLang's flag name): "auto" drafts over the checkpoint's file when
it has one (else the full vocabulary), "none" always over the full vocabulary, anything else is a path to a
token map: such a JSON file, or SGLang's `.pt` tensor of token ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from model_workers.models.common.draft_vocab import check_token_ids

DRAFT_VOCAB_FILE = "draft_vocab.json"
TOKEN_MAP_AUTO, TOKEN_MAP_NONE = "auto", "none"


def save_draft_vocab(model_dir: str | Path, token_ids: list[int], details: dict) -> Path:
    """Writes `draft_vocab.json` (token ids first, then `details`: how they were chosen)."""
    path = Path(model_dir) / DRAFT_VOCAB_FILE
    path.write_text(json.dumps({"token_ids": list(token_ids), **details}) + "\n")
    return path


def read_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """Token ids [N] int64 from a draft vocabulary JSON file or a `.pt` tensor; ValueError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"speculative_token_map: no file {path} (or pass 'auto' / 'none')")
    try:
        if path.suffix == ".pt":
            ids = torch.as_tensor(torch.load(path, map_location="cpu", weights_only=True))
        else:
            raw = json.loads(path.read_text())
            ids = torch.tensor(raw["token_ids"] if isinstance(raw, dict) else raw)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"speculative_token_map: {path} is not a token map ({exc})") from exc
    try:
        check_token_ids(ids, vocab_size)
    except ValueError as exc:
        raise ValueError(f"speculative_token_map: {path}: {exc}") from exc
    return ids.long()


def resolve_token_map(setting: str, model_dir: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary `setting` asks for: token ids [N], or None for the full vocabulary."""
    if setting == TOKEN_MAP_NONE:
        return None
    if setting == TOKEN_MAP_AUTO:
        shipped = Path(model_dir) / DRAFT_VOCAB_FILE
        return read_token_map(shipped, vocab_size) if shipped.is_file() else None
    return read_token_map(setting, vocab_size)


def check_token_map_setting(setting: str) -> str:
    """'auto', 'none', or an existing file; ValueError naming the setting otherwise."""
    if setting not in (TOKEN_MAP_AUTO, TOKEN_MAP_NONE) and not Path(setting).is_file():
        raise ValueError(f"speculative_token_map must be 'auto', 'none' or a token map file, got {setting!r} "
                         "(no such file)")
    return setting
