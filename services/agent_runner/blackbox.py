"""Black-box episodes: an agent rollstream did not write, run unmodified as a command whose model turns go
through the gateway (services/gateway), which records the exact sampled tokens and publishes the trajectory.

A prompt whose agent is `command` (the row's `agent`, or agent.default) is one, for a coding task as the
coding tools take it (shared/agent/environments/coding.py: metadata "repo" and/or "files"; a Harbor task's
row):

    {"prompt": "Fix `add` in calc.py", "agent": "command",
     "metadata": {"repo": "/data/tasks/fix-add/environment/workspace",
                  "command": "my-agent --task-file {task_file} --model openai/{model}",  # else agent.command
                  "time_budget_s": 900,     # Harbor: [agent] timeout_sec; else agent.command_time_budget_s
                  "grader": {"kind": "harbor", "task_dir": "/data/tasks/fix-add"}}}

One episode:

1. the task's workspace is made as the coding tools make theirs (a copy of the repository with a baseline
   snapshot, coding.get_workspace), and its sandbox is prepared (agent_sandbox.py: the backend, the task's
   image, built now when docker has not got it yet, so that building it costs the agent none of its budget);
2. a gateway session is opened (POST /v1/sessions) with the prompt's ids, sample index, group size, label,
   reward function, sandbox check and grader, the prompt's role, the rollout's sampling settings (a seed of
   the rollout's own when rollout.seed is set) and the time budget;
3. the command line runs as `/bin/sh -c COMMAND` in the task's sandbox (agent_sandbox.py: bubblewrap or
   docker, agent.command_sandbox, default grader.backend), never on the host: the repository at the task's
   WORKDIR (a Harbor task's, e.g. /app; /workspace otherwise) is its working directory, it has no network but
   its way to its own gateway session, and nothing of the host is writable but the repository, its HOME and
   its log. Stdin is closed; stdout and stderr go to the log. In the command line `{task_file}` and `{model}`
   are replaced by the task file's path in the sandbox and the served model's name, shell-quoted. Its
   environment is clean (nothing of the agent-runner's, whose secrets it must not see) and holds:

       OPENAI_BASE_URL, OPENAI_API_BASE   the session's OpenAI base URL through the sandbox's forwarder,
                                          http://127.0.0.1:18300/s/{session}/v1 (litellm reads
                                          OPENAI_API_BASE)
       OPENAI_API_KEY, ANTHROPIC_API_KEY  the session's key
       ANTHROPIC_BASE_URL                 the session's Anthropic base URL, http://127.0.0.1:18300/s/{session}
       ROLLSTREAM_SESSION_ID              the session
       ROLLSTREAM_MODEL                   the served model's name (model.served_name)
       ROLLSTREAM_ROLE                    the session's role (the prompt's, else roles.default): its turns
                                          are sampled as it and train it
       ROLLSTREAM_ROLES                   the run's roles, comma-separated: a request that names one as its
                                          model (a sub-agent configured so) is sampled as that role and
                                          trains it, in conversations of its own (services/gateway)
       ROLLSTREAM_TASK                    the instruction: the prompt's last user message, without the
                                          note on the coding tools, which such an agent does not have
       ROLLSTREAM_TASK_FILE               a file holding the same text, /rollstream/episode/task.md
       HOME                               /home/agent, an empty directory of the episode's, outside the
                                          repository (what the agent writes there is in no diff)
       PATH                               the system's, after /opt/agent/bin and /opt/agent/node_modules/.bin
                                          when agent.command_runtime_dir (the agent's own runtime) is set
       LANG                               C.UTF-8

4. the time budget ends it: the sandbox's wall clock (the budget left since the session opened) kills
   everything in it and the episode is "truncated"; a command that exits non-zero is "failed" (the reason and
   the end of its log in the error), one that exits 0 "completed". Whatever it left running dies with the
   sandbox either way. A sandbox that could not run the command at all (no sandbox, no forwarder: e.g. a
   docker image without python3) raises AgentSandboxError, the machinery's failure, not an outcome;
5. the log is stored at {run_id}/artifacts/{rollout}.log and the workspace released (its diff stored at
   {run_id}/artifacts/{rollout}.diff), and the session is finished with the status, the error and the
   artifacts {"diff": ..., "log": ...}. The gateway publishes the trajectory; the agent-runner then
   acknowledges the prompt.

Nothing is made up: a gateway that does not answer (or answers 5xx) raises GatewayUnavailable, the
machinery's failure: the agent-runner keeps the prompt and runs it again once the gateway answers. A
gateway that refuses a call (4xx, e.g. a finish of a session with no model turn: nothing to train on)
raises GatewayRefused, the prompt's failure (retried, then dead-lettered). A session that is not finished
is deleted (DELETE, nothing published) as far as the gateway still answers; one that nobody finishes or
deletes (its agent-runner was killed) ends gateway.finish_grace_s after its deadline, nothing published.

What the agent needs in its sandbox: its runtime (agent.command_runtime_dir, e.g. a node_modules holding
Claude Code or codex, read-only at /opt/agent; node itself is the host's /usr/bin/node under bubblewrap and
must be in the image, or in the runtime dir's bin/, under docker), python3 for the forwarder (docker: in the
image), and agent.command_memory_mb of memory.

    python -m pytest tests/unit/services/agent_runner/test_blackbox.py -q
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rollstream.services.agent_runner.agent_sandbox import GATEWAY_PORT, TASK_FILE, AgentSandbox
from rollstream.services.agent_runner.gateway_forwarder import SessionForwarder
from rollstream.shared.agent.environments.coding_workspace import (
    get_workspace,
    release_workspace,
    store_artifact,
)
from rollstream.shared.agent.tools import Episode
from rollstream.shared.contract.events import PromptIssued
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.errors import RollstreamError
from rollstream.shared.runtime.config import Settings
from rollstream.shared.sandbox.base import SandboxResult
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
        body = {"status": outcome.status, "reward": None, "response_text": None,
                "artifacts": outcome.artifacts, "error": outcome.error}
        return (await self.call("POST", f"/v1/sessions/{session_id}/finish", body)).json()

    async def discard(self, session_id: str) -> None:
        """Delete the session, so that nothing is published for it; where the gateway cannot do it now, the
        session ends on its own gateway.finish_grace_s after its deadline."""
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
    """The message of an error body in any of the gateway's shapes (OpenAI, Anthropic, FastAPI), else its
    text."""
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
        self.roles = RunRoles.of(settings)
        # a sandbox's run blocks its thread for the whole episode: on the loop's default executor (a few
        # threads) the episodes would starve every other to_thread call of the agent-runner (acks, claims)
        self.sandbox_threads = ThreadPoolExecutor(max_workers=settings.rollout.concurrency,
                                                  thread_name_prefix="agent-sandbox")

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=GATEWAY_TIMEOUT)

    async def gateway_answers(self) -> bool:
        async with self.client() as client:
            return await GatewaySessions(self.settings, client).answers()

    async def run(self, prompt: PromptIssued, ids: dict[str, str | None]) -> str:
        """One episode, its session finished on the gateway (which publishes it) when this returns; returns
        the episode's status."""
        command = self.command_line(prompt)
        budget_s = self.time_budget_s(prompt)
        settings = self.settings
        episode = Episode(episode_id=ids["rollout_id"], run_id=settings.run_id,
                          metadata=dict(prompt.metadata), storage_uri=settings.storage_uri)
        workspace = await get_workspace(episode)
        try:
            sandbox = await asyncio.to_thread(AgentSandbox.prepare, settings, workspace, prompt.metadata)
            async with self.client() as client:
                gateway = GatewaySessions(settings, client)
                session = await gateway.open(self.session_request(prompt, ids, budget_s))
                # the gateway counts the budget from now too: the agent is not cut off there before it is here
                deadline = asyncio.get_running_loop().time() + budget_s
                session_id = session["session_id"]
                finished = False
                try:
                    outcome = await self.episode(prompt, episode, sandbox, command, session, deadline,
                                                 budget_s)
                    try:
                        await gateway.finish(session_id, outcome)
                    except GatewayRefused as exc:
                        raise GatewayRefused(f"{exc} (the episode was {outcome.status}"
                                             f"{': ' + outcome.error if outcome.error else ''})") from exc
                    finished = True
                finally:
                    if not finished:
                        await gateway.discard(session_id)
        finally:
            await release_workspace(episode)
        return outcome.status

    def command_line(self, prompt: PromptIssued) -> str:
        command = prompt.metadata.get("command") or self.settings.agent.command
        if not isinstance(command, str) or not command.strip():
            raise ValueError("a command episode needs a command line: the row's metadata['command'] or "
                             "agent.command (RS_AGENT__COMMAND)")
        return command

    def time_budget_s(self, prompt: PromptIssued) -> float:
        budget = prompt.metadata.get("time_budget_s", self.settings.agent.command_time_budget_s)
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
            raise ValueError("metadata['time_budget_s'] must be a positive number of seconds, "
                             f"got {budget!r}")
        return float(budget)

    def session_request(self, prompt: PromptIssued, ids: dict[str, str | None],
                        budget_s: float) -> dict[str, Any]:
        rollout = self.settings.rollout
        seed = {"seed": rollout_seed(rollout.seed, ids["rollout_id"])} if rollout.seed is not None else {}
        return {"rollout_id": ids["rollout_id"], "group_id": ids["group_id"],
                "trajectory_id": ids["trajectory_id"], "sample_index": prompt.sample_index,
                "group_size": prompt.group_size, "label": prompt.label, "reward_fn": prompt.reward_fn,
                "sandbox_check": prompt.sandbox_check, "grader": dict(prompt.metadata.get("grader") or {}),
                "metadata": dict(prompt.metadata),
                "sampling": {"temperature": rollout.temperature, "max_tokens": rollout.max_tokens, **seed},
                "time_budget_s": budget_s, "role": self.roles.resolve(prompt.role)}

    async def episode(self, prompt: PromptIssued, episode: Episode, sandbox: AgentSandbox, command: str,
                      session: dict[str, Any], deadline: float, budget_s: float) -> Outcome:
        """Run the command in the task's sandbox; store its log and the workspace's diff."""
        settings = self.settings
        task = instruction(prompt.messages)
        sandbox.write_task(task)
        model = settings.model.served_name
        env = {**sandbox.environment(), **agent_environment(session, model, task),
               **role_environment(self.roles, prompt.role)}
        filled = command.replace("{task_file}", shlex.quote(TASK_FILE)).replace("{model}", shlex.quote(model))
        async with SessionForwarder(sandbox.socket_path, settings.gateway.url, session["session_id"]):
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self.sandbox_threads, sandbox.run, filled, env,
                                                deadline - loop.time())
        log_file = await asyncio.to_thread(sandbox.take_log)
        status, error = outcome_of(result, budget_s, log_file)
        log_uri = await asyncio.to_thread(store_artifact, settings.storage_uri, log_file, settings.run_id,
                                          episode.episode_id, ".log")
        await release_workspace(episode)
        return Outcome(status=status, error=error, artifacts={**episode.artifacts, "log": log_uri})


def rollout_seed(run_seed: int, rollout_id: str) -> int:
    """The sampling seed of a rollout's turns (32 bits): the same run seed and rollout id give the same seed
    in every process."""
    return int.from_bytes(hashlib.blake2b(f"{run_seed}:{rollout_id}".encode(), digest_size=4).digest(), "big")


def agent_environment(session: dict[str, Any], model: str, task: str) -> dict[str, str]:
    """The episode's own part of the command's environment (see the module docstring): its session, reached
    through the sandbox's forwarder, and its task."""
    base_url = f"http://127.0.0.1:{GATEWAY_PORT}/s/{session['session_id']}"
    return {"OPENAI_BASE_URL": f"{base_url}/v1", "OPENAI_API_BASE": f"{base_url}/v1",
            "OPENAI_API_KEY": session["api_key"], "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": session["api_key"], "ROLLSTREAM_SESSION_ID": session["session_id"],
            "ROLLSTREAM_MODEL": model, "ROLLSTREAM_TASK": task, "ROLLSTREAM_TASK_FILE": TASK_FILE}


def role_environment(roles: RunRoles, role: str | None) -> dict[str, str]:
    """The session's role and the run's roles, as the command's environment names them."""
    return {"ROLLSTREAM_ROLE": roles.resolve(role), "ROLLSTREAM_ROLES": ",".join(roles.names)}


def outcome_of(result: SandboxResult, budget_s: float, log_file: Path) -> tuple[str, str | None]:
    """The episode's status and error from how the sandbox ended."""
    if result.timed_out:
        return "truncated", f"the time budget of {budget_s:g} s ran out: the command was killed"
    if result.exit_code == 0:
        return "completed", None
    how = f"exited with status {result.exit_code}"
    if result.reason != f"exit {result.exit_code}":  # a signal (128 + N), named with its likely cause
        how += f" ({result.reason})"
    return "failed", f"the command {how}; the end of its output:\n{_tail(log_file)}"


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


def _tail(path: Path) -> str:
    with open(path, "rb") as handle:
        handle.seek(max(0, handle.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
        return handle.read().decode("utf-8", errors="replace")
