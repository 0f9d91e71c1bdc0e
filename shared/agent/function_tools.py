"""A plain typed function as a tool: `@tool` infers the JSON schema of its arguments from the signature,
the description from the first paragraph of the docstring and each argument's from a Google-style `Args:`
section.

    @tool
    def word_count(text: str, unique: bool = False) -> int:
        '''Count the words of a text.

        Args:
            text: The text to count.
            unique: Count each distinct word once.
        '''
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from rollstream.shared.agent.tool_arguments import JSON_TYPES, json_type_of
from rollstream.shared.agent.tool_types import Episode, Tool, as_text


class FunctionTool(Tool):
    """A plain typed function as a tool; built by `@tool`.

    A parameter named `episode` (or annotated `Episode`) receives the running episode and is not
    part of the schema. Sync functions run in a worker thread, so they do not block the event loop;
    a timed-out sync call cannot be stopped and finishes in its thread.
    """

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        doc = inspect.getdoc(fn)
        if not doc:
            raise ValueError(f"tool function {fn.__qualname__} needs a docstring: the model reads it as the "
                             "description")
        self.description, arg_docs = _parse_docstring(doc)
        self.parameters, self._episode_param = _signature_schema(fn, arg_docs)
        self._is_async = inspect.iscoroutinefunction(fn)

    async def execute(self, arguments: dict[str, Any], episode: Episode) -> str:
        kwargs = dict(arguments)
        if self._episode_param:
            kwargs[self._episode_param] = episode
        if self._is_async:
            value = await self.fn(**kwargs)
        else:
            value = await asyncio.to_thread(self.fn, **kwargs)
        return as_text(value)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Decorator: `@tool` or `@tool(name="...")` turns a typed function with a docstring into a Tool.

    The schema comes from the signature (str, int, float, bool, list[T], dict, Literal[...],
    Optional / `| None`; parameters without defaults are required), the description from the first
    paragraph of the docstring, per-argument descriptions from a Google-style `Args:` section.
    """
    if fn is None:
        return lambda f: FunctionTool(f, name=name)
    return FunctionTool(fn, name=name)


_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?|Notes?):\s*$")
_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters):\s*$")
_ARG_ENTRY = re.compile(r"^\s*\*{0,2}(?P<name>\w+)\s*(\([^)]*\))?\s*:\s*(?P<text>.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph as one line, {argument: description} from a Google-style Args section)."""
    lines = doc.splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line):
            break
        summary.append(line.strip())

    descriptions: dict[str, str] = {}
    header = next((i for i, line in enumerate(lines) if _ARGS_HEADER.match(line)), None)
    if header is not None:
        header_indent, entry_indent, current = _indent(lines[header]), None, None
        for line in lines[header + 1:]:
            if not line.strip():
                continue
            if _indent(line) <= header_indent:
                break  # the next section
            entry_indent = entry_indent if entry_indent is not None else _indent(line)
            entry = _ARG_ENTRY.match(line)
            if entry and _indent(line) == entry_indent:
                current = entry["name"]
                descriptions[current] = entry["text"].strip()
            elif current:  # a continuation line of the current argument
                descriptions[current] = f"{descriptions[current]} {line.strip()}".strip()
    return " ".join(summary), descriptions


def _signature_schema(fn: Callable[..., Any], arg_docs: dict[str, str]) -> tuple[dict[str, Any], str | None]:
    """The arguments-object schema of `fn`, and the name of its episode parameter if it has one."""
    where = fn.__qualname__
    try:
        hints = get_type_hints(fn)
    except Exception as e:
        raise TypeError(f"tool function {where}: cannot resolve its type annotations: {e}") from e
    properties: dict[str, Any] = {}
    required: list[str] = []
    episode_param = None
    for param in inspect.signature(fn).parameters.values():
        if param.name == "episode" or hints.get(param.name) is Episode:
            episode_param = param.name
            continue
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise TypeError(f"tool function {where}: parameter {param.name!r} must be a named parameter, "
                            "not positional-only or *args / **kwargs")
        if param.name not in hints:
            raise TypeError(f"tool function {where}: parameter {param.name!r} has no type annotation")
        prop = _type_schema(hints[param.name], f"{where}({param.name})")
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        if param.default is param.empty:
            required.append(param.name)
        elif _is_json(param.default):
            prop["default"] = param.default
        properties[param.name] = prop
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema, episode_param


def _type_schema(annotation: Any, where: str) -> dict[str, Any]:
    if annotation is Any:
        return {}
    if annotation in JSON_TYPES:
        return {"type": JSON_TYPES[annotation]}
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is list or origin is list:
        return {"type": "array", "items": _type_schema(args[0], where)} if args else {"type": "array"}
    if annotation is dict or origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"{where}: JSON object keys are strings, not {args[0]!r}")
        value = _type_schema(args[1], where) if args else {}
        return {"type": "object", "additionalProperties": value} if value else {"type": "object"}
    if origin is Literal:
        types_ = {json_type_of(v) for v in args}
        return {"type": types_.pop(), "enum": list(args)} if len(types_) == 1 else {"enum": list(args)}
    if origin in (Union, types.UnionType):
        members = [_type_schema(a, where) for a in args if a is not type(None)]
        schema = members[0] if len(members) == 1 else {"anyOf": members}
        return _nullable(schema) if type(None) in args else schema
    raise TypeError(f"{where}: cannot describe {annotation!r} as JSON; use str, int, float, bool, list[...], "
                    "dict, Literal[...] or Optional[...]")


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    if not schema:  # Any already admits null
        return schema
    if "anyOf" in schema:
        return {**schema, "anyOf": [*schema["anyOf"], {"type": "null"}]}
    schema = dict(schema)
    if isinstance(schema.get("type"), str):
        schema["type"] = [schema["type"], "null"]
    if "enum" in schema:
        schema["enum"] = [*schema["enum"], None]
    return schema


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
