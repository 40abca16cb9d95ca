"""Where checkpoints come from: a folder given by the user, or the embedded default model."""

from __future__ import annotations

from pathlib import Path

PACKAGED_MODEL_DIR = Path(__file__).resolve().parents[1] / "default_model"


def resolve_model_dir(model_dir: str | Path | None) -> Path:
    """The given folder, or the embedded default model shipped with the package."""
    path = Path(model_dir) if model_dir is not None else PACKAGED_MODEL_DIR
    if not (path / "config.json").is_file():
        where = "--model" if model_dir is not None else "the embedded default model"
        raise FileNotFoundError(f"{where}: no config.json in {path}")
    return path
