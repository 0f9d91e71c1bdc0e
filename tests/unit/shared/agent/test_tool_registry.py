"""Where tools come from (shared/agent/tool_registry.py): a registered name, an import path, a YAML file;
a spec or an entry that names no tool says which and why."""

from __future__ import annotations

import re

import pytest

from rollstream.shared.agent.tools import (
    TOOL_REGISTRY,
    FunctionTool,
    load_tools_yaml,
    register_tool,
    resolve_tools,
)
from tests.unit.shared.agent import sample_tools
from tests.unit.shared.agent.sample_tools import Workspace, echo, make_workspace

SAMPLES = sample_tools.__name__
"""The module the import paths name."""


@pytest.fixture
def registry():
    saved = dict(TOOL_REGISTRY)
    yield TOOL_REGISTRY
    TOOL_REGISTRY.clear()
    TOOL_REGISTRY.update(saved)


def test_registered_tools_resolve_by_name(registry):
    register_tool("test_workspace")(Workspace)
    register_tool("test_workspace_factory")(make_workspace)
    register_tool("test_echo")(echo)
    built = resolve_tools(["test_workspace", "test_workspace_factory", "test_echo"])
    assert [type(t) for t in built] == [Workspace, Workspace, FunctionTool]
    assert built[1].prefix == "> " and built[2] is echo
    with pytest.raises(ValueError, match="already registered"):
        register_tool("test_echo")(echo)


def test_the_calculator_is_registered():
    import rollstream.shared.agent.environments.calculator  # noqa: F401  (registers it)

    [calculator] = resolve_tools(["calculator"])
    assert calculator.name == "calculator"


def test_tools_resolve_by_import_path():
    instance, from_class, from_factory = resolve_tools([f"{SAMPLES}:echo", f"{SAMPLES}:Workspace",
                                                        f"{SAMPLES}:make_workspace"])
    assert instance is echo
    assert type(from_class) is Workspace and from_class.prefix == ""
    assert type(from_factory) is Workspace and from_factory.prefix == "> "


@pytest.mark.parametrize("spec, message", [
    ("no_such_tool", "tool spec 'no_such_tool': no tool registered under that name"),
    ("no_such_module_xyz:thing", "tool spec 'no_such_module_xyz:thing': cannot import 'no_such_module_xyz'"),
    (f"{SAMPLES}:missing", f"{SAMPLES} has no attribute 'missing'"),
    (f"{SAMPLES}:not_a_tool_factory", "the factory returned 'hello', not a Tool"),
    (f"{SAMPLES}:NOT_A_TOOL", "is 42, not a Tool, a Tool subclass or a factory"),
])
def test_unresolvable_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_tools([spec])


def test_tools_load_from_yaml(tmp_path, registry):
    register_tool("test_workspace")(Workspace)
    path = tmp_path / "tools.yaml"
    path.write_text(f"- name: test_workspace\n"
                    f"- import: {SAMPLES}:Workspace\n"
                    f"  args: {{prefix: '$ '}}\n"
                    f"- import: {SAMPLES}:echo\n")
    workspace, configured, instance = load_tools_yaml(path)
    assert workspace.prefix == "" and configured.prefix == "$ " and instance is echo
    assert load_tools_yaml(_write(tmp_path, "")) == []


def _write(tmp_path, text: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    ("- name: nope_not_registered\n", "entry 0 .nope_not_registered.: no tool registered"),
    (f"- import: {SAMPLES}:echo\n- import: {SAMPLES}:nothing_here\n",
     "entry 1 .*has no attribute 'nothing_here'"),
    (f"- import: {SAMPLES}:Workspace\n  args: {{size: 3}}\n",
     "entry 0 .*building the tool failed: TypeError"),
    (f"- import: {SAMPLES}:echo\n  args: {{x: 1}}\n", "entry 0 .*instance, which takes no args"),
    ("- name: a\n  import: b:c\n", "entry 0: needs exactly one of"),
    ("- tool: calculator\n", r"entry 0: unknown keys \['tool'\]"),
    ("- calculator\n", "entry 0: expected a mapping"),
    ("- import: just_a_module\n", "entry 0: import 'just_a_module' must look like"),
    ("name: calculator\n", "expected a list of tool entries"),
    ("- [unclosed\n", "not valid YAML"),
])
def test_a_bad_yaml_file_names_the_file_and_the_entry(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as error:
        load_tools_yaml(path)
    assert str(error.value).startswith(f"{path}: ")
    assert re.search(message, str(error.value)), str(error.value)
