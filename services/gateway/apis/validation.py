"""The checks the three API parsers share: each reads one field of a request body, or builds one piece
of the canonical request (canonical.py) from checked values, and raises `RequestError` naming the
offending field, in words a client's developer can act on.

    python -m pytest tests/unit/services/gateway -q
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from rollstream.services.gateway.apis.canonical import ToolChoice, Tools
from rollstream.services.gateway.apis.errors import RequestError


def require_object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RequestError(400, f"{param} must be a JSON object, not {_json_type(value)}", param)
    return value


def require_list(value: Any, param: str, *, non_empty: bool = False) -> list[Any]:
    if not isinstance(value, list):
        raise RequestError(400, f"{param} must be an array, not {_json_type(value)}", param)
    if non_empty and not value:
        raise RequestError(400, f"{param} must not be empty", param)
    return value


def require_str(value: Any, param: str, *, non_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise RequestError(400, f"{param} must be a string, not {_json_type(value)}", param)
    if non_empty and not value.strip():
        raise RequestError(400, f"{param} must not be empty", param)
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def model_field(body: dict[str, Any]) -> str:
    if "model" not in body:
        raise RequestError(400, "model is required", "model")
    return require_str(body["model"], "model", non_empty=True)


def int_field(body: dict[str, Any], key: str, *, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"{key} must be an integer, not {_json_type(value)}", key)
    if value < minimum:
        raise RequestError(400, f"{key} must be at least {minimum}, got {value}", key)
    return value


def number_field(body: dict[str, Any], key: str, *, minimum: float, maximum: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(400, f"{key} must be a number, not {_json_type(value)}", key)
    if not minimum <= value <= maximum:
        raise RequestError(400, f"{key} must be between {minimum:g} and {maximum:g}, got {value:g}", key)
    return float(value)


def bool_field(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(400, f"{key} must be true or false, not {_json_type(value)}", key)
    return value


def stop_field(body: dict[str, Any], key: str) -> list[str]:
    """Stop strings given as one string or a list of them."""
    value = body.get(key)
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else require_list(value, key)
    for i, stop in enumerate(stops):
        require_str(stop, f"{key}[{i}]", non_empty=True)
    return stops


def function_tool(name: Any, description: Any, parameters: Any, param: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": require_str(name, f"{param}.name", non_empty=True)}
    if description is not None:
        function["description"] = require_str(description, f"{param}.description")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    function["parameters"] = require_object(parameters, f"{param}.parameters")
    return {"type": "function", "function": function}


TOOL_TYPE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""What a tool type the gateway leaves out may look like: it is named in a response header."""


def leave_out_tool(ignored: list[str], kind: Any, param: str) -> None:
    """Notes a tool of type `kind` the model is not shown (see `ChatRequest.ignored_tools`)."""
    kind = require_str(kind, param, non_empty=True)
    if not TOOL_TYPE.match(kind):
        raise RequestError(400, f"{param} {kind[:80]!r} is not a tool type", param)
    if kind not in ignored:
        ignored.append(kind)


def thinking_of_effort(effort: Any, param: str) -> bool | None:
    """OpenAI's reasoning effort as `ChatRequest.thinking`: "none" turns reasoning off, any other
    effort asks for it (the gateway cannot set how much), null says nothing."""
    if effort is None:
        return None
    return require_str(effort, param, non_empty=True) != "none"


def tool_list(tools: list[dict[str, Any]], param: str) -> Tools:
    """`tools` as the request's tool list: None when empty (the template then shows no tools)."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            raise RequestError(400, f"{param}[{i}]: the tool name {name!r} is given twice",
                               f"{param}[{i}].name")
        seen.add(name)
    return tools or None


def choose_tools(mode: str, tools: Tools, param: str) -> tuple[ToolChoice, Tools]:
    """The tool choice for "auto", "none" or "required", and the tools the model is shown with it."""
    if mode == "none":
        return "auto", None
    if mode == "required" and not tools:
        raise RequestError(400, f"{param} requires a tool call but the request has no tools", param)
    return mode, tools


def named_tool_choice(name: Any, tools: Tools, param: str) -> dict[str, Any]:
    """The choice of one tool by name, which must be among the request's tools."""
    name = require_str(name, param, non_empty=True)
    if name not in {tool["function"]["name"] for tool in tools or ()}:
        raise RequestError(400, f"tool_choice names the tool {name!r}, which is not among the request's "
                                "tools", param)
    return {"type": "function", "function": {"name": name}}


def arguments_from_json(text: Any, param: str) -> dict[str, Any]:
    """Call arguments sent as a JSON string (OpenAI's wire form) as a dict; "" means no arguments."""
    text = require_str(text, param)
    if not text.strip():
        return {}
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(400, f"{param} is not valid JSON ({e.msg} at char {e.pos}): {text[:80]!r}",
                           param) from None
    if not isinstance(arguments, dict):
        raise RequestError(400, f"{param} must encode a JSON object, not {_json_type(arguments)}", param)
    return arguments


def unsupported(what: str, param: str, hint: str | None = None) -> RequestError:
    """A 400 for something valid in the API that the gateway does not do; `hint` says what it does."""
    return RequestError(400, f"{what} is not supported by this gateway" + (f"; {hint}" if hint else ""),
                        param)
