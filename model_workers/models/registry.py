"""The one table of model families, looked up by config.json's `model_type` (docs/models.md).

Adding a family = a folder beside dsa/ and deepseek_v4/ whose `__init__.py` builds a `ModelFamily`, and one line in
FAMILIES below."""

from __future__ import annotations

from typing import Any

from model_workers.models import deepseek_v4, dsa
from model_workers.models.common.config_fields import ModelConfigError
from model_workers.models.family import ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (dsa.FAMILY, deepseek_v4.FAMILY)
BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
SUPPORTED_MODEL_TYPES = tuple(BY_MODEL_TYPE)


def family_for(model_type: str | None) -> ModelFamily:
    """The family serving `model_type`; a ModelConfigError naming the allowed values otherwise."""
    family = BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise ModelConfigError(f"config.json model_type={model_type!r} is not supported; allowed: "
                               f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return family


def family_of(config: Any) -> ModelFamily:
    """The family of a parsed config (every family's config carries its `model_type`)."""
    return family_for(config.model_type)


def parse_model_config(raw: dict[str, Any]) -> Any:
    """config.json (as a dict) -> its family's frozen config."""
    return family_for(raw.get("model_type")).parse_config(raw)
