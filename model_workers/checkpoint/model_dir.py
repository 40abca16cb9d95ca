"""Where checkpoints come from (a folder given by the user, or the embedded default model), and the one reader of
a folder's config.json: `read_model_spec` reads it once into a `ModelSpec` (model_workers/spec.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from model_workers.models.common.config_fields import ModelConfigError, eos_ids
from model_workers.models.registry import parse_model_config
from model_workers.spec import ModelSpec

PACKAGED_MODEL_DIR = Path(__file__).resolve().parents[1] / "default_model"
CONFIG_FILE = "config.json"
GENERATION_CONFIG = "generation_config.json"  # its eos_token_id joins config.json's


def resolve_model_dir(model_dir: str | Path | None) -> Path:
    """The given folder, or the embedded default model shipped with the package."""
    path = Path(model_dir) if model_dir is not None else PACKAGED_MODEL_DIR
    if not (path / CONFIG_FILE).is_file():
        where = "--model" if model_dir is not None else "the embedded default model"
        raise FileNotFoundError(f"{where}: no config.json in {path}")
    return path


def read_model_spec(model_dir: str | Path | None) -> ModelSpec:
    """The folder (None: the embedded default model) read once: config.json parsed by its family."""
    path = resolve_model_dir(model_dir)
    raw = read_config_json(path)
    return ModelSpec(path, parse_model_config(with_generation_eos(raw, path / GENERATION_CONFIG)), raw)


def as_model_spec(model: ModelSpec | str | Path | None) -> ModelSpec:
    """`model` as a ModelSpec: already one (read at the edge), or a folder read now (None: the default model)."""
    return model if isinstance(model, ModelSpec) else read_model_spec(model)


def load_model_config(model_dir: str | Path) -> Any:
    """The folder's parsed config alone (`read_model_spec(model_dir).config`)."""
    return read_model_spec(model_dir).config


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """`model_dir`/config.json as a dict; a ModelConfigError naming the file when it is missing or not JSON."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise ModelConfigError(f"{path}: config.json not found (model directory must be a Hugging Face checkpoint)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: invalid JSON ({exc})") from exc


def with_generation_eos(raw: dict[str, Any], generation_path: Path) -> dict[str, Any]:
    """config.json's `eos_token_id` joined by generation_config.json's (checkpoints often list extra stop ids
    there, e.g. an end-of-turn token), in order, without repeats."""
    if not generation_path.is_file():
        return raw
    try:
        extra = eos_ids(json.loads(generation_path.read_text()).get("eos_token_id"))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
        raise ModelConfigError(f"{generation_path}: unreadable eos_token_id ({exc})") from exc
    merged = list(dict.fromkeys(eos_ids(raw.get("eos_token_id")) + extra))
    return {**raw, "eos_token_id": merged} if merged else raw
