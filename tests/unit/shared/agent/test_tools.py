"""How a ToolSet runs calls (shared/agent/tools.py): concurrently but bounded and in call order, arguments
checked against the schema first (shared/agent/tool_arguments.py), long output cut, every failure a
result with a message and counted; and each tool's create and release once per episode."""

from __future__ import annotations

import asyncio
import threading

import pytest
from prometheus_client import REGISTRY

from rollstream.shared.agent.tools import Episode, ToolCall, ToolSet, tool
from tests.unit.shared.agent.sample_tools import Workspace, add, call, echo, fail, pick, run, sleepy


def metric(tool_name: str, outcome: str) -> float:
    labels = {"tool": tool_name, "outcome": outcome}
    return REGISTRY.get_sample_value("rollstream_tool_calls_total", labels) or 0.0


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

    calls = [call("busy", i) for i in range(10)]
    results = run(ToolSet([busy], max_concurrency=3).execute(calls, Episode("ep")))
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
    assert (result.ok, result.error_kind) == (False, kind)
    assert (result.call_id, result.name) == ("call_0_0", the_call.name)
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
    calls = [call("lines", 0, start=0), call("lines", 1, step=2)]
    [low, ok_number] = run(tools.execute(calls, Episode("ep")))
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
            calls = [call("workspace", i, line=line) for i, line in enumerate(lines)]
            results = await tools.execute(calls, ep)
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
