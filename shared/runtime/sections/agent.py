"""The agent loop's settings (`agent.*`, RS_AGENT__*): turns, tools and budgets of rollstream's own agents,
and the command, sandbox and runtime of black-box ones.

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from rollstream.shared.runtime.sections import Section


class AgentSettings(Section):
    default: str = "tool_agent"
    """Agent loop of rows that name none: a registered name or package.module:function."""
    tool_format: str = "hermes"
    """How the model writes tool calls (see shared/agent/tool_calls.py)."""
    max_turns: int = Field(4, ge=1)
    """Model turns per episode."""
    max_total_tokens: int = Field(1024, ge=16)
    """Context budget of one segment: prompt, responses and observations."""
    tool_concurrency: int = Field(8, ge=1)
    """Tool calls of one episode run at once."""
    max_tool_output_chars: int = Field(16_384, ge=64)
    """Tool results are cut to this length before the model sees them."""
    tool_timeout_s: float = Field(60.0, gt=0)
    """Time limit of one tool call."""
    tools_yaml: Path | None = None
    """Extra tools from a YAML file (see shared/agent/tools.py)."""
    command: str | None = None
    """Command line of black-box episodes (rows whose agent is `command`) that name none in
    metadata["command"]: an unmodified agent run in the task's sandbox, in its repository, through the
    gateway, `{task_file}` and `{model}` filled in (see services/agent_runner/blackbox.py)."""
    command_time_budget_s: float = Field(600.0, gt=0)
    """Wall-clock budget of a black-box episode whose row sets no metadata["time_budget_s"]; then its command
    is killed and the episode is truncated."""
    command_sandbox: Literal["bubblewrap", "docker"] | None = None
    """Sandbox a black-box episode's command runs in (its own network-less sandbox with the task's workspace
    at the task's WORKDIR; see services/agent_runner/agent_sandbox.py): bubblewrap or docker (the task's
    image); None: the grader's, grader.backend."""
    command_memory_mb: int = Field(8192, ge=256)
    """Memory of a black-box episode's sandbox: under bubblewrap what each process may map writable
    (RLIMIT_DATA), under docker the container's memory limit. Claude Code 2.1 (Bun) needs more than 512 MiB to
    start (`claude --version`), the grader's default."""
    command_runtime_dir: Path | None = None
    """Host directory holding the black-box agent's own runtime (a node_modules with its CLI, a virtualenv
    made with the sandbox's python3, static binaries in bin/), mounted read-only at /opt/agent in the sandbox,
    with /opt/agent/bin and /opt/agent/node_modules/.bin first on PATH. None: the command finds only what the
    sandbox has (bubblewrap: the host's /usr; docker: the task's image)."""
