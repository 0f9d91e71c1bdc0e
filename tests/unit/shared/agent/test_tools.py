"""The tool layer: schemas from signatures, how a ToolSet runs calls, and where tools come from."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any, Literal, Optional

import pytest
from prometheus_client import REGISTRY

from rollstream.shared.agent.tools import (
    TOOL_REGISTRY,
    Episode,
    FunctionTool,
    Tool,
    ToolCall,
    ToolError,
    ToolSet,
    load_tools_yaml,
    register_tool,
    resolve_tools,
    tool,
)


def run(coro):
    return asyncio.run(coro)


def call(name: str, index: int = 0, **arguments: Any) -> ToolCall:
    return ToolCall(id=f"call_0_{index}", name=name, arguments=arguments)


def metric(tool_name: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("rollstream_tool_calls_total", {"tool": tool_name, "outcome": outcome}) or 0.0


# ------------------------------------------------------------------------------------ test tools
@tool
def echo(text: str) -> str:
    """Say the text back."""
    return text


@tool
async def add(a: int, b: int = 1) -> int:
    """Add two integers."""
    return a + b


@tool
def pick(colour: Literal["red", "green"], sizes: list[int], note: str | None = None) -> str:
    """Pick a colour."""
    return f"{colour} {sizes} {note}"


@tool
def fail(message: str, as_tool_error: bool = True) -> str:
    """Fail on purpose."""
    if as_tool_error:
        raise ToolError(message)
    raise ValueError(message)


@tool
async def sleepy(seconds: float) -> str:
    """Sleep a while."""
    await asyncio.sleep(seconds)
    return "woke"


class Workspace(Tool):
    """A stateful tool: a per-episode list it appends to; counts its lifecycle calls."""

    name = "workspace"
    description = "Append a line to the episode's workspace."
    parameters = {"type": "object", "properties": {"line": {"type": "string"}}, "required": ["line"]}

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.created: list[str] = []
        self.released: list[str] = []

    async def create(self, episode: Episode) -> None:
        self.created.append(episode.episode_id)
        episode.state["lines"] = []

    async def execute(self, arguments: dict[str, Any], episode: Episode) -> str:
        if arguments["line"] == "crash":
            raise RuntimeError("disk on fire")
        episode.state["lines"].append(self.prefix + arguments["line"])
        return f"{len(episode.state['lines'])} lines"

    async def release(self, episode: Episode) -> None:
        self.released.append(episode.episode_id)
        episode.state.pop("lines", None)


def make_workspace() -> Workspace:
    return Workspace(prefix="> ")


def not_a_tool_factory() -> str:
    return "hello"


NOT_A_TOOL = 42


# ------------------------------------------------------------------------------------ schemas
def test_schema_is_in_openai_function_format():
    assert echo.schema() == {
        "type": "function",
        "function": {
            "name": "echo",
            "description": "Say the text back.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                           "required": ["text"], "additionalProperties": False},
        },
    }


def test_parameters_with_defaults_are_optional_and_show_the_default():
    params = add.parameters
    assert params["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer", "default": 1}}
    assert params["required"] == ["a"]


def test_literal_list_and_optional_types():
    props = pick.parameters["properties"]
    assert props["colour"] == {"type": "string", "enum": ["red", "green"]}
    assert props["sizes"] == {"type": "array", "items": {"type": "integer"}}
    assert props["note"] == {"type": ["string", "null"], "default": None}
    assert pick.parameters["required"] == ["colour", "sizes"]


def test_more_types():
    @tool
    def f(ratio: float, flag: bool, tags: dict[str, int], anything: dict, mode: Optional[Literal[1, 2]],
          either: int | str, items: list) -> None:
        """Types."""

    props = f.parameters["properties"]
    assert props["ratio"] == {"type": "number"}
    assert props["flag"] == {"type": "boolean"}
    assert props["tags"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert props["anything"] == {"type": "object"}
    assert props["mode"] == {"type": ["integer", "null"], "enum": [1, 2, None]}
    assert props["either"] == {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    assert props["items"] == {"type": "array"}
    assert f.parameters["required"] == list(props)


def test_description_and_argument_docs_come_from_the_docstring():
    @tool(name="search_docs")
    def search(query: str, limit: int = 5) -> list[str]:
        """Search the documentation
        for a phrase.

        Longer explanation the model does not need.

        Args:
            query (str): What to look for;
                exact phrases in quotes.
            limit: How many hits to return.

        Returns:
            The hits.
        """
        return []

    assert search.name == "search_docs"
    assert search.description == "Search the documentation for a phrase."
    props = search.parameters["properties"]
    assert props["query"]["description"] == "What to look for; exact phrases in quotes."
    assert props["limit"] == {"type": "integer", "description": "How many hits to return.", "default": 5}


def test_episode_parameter_is_passed_and_not_in_the_schema():
    @tool
    def whoami(episode: Episode, loud: bool = False) -> str:
        """Name the episode."""
        return episode.episode_id.upper() if loud else episode.episode_id

    assert list(whoami.parameters["properties"]) == ["loud"]
    results = run(ToolSet([whoami]).execute([call("whoami", loud=True)], Episode("ep-7")))
    assert results[0].content == "EP-7"


def test_functions_that_cannot_be_tools_are_refused_when_decorated():
    with pytest.raises(ValueError, match="docstring"):
        tool(lambda x: x)
    with pytest.raises(TypeError, match="'x' has no type annotation"):
        @tool
        def untyped(x) -> str:
            """Untyped."""
    with pytest.raises(TypeError, match="cannot describe"):
        @tool
        def odd(x: set[int]) -> str:
            """Sets are not JSON."""
    with pytest.raises(TypeError, match="args"):
        @tool
        def variadic(*args: int) -> str:
            """Variadic."""


# ------------------------------------------------------------------------------------ running calls
def test_sync_and_async_tools_run_and_sync_ones_run_off_the_event_loop():
    loop_threads = []

    @tool
    def where() -> str:
        """Which thread runs this."""
        return str(threading.get_ident())

    async def main():
        loop_threads.append(threading.get_ident())
        return await ToolSet([echo, add, where]).execute(
            [call("echo", 0, text="hi"), call("add", 1, a=2), call("where", 2)], Episode("ep"))

    results = run(main())
    assert [r.content for r in results[:2]] == ["hi", "3"]
    assert all(r.ok and r.error_kind is None for r in results)
    assert results[2].content != str(loop_threads[0])


def test_results_come_back_in_call_order():
    calls = [call("sleepy", i, seconds=0.01 * (5 - i)) for i in range(5)]  # the first call finishes last
    results = run(ToolSet([sleepy]).execute(calls, Episode("ep")))
    assert [r.call_id for r in results] == [c.id for c in calls]


def test_at_most_max_concurrency_calls_run_at_once():
    active = peak = 0

    @tool
    async def busy() -> str:
        """Hold a slot for a moment."""
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        for _ in range(5):
            await asyncio.sleep(0)
        active -= 1
        return "done"

    results = run(ToolSet([busy], max_concurrency=3).execute([call("busy", i) for i in range(10)], Episode("ep")))
    assert all(r.ok for r in results)
    assert peak == 3


def test_long_output_is_cut_with_a_marker_saying_how_much():
    text = "a" * 60 + "b" * 40
    [result] = run(ToolSet([echo], max_output_chars=20).execute([call("echo", text=text)], Episode("ep")))
    assert "[... 80 characters cut ...]" in result.content
    assert result.content.startswith("a" * 10) and result.content.endswith("b" * 10)
    [short] = run(ToolSet([echo], max_output_chars=20).execute([call("echo", text="short")], Episode("ep")))
    assert short.content == "short"


@pytest.mark.parametrize("the_call, kind, message", [
    (call("nope"), "unknown_tool", "unknown tool 'nope'; available tools: echo, add, pick, fail, sleepy"),
    (call("echo"), "bad_arguments", "missing required argument text"),
    (call("echo", text="x", loud=True), "bad_arguments", "unexpected argument loud (known arguments: text)"),
    (call("add", a="2"), "bad_arguments", 'a: expected integer, got string "2"'),
    (call("add", a=True), "bad_arguments", "a: expected integer, got boolean true"),
    (call("pick", colour="blue", sizes=[1]), "bad_arguments", '"blue" is not one of "red", "green"'),
    (call("pick", colour="red", sizes=[1, "2"]), "bad_arguments", "sizes[1]: expected integer"),
    (ToolCall("call_0_0", "echo", ["x"]), "bad_arguments", "must be a JSON object"),  # type: ignore[arg-type]
    (call("fail", message="no such file"), "raised", "no such file"),
    (call("fail", message="boom", as_tool_error=False), "raised", "ValueError: boom"),
    (call("sleepy", seconds=10), "timeout", "sleepy did not finish within 0.05s"),
])
def test_every_failure_is_a_result_with_a_message_and_is_counted(the_call, kind, message):
    tools = ToolSet([echo, add, pick, fail, sleepy], timeout_s=0.05)
    metric_label = the_call.name if the_call.name in tools.tools else "<unknown>"
    before = metric(metric_label, kind)
    [result] = run(tools.execute([the_call], Episode("ep")))
    assert (result.ok, result.error_kind, result.call_id, result.name) == (False, kind, "call_0_0", the_call.name)
    assert message in result.content
    if kind == "raised" and "ValueError" not in message:
        assert result.content == message  # a ToolError is the model's message, nothing added
    assert tools.counts[(the_call.name, kind)] == 1
    assert metric(metric_label, kind) == before + 1


def test_several_problems_with_the_arguments_are_all_reported():
    [result] = run(ToolSet([pick]).execute([call("pick", colour=3, extra=1)], Episode("ep")))
    assert "missing required argument sizes" in result.content
    assert "unexpected argument extra" in result.content
    assert "colour: expected string, got integer 3" in result.content


def test_hand_written_schemas_are_checked_too():
    class Lines(Workspace):
        name = "lines"
        parameters = {"type": "object", "additionalProperties": False,
                      "properties": {"start": {"type": "integer", "minimum": 1}, "step": {"type": "number"}}}

    tools = ToolSet([Lines()])
    [low, ok_number] = run(tools.execute([call("lines", 0, start=0), call("lines", 1, step=2)], Episode("ep")))
    assert low.error_kind == "bad_arguments" and "start: 0 is less than the minimum 1" in low.content
    assert ok_number.error_kind != "bad_arguments"  # an integer is a number


def test_successes_are_counted_too():
    tools = ToolSet([echo])
    before = metric("echo", "ok")
    run(tools.execute([call("echo", 0, text="a"), call("echo", 1, text="b")], Episode("ep")))
    assert tools.counts[("echo", "ok")] == 2
    assert metric("echo", "ok") == before + 2


def test_two_tools_with_one_name_are_refused():
    with pytest.raises(ValueError, match="two tools are named 'echo'"):
        ToolSet([echo, tool(name="echo")(add.fn)])


# ------------------------------------------------------------------------------------ lifecycle
def test_create_and_release_run_once_per_episode_and_state_is_per_episode():
    workspace = Workspace()
    tools = ToolSet([workspace, echo])

    async def episode(episode_id: str, lines: list[str]) -> list[str]:
        ep = Episode(episode_id)
        await tools.start(ep)
        try:
            results = await tools.execute([call("workspace", i, line=line) for i, line in enumerate(lines)], ep)
            return [r.content for r in results]
        finally:
            await tools.close(ep)

    async def main():
        return await asyncio.gather(episode("a", ["x", "y"]), episode("b", ["z"]))

    a, b = run(main())
    assert sorted(a) == ["1 lines", "2 lines"] and b == ["1 lines"]
    assert sorted(workspace.created) == ["a", "b"]
    assert sorted(workspace.released) == ["a", "b"]


def test_release_runs_even_when_a_tool_raised():
    workspace = Workspace()
    tools = ToolSet([workspace])
    ep = Episode("ep")

    async def main():
        await tools.start(ep)
        try:
            return await tools.execute([call("workspace", line="crash")], ep)
        finally:
            await tools.close(ep)

    [result] = run(main())
    assert result.error_kind == "raised" and result.content == "RuntimeError: disk on fire"
    assert workspace.released == ["ep"] and "lines" not in ep.state


def test_close_never_raises_and_releases_every_tool():
    class BrokenRelease(Workspace):
        name = "broken"

        async def release(self, episode: Episode) -> None:
            raise OSError("cannot unmount")

    broken, workspace = BrokenRelease(), Workspace()
    tools = ToolSet([workspace, broken])
    run(tools.close(Episode("ep")))
    assert workspace.released == ["ep"]


def test_a_failing_create_releases_every_tool_and_raises():
    class BrokenCreate(Workspace):
        name = "broken"

        async def create(self, episode: Episode) -> None:
            raise OSError("no sandbox")

    first, broken = Workspace(), BrokenCreate()
    with pytest.raises(OSError, match="no sandbox"):
        run(ToolSet([first, broken]).start(Episode("ep")))
    assert first.created == ["ep"] and first.released == ["ep"] and broken.released == ["ep"]


# ------------------------------------------------------------------------------------ where tools come from
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
    here = __name__
    instance, from_class, from_factory = resolve_tools([f"{here}:echo", f"{here}:Workspace", f"{here}:make_workspace"])
    assert instance is echo
    assert type(from_class) is Workspace and from_class.prefix == ""
    assert type(from_factory) is Workspace and from_factory.prefix == "> "


@pytest.mark.parametrize("spec, message", [
    ("no_such_tool", "tool spec 'no_such_tool': no tool registered under that name"),
    ("no_such_module_xyz:thing", "tool spec 'no_such_module_xyz:thing': cannot import 'no_such_module_xyz'"),
    (f"{__name__}:missing", f"{__name__} has no attribute 'missing'"),
    (f"{__name__}:not_a_tool_factory", "the factory returned 'hello', not a Tool"),
    (f"{__name__}:NOT_A_TOOL", "is 42, not a Tool, a Tool subclass or a factory"),
])
def test_unresolvable_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_tools([spec])


def test_tools_load_from_yaml(tmp_path, registry):
    register_tool("test_workspace")(Workspace)
    path = tmp_path / "tools.yaml"
    path.write_text(f"- name: test_workspace\n"
                    f"- import: {__name__}:Workspace\n"
                    f"  args: {{prefix: '$ '}}\n"
                    f"- import: {__name__}:echo\n")
    workspace, configured, instance = load_tools_yaml(path)
    assert workspace.prefix == "" and configured.prefix == "$ " and instance is echo
    assert load_tools_yaml(_write(tmp_path, "")) == []


def _write(tmp_path, text: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    ("- name: nope_not_registered\n", "entry 0 .nope_not_registered.: no tool registered"),
    (f"- import: {__name__}:echo\n- import: {__name__}:nothing_here\n", "entry 1 .*has no attribute 'nothing_here'"),
    (f"- import: {__name__}:Workspace\n  args: {{size: 3}}\n", "entry 0 .*building the tool failed: TypeError"),
    (f"- import: {__name__}:echo\n  args: {{x: 1}}\n", "entry 0 .*instance, which takes no args"),
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
