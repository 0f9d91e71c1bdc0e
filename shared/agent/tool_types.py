"""What a tool is, and what passes between it and the episode that calls it: the `Tool` base class, the
call the model made (`ToolCall`), what the call produced (`ToolResult`), and what a tool sees of the
running episode (`Episode`). shared/agent/tools.py says how a set of tools runs and where tools come from.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

ErrorKind = Literal["unknown_tool", "bad_arguments", "raised", "timeout", "malformed"]


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

    async def create(self, episode: Episode) -> None:  # noqa: B027  (optional: most tools hold no state)
        """Set up what this tool needs for one episode (stateful tools keep it in `episode.state`)."""

    @abstractmethod
    async def execute(self, arguments: dict[str, Any], episode: Episode) -> str:
        """Run one call; the returned text is what the model sees. Raise `ToolError` to tell the model
        what went wrong."""

    async def release(self, episode: Episode) -> None:  # noqa: B027  (optional, like create)
        """Free what `create` set up. Runs at the end of every episode, also when `create` failed or
        never ran, and possibly twice (see `ToolSet.start`), so it must tolerate missing state."""

    def schema(self) -> dict:
        """The tool in OpenAI function-tool format, as chat templates expect it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self, 'name', '?')!r}>"


def as_text(value: Any) -> str:
    """The text the model sees of what a tool returned: a string as it is, None as nothing, JSON for a dict
    or a list, str() of anything else."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)
