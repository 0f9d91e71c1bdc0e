"""Tools the tests of the tool layer run (test_tools.py, test_function_tools.py, test_tool_registry.py):
function tools of every kind, a stateful tool that counts its lifecycle calls, and things that are not
tools, for the registry to refuse by their import path."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from rollstream.shared.agent.tools import Episode, Tool, ToolCall, ToolError, tool


def run(coro):
    return asyncio.run(coro)


def call(name: str, index: int = 0, **arguments: Any) -> ToolCall:
    return ToolCall(id=f"call_0_{index}", name=name, arguments=arguments)


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
