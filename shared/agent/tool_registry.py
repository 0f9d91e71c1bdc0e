"""Where tools come from: a name registered with `register_tool` (the module that registers must have been
imported), an import path `package.module:attr`, or a YAML file of such entries with arguments:

    - name: calculator
    - import: my_pkg.tools:Search
      args: {top_k: 5}
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from rollstream.shared.agent.tool_arguments import json_type_of
from rollstream.shared.agent.tool_types import Tool

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
            raise TypeError(f"register_tool({name!r}) needs a Tool, a Tool subclass or a factory, "
                            f"not {target!r}")
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
        raise ValueError(f"{path}: expected a list of tool entries, got {json_type_of(entries)}")
    tools = []
    for index, entry in enumerate(entries):
        where = f"{path}: entry {index}"
        spec, args = _entry(entry, where)
        tools.append(_build(spec, args, f"{where} ({spec})"))
    return tools


def _entry(entry: Any, where: str) -> tuple[str, dict[str, Any]]:
    """The spec and the args of one entry of a tools YAML file; ValueError saying what is wrong with it."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping with 'name' or 'import', got {entry!r}")
    unknown = set(entry) - {"name", "import", "args"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; an entry has 'name' or 'import', and "
                         "'args'")
    if ("name" in entry) == ("import" in entry):
        raise ValueError(f"{where}: needs exactly one of 'name' (a registered tool) or 'import' "
                         "(pkg.mod:attr)")
    spec = entry.get("name") or entry.get("import")
    args = entry.get("args") or {}
    if not isinstance(spec, str) or not isinstance(args, dict):
        raise ValueError(f"{where}: 'name' / 'import' must be a string and 'args' a mapping")
    if "import" in entry and ":" not in spec:
        raise ValueError(f"{where}: import {spec!r} must look like 'package.module:attr'")
    return spec, args


def _build(spec: str, args: dict[str, Any], where: str) -> Tool:
    if ":" in spec:
        target = _import(spec, where)
    elif spec in TOOL_REGISTRY:
        target = TOOL_REGISTRY[spec]
    else:
        known = ", ".join(sorted(TOOL_REGISTRY)) or "none"
        raise ValueError(f"{where}: no tool registered under that name (registered: {known}; a tool "
                         "registers when its module is imported), and it is not an import path "
                         "'package.module:attr'")
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
