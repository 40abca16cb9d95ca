"""The JSON schemas `bench structured` constrains the default model with: nested objects, arrays, enums, anyOf /
oneOf, string formats and patterns, numbers with bounds, optional and required properties, $ref definitions. The
default model was trained on Python code and writes no JSON on its own, so every valid output is the grammar's
doing."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def obj(properties: dict[str, Schema], required: list[str] | None = None, closed: bool = True) -> Schema:
    schema: Schema = {"type": "object", "properties": properties,
                      "required": list(properties) if required is None else required}
    return {**schema, "additionalProperties": False} if closed else schema


def short_string(**extra) -> Schema:
    return {"type": "string", "maxLength": 12, **extra}


SCALARS: list[Schema] = [
    {"type": "integer"},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "integer", "exclusiveMinimum": 0, "multipleOf": 3, "maximum": 60},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "boolean"},
    {"type": "null"},
    short_string(),
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "email", "maxLength": 40},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "ipv4"},
    {"type": "string", "format": "date-time"},
    {"enum": ["red", "green", "blue"]},
    {"enum": [1, "two", None, True]},
    {"const": "fixed"},
]

ARRAYS: list[Schema] = [
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 5},
    {"type": "array", "items": short_string(), "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 4},
    {"type": "array", "prefixItems": [{"type": "integer"}, short_string(), {"type": "boolean"}], "items": False},
    {"type": "array", "items": obj({"x": {"type": "integer", "minimum": 0, "maximum": 99}}), "maxItems": 3},
    {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, "maxItems": 2},
]

OBJECTS: list[Schema] = [
    obj({"name": short_string(), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"id": {"type": "string", "format": "uuid"}, "active": {"type": "boolean"}}),
    obj({"point": obj({"x": {"type": "number"}, "y": {"type": "number"}})}),
    obj({"user": obj({"name": short_string(), "tags": {"type": "array", "items": short_string(), "maxItems": 2}}),
         "level": {"enum": ["low", "high"]}}),
    obj({"a": obj({"b": obj({"c": obj({"d": {"type": "integer", "minimum": 0, "maximum": 9}})})})}),
    obj({"required_one": {"type": "integer"}, "optional_one": short_string()}, required=["required_one"]),
    obj({"only_optional": {"type": "boolean"}}, required=[]),
    obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, short_string()]}}),
    obj({"shape": {"oneOf": [obj({"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}}),
                             obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                        "maximum": 9}})]}}),
    obj({"when": {"type": "string", "format": "date"}, "where": {"type": "string", "format": "ipv4"}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}, "count": {"type": "integer", "minimum": 1,
                                                                                "maximum": 3}}),
    obj({"maybe": {"type": ["integer", "null"]}, "flag": {"type": "boolean"}}),
    obj({"ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
    obj({"items": {"type": "array", "items": obj({"sku": short_string(), "qty": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9}}),
                   "minItems": 1, "maxItems": 2}, "total": {"type": "number", "minimum": 0}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9},
                                               "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}),
    obj({"status": {"enum": ["ok", "error"]}, "error": {"anyOf": [{"type": "null"}, short_string()]}}),
    obj({"meta": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
                  "maxProperties": 2}}),
    obj({"open": {"type": "integer", "minimum": 0, "maximum": 9}}, closed=False),
    obj({"email": {"type": "string", "format": "email", "maxLength": 30}, "name": short_string()}),
    obj({"at": {"type": "string", "format": "date-time"}, "note": short_string()}, required=["at"]),
    {"$defs": {"leaf": obj({"v": {"type": "integer", "minimum": 0, "maximum": 9}})},
     **obj({"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}})},
    {"$defs": {"tag": {"enum": ["x", "y", "z"]}},
     **obj({"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3}})},
    obj({"version": {"const": 2}, "payload": obj({"k": short_string()})}),
    obj({"big": {"type": "integer", "minimum": 1000000, "maximum": 9999999}}),
    obj({"neg": {"type": "number", "maximum": -1, "minimum": -100}}),
    obj({"letters": {"type": "string", "pattern": "^[a-c]+$", "maxLength": 6}}),
    obj({"pair": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 5}, {"type": "integer"}],
                  "items": False, "minItems": 2}}),
    obj({"choice": {"anyOf": [obj({"yes": {"const": True}}), obj({"no": {"const": False}})]}}),
    obj({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "parent": {"type": ["integer", "null"]},
         "children": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 999}, "maxItems": 3}}),
    obj({"title": short_string(), "published": {"type": "boolean"},
         "rating": {"type": "number", "minimum": 0, "maximum": 5}}),
]

SCHEMAS: list[Schema] = SCALARS + ARRAYS + OBJECTS
