"""Black-box episodes: an agent rollstream did not write, run unmodified as a command whose model turns go
through the gateway (services/gateway), which records the exact sampled tokens and publishes the trajectory.

A prompt whose agent is `command` (the row's `agent`, or agent.default) is one, for a coding task as the
coding tools take it (shared/agent/environments/coding.py: metadata "repo" and/or "files"; a Harbor task's row):

    {"prompt": "Fix `add` in calc.py", "agent": "command",
     "metadata": {"repo": "/data/tasks/fix-add/environment/workspace",
                  "command": "my-agent --task-file {task_file} --model openai/{model}",  # else agent.command
                  "time_budget_s": 900,     # Harbor: [agent] timeout_sec; else agent.command_time_budget_s
                  "grader": {"kind": "harbor", "task_dir": "/data/tasks/fix-add"}}}

One episode:

1. the task's workspace is made as the coding tools make theirs (a copy of the repository with a baseline
   snapshot, coding.get_workspace);
2. a gateway session is opened (POST /v1/sessions) with the prompt's ids, sample index, group size, label,
   reward function, sandbox check and grader, the rollout's sampling settings and the time budget;
3. the command line runs as `/bin/sh -c COMMAND` in its own process group, in the workspace's repository,
   with stdin closed and stdout and stderr in a log. In the command line `{task_file}` and `{model}` are
   replaced by the task file's path and the served model's name, shell-quoted. Its environment is clean
   (nothing of the agent-runner's, whose secrets it must not see) but for PATH, and holds:

       OPENAI_BASE_URL, OPENAI_API_BASE   the session's OpenAI base URL ({gateway}/s/{session}/v1;
                                          litellm reads OPENAI_API_BASE)
       OPENAI_API_KEY, ANTHROPIC_API_KEY  the session's key
       ANTHROPIC_BASE_URL                 the session's Anthropic base URL ({gateway}/s/{session})
       ROLLSTREAM_SESSION_ID              the session
       ROLLSTREAM_MODEL                   the served model's name (model.served_name)
       ROLLSTREAM_TASK                    the instruction: the prompt's last user message, without the
                                          note on the coding tools, which such an agent does not have
       ROLLSTREAM_TASK_FILE               a file holding the same text
       HOME                               an empty directory of the episode's, beside the repository
       LANG                               C.UTF-8

4. the time budget ends it: the whole process group is killed and the episode is "truncated"; a command
   that exits non-zero is "failed" (the reason and the end of its log in the error), one that exits 0
   "completed". Whatever it left running in its process group is killed either way;
5. the log is stored at {run_id}/artifacts/{rollout}.log and the workspace released (its diff stored at
   {run_id}/artifacts/{rollout}.diff), and the session is finished with the status, the error and the
   artifacts {"diff": ..., "log": ...}. The gateway publishes the trajectory; the agent-runner then
   acknowledges the prompt.

Nothing is made up: a gateway that does not answer (or answers 5xx) raises GatewayUnavailable, the
machinery's failure: the agent-runner keeps the prompt and runs it again once the gateway answers. A
gateway that refuses a call (4xx, e.g. a finish of a session with no model turn: nothing to train on)
raises GatewayRefused, the prompt's failure (retried, then dead-lettered). A session that is not finished
is deleted (DELETE, nothing published) as far as the gateway still answers.

The command runs on the host with the agent-runner's rights, and so do the commands the model makes it
run: give this mode to agents and tasks you would run yourself, or run the agent-runner in a container.

    python -m pytest tests/unit/services/agent_runner/test_blackbox.py -q
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rollstream.shared.agent.environments.coding import get_workspace, release_workspace, store_artifact
from rollstream.shared.agent.tools import Episode
from rollstream.shared.contract.events import PromptIssued
from rollstream.shared.errors import RollstreamError
from rollstream.shared.runtime.config import Settings
from rollstream.shared.tasks.prompts import TOOLS_NOTE

log = logging.getLogger(__name__)

COMMAND_AGENT = "command"
"""The agent name of black-box episodes."""
LOG_TAIL_BYTES = 4000
"""How much of the end of a failed command's log goes into the error."""
GATEWAY_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
"""Of one sessions-API call; a finish publishes the session's samples before it answers."""


class GatewayUnavailable(RollstreamError, RuntimeError):
    """The gateway did not answer a sessions-API call, or answered 5xx: the machinery's failure."""


class GatewayRefused(RollstreamError, RuntimeError):
    """The gateway answered a sessions-API call with a 4xx; the message says why."""


@dataclass(frozen=True)
class Outcome:
    """How the command ended, as the session is finished with."""

    status: str
    error: str | None
    artifacts: dict[str, str]


class GatewaySessions:
    """The gateway's sessions API (settings.gateway.url, with security.http_token when it is set)."""

    def __init__(self, settings: Settings, client: httpx.AsyncClient) -> None:
        self.url = settings.gateway.url.rstrip("/")
        self.client = client
        token = settings.security.http_token
        self.headers = {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}

    async def open(self, request: dict[str, Any]) -> dict[str, Any]:
        return (await self.call("POST", "/v1/sessions", request)).json()

    async def finish(self, session_id: str, outcome: Outcome) -> dict[str, Any]:
        body = {"status": outcome.status, "reward": None, "response_text": None, "artifacts": outcome.artifacts,
                "error": outcome.error}
        return (await self.call("POST", f"/v1/sessions/{session_id}/finish", body)).json()

    async def discard(self, session_id: str) -> None:
        """Delete the session, so that nothing is published for it; a gateway that cannot do it now lets it
        expire (gateway.session_ttl_s)."""
        try:
            await self.call("DELETE", f"/v1/sessions/{session_id}")
        except (GatewayUnavailable, GatewayRefused) as exc:
            log.warning("could not delete gateway session %s: %s", session_id, exc)

    async def answers(self) -> bool:
        """Whether the gateway answers HTTP at all (any status below 500)."""
        try:
            response = await self.client.get(self.url + "/", headers=self.headers)
        except httpx.TransportError:
            return False
        return response.status_code < 500

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        try:
            response = await self.client.request(method, self.url + path, json=body, headers=self.headers)
        except httpx.TransportError as exc:
            raise GatewayUnavailable(f"the gateway at {self.url} did not answer {method} {path}: "
                                     f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise GatewayUnavailable(f"the gateway at {self.url} failed {method} {path} "
                                     f"({response.status_code}): {_reason(response)}")
        if response.status_code >= 400:
            raise GatewayRefused(f"the gateway refused {method} {path} ({response.status_code}): "
                                 f"{_reason(response)}")
        return response


def _reason(response: httpx.Response) -> str:
    """The message of an error body in any of the gateway's shapes (OpenAI, Anthropic, FastAPI), else its text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:2000]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if body.get("detail"):
            return str(body["detail"])
    return response.text[:2000]


class BlackBoxRunner:
    """Runs black-box episodes; see the module docstring."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=GATEWAY_TIMEOUT)

    async def gateway_answers(self) -> bool:
        async with self.client() as client:
            return await GatewaySessions(self.settings, client).answers()

    async def run(self, prompt: PromptIssued, ids: dict[str, str | None]) -> None:
        """One episode, its session finished on the gateway (which publishes it) when this returns."""
        command = self.command_line(prompt)
        budget_s = self.time_budget_s(prompt)
        async with self.client() as client:
            gateway = GatewaySessions(self.settings, client)
            session = await gateway.open(self.session_request(prompt, ids, budget_s))
            # the gateway counts the budget from now too: the agent is not cut off there before it is here
            deadline = asyncio.get_running_loop().time() + budget_s
            session_id = session["session_id"]
            finished = False
            try:
                outcome = await self.episode(prompt, ids["rollout_id"], command, session, deadline, budget_s)
                try:
                    await gateway.finish(session_id, outcome)
                except GatewayRefused as exc:
                    raise GatewayRefused(f"{exc} (the episode was {outcome.status}"
                                         f"{': ' + outcome.error if outcome.error else ''})") from exc
                finished = True
            finally:
                if not finished:
                    await gateway.discard(session_id)

    def command_line(self, prompt: PromptIssued) -> str:
        command = prompt.metadata.get("command") or self.settings.agent.command
        if not isinstance(command, str) or not command.strip():
            raise ValueError("a command episode needs a command line: the row's metadata['command'] or "
                             "agent.command (RS_AGENT__COMMAND)")
        return command

    def time_budget_s(self, prompt: PromptIssued) -> float:
        budget = prompt.metadata.get("time_budget_s", self.settings.agent.command_time_budget_s)
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
            raise ValueError(f"metadata['time_budget_s'] must be a positive number of seconds, got {budget!r}")
        return float(budget)

    def session_request(self, prompt: PromptIssued, ids: dict[str, str | None], budget_s: float) -> dict[str, Any]:
        rollout = self.settings.rollout
        return {"rollout_id": ids["rollout_id"], "group_id": ids["group_id"], "trajectory_id": ids["trajectory_id"],
                "sample_index": prompt.sample_index, "group_size": prompt.group_size, "label": prompt.label,
                "reward_fn": prompt.reward_fn, "sandbox_check": prompt.sandbox_check,
                "grader": dict(prompt.metadata.get("grader") or {}), "metadata": dict(prompt.metadata),
                "sampling": {"temperature": rollout.temperature, "max_tokens": rollout.max_tokens},
                "time_budget_s": budget_s}

    async def episode(self, prompt: PromptIssued, episode_id: str, command: str, session: dict[str, Any],
                      deadline: float, budget_s: float) -> Outcome:
        """Run the command in the task's workspace; store its log and the workspace's diff."""
        settings = self.settings
        episode = Episode(episode_id=episode_id, run_id=settings.run_id, metadata=dict(prompt.metadata),
                          storage_uri=settings.storage_uri)
        workspace = await get_workspace(episode)
        try:
            scratch = await asyncio.to_thread(workspace.scratch, "agent")
            home = await asyncio.to_thread(workspace.scratch, "home")
            task = instruction(prompt.messages)
            task_file = scratch / "task.md"
            task_file.write_text(task)
            model = settings.model.served_name
            env = agent_environment(session, home, model, task, task_file)
            filled = command.replace("{task_file}", shlex.quote(str(task_file))).replace("{model}", shlex.quote(model))
            log_file = scratch / "command.log"
            status, error = await run_command(filled, workspace.root, env, log_file, deadline, budget_s)
            log_uri = await asyncio.to_thread(store_artifact, settings.storage_uri, log_file, settings.run_id,
                                              episode_id, ".log")
        finally:
            await release_workspace(episode)
        return Outcome(status=status, error=error, artifacts={**episode.artifacts, "log": log_uri})


def agent_environment(session: dict[str, Any], home: Path, model: str, task: str, task_file: Path) -> dict[str, str]:
    """The command's whole environment (see the module docstring): nothing of the agent-runner's but PATH."""
    return {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "OPENAI_BASE_URL": session["openai_base_url"], "OPENAI_API_BASE": session["openai_base_url"],
            "OPENAI_API_KEY": session["api_key"], "ANTHROPIC_BASE_URL": session["anthropic_base_url"],
            "ANTHROPIC_API_KEY": session["api_key"], "ROLLSTREAM_SESSION_ID": session["session_id"],
            "ROLLSTREAM_MODEL": model, "ROLLSTREAM_TASK": task, "ROLLSTREAM_TASK_FILE": str(task_file)}


def instruction(messages: list[dict[str, Any]]) -> str:
    """The last user message's text, without the note on the coding tools (shared/tasks/prompts.py) that a
    Harbor or SWE-bench row ends with: a black-box agent has tools of its own."""
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):  # OpenAI content parts
                content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
            return str(content or "").removesuffix(f"\n\n{TOOLS_NOTE}")
    raise ValueError("a command episode needs a user message: the task's instruction")


async def run_command(command: str, cwd: Path, env: dict[str, str], log_file: Path, deadline: float,
                      budget_s: float) -> tuple[str, str | None]:
    """Run `command` in its own process group until it exits or the loop's clock reaches `deadline` (the end
    of the episode's `budget_s`); returns the status and the error."""
    with await asyncio.to_thread(open, log_file, "wb") as output:
        process = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=output,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = await asyncio.wait_for(process.wait(), deadline - asyncio.get_running_loop().time())
    except TimeoutError:
        return "truncated", f"the time budget of {budget_s:g} s ran out: the command was killed"
    finally:
        # the group outlives its leader: an agent's tool processes left running would keep writing the tree
        _kill_group(process.pid)
        await process.wait()
    if code == 0:
        return "completed", None
    how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
    return "failed", f"the command {how}; the end of its output:\n{_tail(log_file)}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: Path) -> str:
    with open(path, "rb") as handle:
        handle.seek(max(0, handle.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
        return handle.read().decode("utf-8", errors="replace")
