"""The tool layer of the agent runtime: what a tool is, how a set of them runs, where they come from.

A `Tool` has a name, a description and a JSON schema of its arguments; `execute` turns arguments
into the text the model sees next. Stateful tools set up per-episode resources in `create` (kept in
`Episode.state`) and free them in `release`, which always runs at the end of the episode.

    @tool
    def word_count(text: str, unique: bool = False) -> int:
        '''Count the words of a text.

        Args:
            text: The text to count.
            unique: Count each distinct word once.
        '''

`@tool` infers the schema from the signature and the description from the docstring.

A `ToolSet` is what an episode runs its calls through: concurrently but bounded, each call with a
time limit, arguments checked against the schema first, long output cut. Every failure becomes a
`ToolResult` with `ok=False`, an `error_kind` and a message the model can act on; nothing a tool does
raises out of `ToolSet.execute`. Outcomes are counted in `ToolSet.counts` and in the Prometheus
counter `rollstream_tool_calls_total{tool, outcome}`.

Tools are named in configuration by a registered name (`register_tool`; the module that registers
must have been imported), by an import path `package.module:attr`, or in a YAML file:

    - name: calculator
    - import: my_pkg.tools:Search
      args: {top_k: 5}
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import re
import types
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml
from prometheus_client import Counter as PrometheusCounter

from rollstream.shared.errors import ToolError

log = logging.getLogger(__name__)

ErrorKind = Literal["unknown_tool", "bad_arguments", "raised", "timeout", "malformed"]

MALFORMED_CALL_NAME = "invalid_tool_call"
TOOL_CALLS = PrometheusCounter("rollstream_tool_calls", "Tool calls by tool and outcome ('ok' or the error kind).",
                               ["tool", "outcome"])
UNKNOWN_TOOL_LABEL = "<unknown>"
"""Metric label of calls to tools that do not exist: the names a model invents must not become series."""

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI-style chat templates accept


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `id` ties the result to it."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """What one call produced: the text for the model and, when it failed, why."""

    call_id: str
    name: str
    content: str
    ok: bool
    error_kind: ErrorKind | None = None


@dataclass
class Episode:
    """What tools see of the running episode."""

    episode_id: str
    run_id: str = "local"
    metadata: dict[str, Any] = field(default_factory=dict)
    """The dataset row's metadata."""
    state: dict[str, Any] = field(default_factory=dict)
    """Resources tools share within one episode (e.g. a workspace)."""
    artifacts: dict[str, str] = field(default_factory=dict)
    """Name -> URI of things the episode produced (e.g. "diff")."""
    storage_uri: str | None = None


class Tool(ABC):
    """Base class of tools. Subclasses set `name`, `description` and `parameters` (the JSON schema
    of the arguments object) and implement `execute`."""

    name: str
    description: str
    parameters: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

    async def create(self, episode: Episode) -> None:
        """Set up what this tool needs for one episode (stateful tools keep it in `episode.state`)."""

    @abstractmethod
    async def execute(self, arguments: dict[str, Any], episode: Episode) -> str:
        """Run one call; the returned text is what the model sees. Raise `ToolError` to tell the model
        what went wrong."""

    async def release(self, episode: Episode) -> None:
        """Free what `create` set up. Runs at the end of every episode, also when `create` failed or
        never ran, and possibly twice (see `ToolSet.start`), so it must tolerate missing state."""

    def schema(self) -> dict:
        """The tool in OpenAI function-tool format, as chat templates expect it."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self, 'name', '?')!r}>"


# ------------------------------------------------------------------------------- function tools
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
            raise ValueError(f"tool function {fn.__qualname__} needs a docstring: the model reads it as the description")
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
        return _as_text(value)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Decorator: `@tool` or `@tool(name="...")` turns a typed function with a docstring into a Tool.

    The schema comes from the signature (str, int, float, bool, list[T], dict, Literal[...],
    Optional / `| None`; parameters without defaults are required), the description from the first
    paragraph of the docstring, per-argument descriptions from a Google-style `Args:` section.
    """
    if fn is None:
        return lambda f: FunctionTool(f, name=name)
    return FunctionTool(fn, name=name)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


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


_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _type_schema(annotation: Any, where: str) -> dict[str, Any]:
    if annotation is Any:
        return {}
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is list or origin is list:
        return {"type": "array", "items": _type_schema(args[0], where)} if args else {"type": "array"}
    if annotation is dict or origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"{where}: JSON object keys are strings, not {args[0]!r}")
        value = _type_schema(args[1], where) if args else {}
        return {"type": "object", "additionalProperties": value} if value else {"type": "object"}
    if origin is Literal:
        types_ = {_json_type_of(v) for v in args}
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


def _json_type_of(value: Any) -> str:
    if value is None:
        return "null"
    for python_type in (bool, int, float, str):  # bool first: True is also an int
        if isinstance(value, python_type):
            return _JSON_TYPES[python_type]
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# ----------------------------------------------------------------------------- argument checks
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
        actual = _json_type_of(value)
        if actual not in allowed and not (actual == "integer" and "number" in allowed):
            problems.append(f"{where}expected {' or '.join(allowed)}, got {actual} {_excerpt(value)}")
            return
    if "enum" in schema and not any(_json_type_of(value) == _json_type_of(option) and value == option
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


# ------------------------------------------------------------------------------------ tool set
class ToolSet:
    """The tools of one episode, and how their calls run."""

    def __init__(self, tools: Sequence[Tool], *, max_concurrency: int = 8, max_output_chars: int = 4096,
                 timeout_s: float = 60.0) -> None:
        if max_concurrency < 1 or max_output_chars < 1 or timeout_s <= 0:
            raise ValueError("max_concurrency, max_output_chars and timeout_s must be positive")
        self.tools: dict[str, Tool] = {}
        for t in tools:
            name = getattr(t, "name", None)
            if not isinstance(name, str) or not _TOOL_NAME.match(name):
                raise ValueError(f"tool {t!r} needs a name of 1-64 letters, digits, '_' or '-'")
            if name in self.tools:
                raise ValueError(f"two tools are named {name!r}: {self.tools[name]!r} and {t!r}")
            if not isinstance(getattr(t, "parameters", None), dict) or t.parameters.get("type") != "object":
                raise ValueError(f"tool {name!r}: parameters must be a JSON schema of type 'object'")
            self.tools[name] = t
        self.max_concurrency = max_concurrency
        self.max_output_chars = max_output_chars
        self.timeout_s = timeout_s
        self.counts: Counter[tuple[str, str]] = Counter()

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    async def start(self, episode: Episode) -> None:
        """create() every tool, in order. If one fails, every tool is released (see `close`) and the
        error raised: the episode cannot run without its tools."""
        try:
            for t in self.tools.values():
                await t.create(episode)
        except BaseException:
            await self.close(episode)
            raise

    async def close(self, episode: Episode) -> None:
        """release() every tool, last created first. Never raises: a failing release is logged and
        the others still run, so one broken tool does not leak the rest's resources."""
        for t in reversed(list(self.tools.values())):
            try:
                await asyncio.wait_for(t.release(episode), self.timeout_s)
            except Exception:
                log.exception("releasing tool %s failed", t.name,
                              extra={"tool": t.name, "episode_id": episode.episode_id})

    async def execute(self, calls: Sequence[ToolCall], episode: Episode) -> list[ToolResult]:
        """Run the calls concurrently, at most `max_concurrency` at once; results in call order."""
        limit = asyncio.Semaphore(self.max_concurrency)

        async def bounded(call: ToolCall) -> ToolResult:
            async with limit:
                return await self._run(call, episode)

        return list(await asyncio.gather(*(bounded(call) for call in calls)))

    async def _run(self, call: ToolCall, episode: Episode) -> ToolResult:
        t = self.tools.get(call.name)
        if t is None:
            available = ", ".join(self.tools) or "none"
            return self._result(call, f"unknown tool {call.name!r}; available tools: {available}", "unknown_tool")
        if not isinstance(call.arguments, dict):
            return self._result(call, f"arguments of {call.name} must be a JSON object, got "
                                      f"{_json_type_of(call.arguments)}", "bad_arguments")
        problems = check_arguments(call.arguments, t.parameters)
        if problems:
            return self._result(call, f"invalid arguments for {call.name}: {'; '.join(problems)}", "bad_arguments")
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                content = await t.execute(call.arguments, episode)
        except ToolError as e:
            return self._result(call, str(e), "raised")
        except TimeoutError as e:
            if deadline.expired():
                return self._result(call, f"{call.name} did not finish within {self.timeout_s:g}s", "timeout")
            return self._result(call, f"{type(e).__name__}: {e}", "raised")  # the tool's own time-out
        except Exception as e:
            # A tool that raises anything but ToolError has a bug: the model hears what, we get the traceback.
            log.warning("tool %s raised", call.name, exc_info=True,
                        extra={"tool": call.name, "episode_id": episode.episode_id})
            return self._result(call, f"{type(e).__name__}: {e}", "raised")
        return self._result(call, content if isinstance(content, str) else _as_text(content), None)

    def malformed(self, call_id: str, problem: str) -> ToolResult:
        """The result the model sees for a tool call that could not be parsed (counted like the others)."""
        call = ToolCall(id=call_id, name=MALFORMED_CALL_NAME, arguments={})
        return self._result(call, f"Your tool call could not be parsed: {problem}", "malformed")

    def _result(self, call: ToolCall, content: str, error_kind: ErrorKind | None) -> ToolResult:
        outcome = error_kind or "ok"
        self.counts[(call.name, outcome)] += 1
        known = call.name in self.tools or call.name == MALFORMED_CALL_NAME
        TOOL_CALLS.labels(tool=call.name if known else UNKNOWN_TOOL_LABEL, outcome=outcome).inc()
        return ToolResult(call_id=call.id, name=call.name, content=self._cut(content), ok=error_kind is None,
                          error_kind=error_kind)

    def _cut(self, text: str) -> str:
        """Keep the head and the tail (where errors and summaries usually are) of a long output."""
        dropped = len(text) - self.max_output_chars
        if dropped <= 0:
            return text
        head = self.max_output_chars // 2
        tail = self.max_output_chars - head
        return f"{text[:head]}\n[... {dropped} characters cut ...]\n{text[len(text) - tail:] if tail else ''}"


# ------------------------------------------------------------------------------ where tools come from
TOOL_REGISTRY: dict[str, Callable[[], Tool]] = {}


def register_tool(name: str) -> Callable[[Any], Any]:
    """Decorator registering a zero-argument factory, a Tool subclass, or a Tool instance (such as a
    function decorated with `@tool`, which is then shared by all episodes) under `name`."""

    def register(target: Any) -> Any:
        if name in TOOL_REGISTRY:
            raise ValueError(f"a tool is already registered as {name!r}")
        if isinstance(target, Tool):
            TOOL_REGISTRY[name] = lambda: target
        elif callable(target):
            TOOL_REGISTRY[name] = target
        else:
            raise TypeError(f"register_tool({name!r}) needs a Tool, a Tool subclass or a factory, not {target!r}")
        return target

    return register


def resolve_tools(specs: Sequence[str]) -> list[Tool]:
    """Tools from specs: a registered name, or `package.module:attr` naming a Tool instance, a Tool
    subclass or a factory."""
    return [_build(spec, {}, f"tool spec {spec!r}") for spec in specs]


def load_tools_yaml(path: Path) -> list[Tool]:
    """Tools from a YAML list of `{name: registered-name}` or `{import: "pkg.mod:attr", args: {...}}`
    entries; `args` are passed to the class or factory."""
    path = Path(path)
    try:
        entries = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from e
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of tool entries, got {_json_type_of(entries)}")
    tools = []
    for index, entry in enumerate(entries):
        where = f"{path}: entry {index}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping with 'name' or 'import', got {entry!r}")
        unknown = set(entry) - {"name", "import", "args"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; an entry has 'name' or 'import', and 'args'")
        if ("name" in entry) == ("import" in entry):
            raise ValueError(f"{where}: needs exactly one of 'name' (a registered tool) or 'import' (pkg.mod:attr)")
        spec = entry.get("name") or entry.get("import")
        args = entry.get("args") or {}
        if not isinstance(spec, str) or not isinstance(args, dict):
            raise ValueError(f"{where}: 'name' / 'import' must be a string and 'args' a mapping")
        if "import" in entry and ":" not in spec:
            raise ValueError(f"{where}: import {spec!r} must look like 'package.module:attr'")
        tools.append(_build(spec, args, f"{where} ({spec})"))
    return tools


def _build(spec: str, args: dict[str, Any], where: str) -> Tool:
    if ":" in spec:
        target = _import(spec, where)
    elif spec in TOOL_REGISTRY:
        target = TOOL_REGISTRY[spec]
    else:
        known = ", ".join(sorted(TOOL_REGISTRY)) or "none"
        raise ValueError(f"{where}: no tool registered under that name (registered: {known}; a tool registers "
                         "when its module is imported), and it is not an import path 'package.module:attr'")
    if isinstance(target, Tool):
        if args:
            raise ValueError(f"{where}: names a tool instance, which takes no args")
        return target
    if not callable(target):
        raise ValueError(f"{where}: is {target!r}, not a Tool, a Tool subclass or a factory")
    try:
        built = target(**args)
    except Exception as e:
        raise ValueError(f"{where}: building the tool failed: {type(e).__name__}: {e}") from e
    if not isinstance(built, Tool):
        raise ValueError(f"{where}: the factory returned {built!r}, not a Tool")
    return built


def _import(spec: str, where: str) -> Any:
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{where}: cannot import {module_name!r}: {e}") from e
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"{where}: {module_name} has no attribute {attr!r}") from None
    return target
