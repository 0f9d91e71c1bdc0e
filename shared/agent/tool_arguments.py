"""A tool call's arguments checked against its tool's JSON schema, before the tool runs: every problem
said in words the model can act on. Also the JSON type of a Python value, which schemas and checks name.
"""

from __future__ import annotations

import json
from typing import Any

JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def json_type_of(value: Any) -> str:
    """The JSON type a value is written as ("integer" for an int, "null" for None), or else its Python type's
    name."""
    if value is None:
        return "null"
    for python_type in (bool, int, float, str):  # bool first: True is also an int
        if isinstance(value, python_type):
            return JSON_TYPES[python_type]
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def check_arguments(arguments: Any, schema: dict[str, Any]) -> list[str]:
    """What is wrong with `arguments` under `schema`, one message per problem; empty when it fits.

    Covers what tool schemas use: type, enum, minimum, maximum, properties, required,
    additionalProperties, items, anyOf / oneOf. Stricter than JSON Schema on one point, on purpose:
    an object schema that lists `properties` rejects other keys unless `additionalProperties` allows
    them, because an argument name the model made up is a mistake it should hear about.
    """
    problems: list[str] = []
    _check(arguments, schema, "", problems)
    return problems


def _check(value: Any, schema: dict[str, Any], path: str, problems: list[str]) -> None:
    where = f"{path}: " if path else ""
    for key in ("anyOf", "oneOf"):
        if key in schema:
            if all(check_arguments(value, option) for option in schema[key]):
                problems.append(f"{where}{_excerpt(value)} matches none of the allowed forms")
                return
    expected = schema.get("type")
    if expected is not None:
        allowed = [expected] if isinstance(expected, str) else list(expected)
        actual = json_type_of(value)
        if actual not in allowed and not (actual == "integer" and "number" in allowed):
            problems.append(f"{where}expected {' or '.join(allowed)}, got {actual} {_excerpt(value)}")
            return
    if "enum" in schema and not any(json_type_of(value) == json_type_of(option) and value == option
                                    for option in schema["enum"]):
        options = ", ".join(json.dumps(option) for option in schema["enum"])
        problems.append(f"{where}{_excerpt(value)} is not one of {options}")
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"{where}{_excerpt(value)} is less than the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            problems.append(f"{where}{_excerpt(value)} is more than the maximum {schema['maximum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                problems.append(f"missing required argument {path + '.' if path else ''}{name}")
        extra = schema.get("additionalProperties", False if properties else True)
        for name, item in value.items():
            item_path = f"{path}.{name}" if path else name
            if name in properties:
                _check(item, properties[name], item_path, problems)
            elif extra is False:
                known = ", ".join(properties) or "none"
                problems.append(f"unexpected argument {item_path} (known arguments: {known})")
            elif isinstance(extra, dict):
                _check(item, extra, item_path, problems)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{i}]", problems)


def _excerpt(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."

