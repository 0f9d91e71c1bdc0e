"""The tool layer of the agent runtime: what a tool is, how a set of them runs, where they come from.

A `Tool` has a name, a description and a JSON schema of its arguments; `execute` turns arguments
into the text the model sees next. Stateful tools set up per-episode resources in `create` (kept in
`Episode.state`) and free them in `release`, which always runs at the end of the episode
(shared/agent/tool_types.py).

    @tool
    def word_count(text: str, unique: bool = False) -> int:
        '''Count the words of a text.

        Args:
            text: The text to count.
            unique: Count each distinct word once.
        '''

`@tool` infers the schema from the signature and the description from the docstring
(shared/agent/function_tools.py).

A `ToolSet` is what an episode runs its calls through: concurrently but bounded, each call with a
time limit, arguments checked against the schema first (shared/agent/tool_arguments.py), long output cut.
Every failure becomes a `ToolResult` with `ok=False`, an `error_kind` and a message the model can act on;
nothing a tool does raises out of `ToolSet.execute`. Outcomes are counted in `ToolSet.counts` and in the
Prometheus counter `rollstream_tool_calls_total{tool, outcome}`.

Tools are named in configuration by a registered name (`register_tool`; the module that registers
must have been imported), by an import path `package.module:attr`, or in a YAML file
(shared/agent/tool_registry.py):

    - name: calculator
    - import: my_pkg.tools:Search
      args: {top_k: 5}

This module is the layer's one import for its users: it holds `ToolSet` and names the rest.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from collections.abc import Sequence

from prometheus_client import Counter as PrometheusCounter

from rollstream.shared.agent.function_tools import FunctionTool, tool
from rollstream.shared.agent.tool_arguments import check_arguments, json_type_of
from rollstream.shared.agent.tool_registry import TOOL_REGISTRY, load_tools_yaml, register_tool, resolve_tools
from rollstream.shared.agent.tool_types import Episode, ErrorKind, Tool, ToolCall, ToolResult, as_text
from rollstream.shared.errors import ToolError

__all__ = ["MALFORMED_CALL_NAME", "TOOL_CALLS", "TOOL_REGISTRY", "UNKNOWN_TOOL_LABEL", "Episode", "ErrorKind",
           "FunctionTool", "Tool", "ToolCall", "ToolError", "ToolResult", "ToolSet", "check_arguments",
           "load_tools_yaml", "register_tool", "resolve_tools", "tool"]

log = logging.getLogger(__name__)

MALFORMED_CALL_NAME = "invalid_tool_call"
TOOL_CALLS = PrometheusCounter(
    "rollstream_tool_calls", "Tool calls by tool and outcome ('ok' or the error kind).", ["tool", "outcome"])
UNKNOWN_TOOL_LABEL = "<unknown>"
"""Metric label of calls to tools that do not exist: the names a model invents must not become series."""

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI-style chat templates accept


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
            return self._result(call, f"unknown tool {call.name!r}; available tools: {available}",
                                "unknown_tool")
        if not isinstance(call.arguments, dict):
            return self._result(call, f"arguments of {call.name} must be a JSON object, got "
                                      f"{json_type_of(call.arguments)}", "bad_arguments")
        problems = check_arguments(call.arguments, t.parameters)
        if problems:
            return self._result(call, f"invalid arguments for {call.name}: {'; '.join(problems)}",
                                "bad_arguments")
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
        return self._result(call, content if isinstance(content, str) else as_text(content), None)

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
