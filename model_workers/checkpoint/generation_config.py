"""A checkpoint's generation_config.json: the sampling defaults its authors ship with it (vLLM applies them).

Only the keys that mean the same here are read: temperature, top_p, top_k, min_p, repetition_penalty. A
request that sets a field keeps its own value; `eos_token_id` is merged into the model's stop ids by
checkpoint/model_dir.py (`with_generation_eos`).
"""

from __future__ import annotations

import json
from pathlib import Path

from model_workers.checkpoint.model_dir import GENERATION_CONFIG

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_dir: str | Path | None) -> dict[str, float | int]:
    """{request field: default} from `model_dir/generation_config.json` ({} without the file)."""
    if model_dir is None or not (Path(model_dir) / GENERATION_CONFIG).is_file():
        return {}
    path = Path(model_dir) / GENERATION_CONFIG
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from None
    defaults = {}
    for key in SAMPLING_KEYS:
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[key] = int(value) if key == "top_k" else float(value)
    return defaults
