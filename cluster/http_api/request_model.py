"""The base of every request body part: strict types, unknown fields ignored (and named in the log, body.py), and
JSON's one kind of number read as an integer where the field takes integers."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, model_validator


def _takes_ints(annotation: Any) -> bool:
    """Whether a field's type holds integers and no other numbers (int, int | None, list[int], PromptInput...)."""
    found = set()
    pending = [annotation]
    while pending:
        current = pending.pop()
        found.add(current)
        pending += get_args(current)
    return int in found and float not in found and Any not in found


def _integral_as_int(value: Any, depth: int = 2) -> Any:
    """10.0 as 10, in lists too down to `depth` (list[list[int]] is the deepest integer field)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [_integral_as_int(item, depth - 1) for item in value] if isinstance(value, list) and depth else value


class RequestModel(BaseModel):
    """A part of a request body: strict types, unknown fields ignored (and named in the log, body.py)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers_are_integers(cls, data: Any) -> Any:
        """JSON has one kind of number: 10.0 is the integer 10 (as the published JSON schema's "integer" says)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: _integral_as_int(value) if key in fields and _takes_ints(fields[key].annotation) else value
                for key, value in data.items()}
