"""The sandbox a black-box episode's command runs in (blackbox.py): the task's sandbox, through the backend
protocol the grader and the coding tools use (shared/sandbox/), with the agent's way to its gateway session as
its only way out.

The backend is agent.command_sandbox (default: grader.backend): bubblewrap, whose environment is the host's
/usr (without the grader's pytest helper, whose PYTHONPATH would shadow the agent runtime's own packages), or
docker, in the task's image (a Harbor task's environment/Dockerfile, built once; python:3.11-slim for other
rows). The sandbox has no network: bubblewrap gives it a network namespace of its own with only a loopback,
docker network "none". What it sees of the host:

    the task's WORKDIR          the workspace's repository (rw): a Harbor task's WORKDIR (/app unless its
                                Dockerfile says otherwise), /workspace for other rows; the command's cwd
    /home/agent                 HOME (rw): an empty directory of the episode's, beside the repository and
                                never in its diff (the agent's config files and caches land here)
    /rollstream/log             the command's log, command.log (rw, but the directory stays ours: under
                                docker and as root the sandbox can write the file, not replace it)
    /rollstream/episode         read-only: task.md (the task file), forwarder.py (sandbox_forwarder.py) and
                                gateway.sock, the agent-runner's end of the way to the gateway
    /opt/agent                  agent.command_runtime_dir, read-only, when set: the agent's own runtime
                                (/opt/agent/bin and /opt/agent/node_modules/.bin lead PATH)

Nothing else of the host is writable (the root file system is read-only; /tmp is the sandbox's own tmpfs).
The way out: the agent-runner serves gateway.sock (gateway_forwarder.SessionForwarder: only the session's
own paths, /s/{session}/..., go on to gateway.url), and inside the sandbox forwarder.py listens on the
sandbox's own loopback, 127.0.0.1:GATEWAY_PORT, and pipes each connection to that socket. The forwarder runs
with the sandbox's python3 (bubblewrap: the host's; docker: the image's, which must have one: the episode
fails with that reason otherwise). Python, rather than a binary of ours, because every sandbox that runs
Python tasks has it, it needs no build per architecture, and it is a file anyone can read.

The command runs as `/bin/sh -c COMMAND` after the forwarder listens, with stdin closed and stdout and stderr
appended to the log (not held in memory). Limits: the grader's for test runs (processes and threads, file
size, open files, /tmp size; shared/grading/runs.py DEFAULT_GRADE_LIMITS), agent.command_memory_mb for memory
(RLIMIT_DATA per process under bubblewrap, the container's limit under docker: agent runtimes need more than
the grader's 512 MiB), and the episode's time budget as the wall clock, which kills the whole sandbox
(its pid namespace: nothing the command started, in the background, in a new session or double-forked, lives
on). CPU time per process is bounded only by the wall clock on every core.

If the agent-runner dies mid-episode: bwrap runs with --die-with-parent; a container is ended by the
forwarder when its lifeline to gateway.sock breaks, and removed by `remove_orphaned_containers` when an
agent-runner starts (docker labels every container with the process that made it).

    python -m pytest tests/unit/services/agent_runner -q
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import shutil
import stat
from pathlib import Path
from typing import Any

from docker.errors import DockerException

from rollstream.services.agent_runner.sandbox_forwarder import READY
from rollstream.shared.agent.environments.coding import Workspace
from rollstream.shared.errors import BackendUnavailable, RollstreamError
from rollstream.shared.grading.runs import DEFAULT_GRADE_LIMITS, run_wrapped
from rollstream.shared.runtime.config import Settings
from rollstream.shared.sandbox.backends import get_backend
from rollstream.shared.sandbox.base import SandboxBackend, SandboxResult
from rollstream.shared.sandbox.docker import DEFAULT_IMAGE, DockerBackend

log = logging.getLogger(__name__)

HOME = "/home/agent"
LOG_DIR = "/rollstream/log"
LOG_FILE = f"{LOG_DIR}/command.log"
EPISODE_DIR = "/rollstream/episode"
TASK_FILE = f"{EPISODE_DIR}/task.md"
FORWARDER = f"{EPISODE_DIR}/forwarder.py"
GATEWAY_SOCKET = f"{EPISODE_DIR}/gateway.sock"
RUNTIME_DIR = "/opt/agent"
GATEWAY_PORT = 18300
"""Where the sandbox's forwarder listens on the sandbox's own loopback (out of the way of the ports an agent's
dev servers take)."""
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OUTPUT_BYTES = 64 * 1024
"""What the backend keeps of the sandbox's own stdout and stderr (the markers, a setup error): the command's
output goes to the log."""


class AgentSandboxError(RollstreamError, RuntimeError):
    """The black-box agent's sandbox could not run its command (no sandbox, no forwarder): the machinery's
    failure, never the agent's outcome."""


class AgentSandbox:
    """One episode's sandbox over its coding workspace (shared/agent/environments/coding.py): the scratch
    directories beside the repository, the backend and image; `run` blocks."""

    def __init__(self, workspace: Workspace, backend: SandboxBackend, image: str | None,
                 runtime_dir: Path | None, memory_mb: int) -> None:
        self.workspace = workspace
        self.backend = backend
        self.image = image
        self.runtime_dir = runtime_dir
        self.memory_mb = memory_mb
        self.episode_dir = workspace.scratch("sandbox")
        self.home = workspace.scratch("home")
        self.log_dir = workspace.scratch("log")
        log_file = self.log_dir / "command.log"
        log_file.touch()
        log_file.chmod(0o666)  # the sandbox's user is not ours (docker; bubblewrap as root)
        forwarder = self.episode_dir / "forwarder.py"
        shutil.copyfile(Path(__file__).with_name("sandbox_forwarder.py"), forwarder)
        forwarder.chmod(0o644)

    @classmethod
    def prepare(cls, settings: Settings, workspace: Workspace, metadata: dict[str, Any]) -> AgentSandbox:
        """The backend agent.command_sandbox (else grader.backend) names, the task's image (built when the
        backend has images and it is not there yet), the scratch directories."""
        runtime_dir = settings.agent.command_runtime_dir
        if runtime_dir is not None:
            runtime_dir = runtime_dir.resolve()
            if not runtime_dir.is_dir():
                raise ValueError(f"agent.command_runtime_dir {runtime_dir} is not a directory")
        name = settings.agent.command_sandbox or settings.grader.backend
        backend = get_backend(name, **({"python_tools": False} if name == "bubblewrap" else {}))
        image = backend.image_for(task_environment(metadata))
        return cls(workspace, backend, image, runtime_dir, settings.agent.command_memory_mb)

    @property
    def socket_path(self) -> Path:
        """gateway.sock on the host."""
        return self.episode_dir / "gateway.sock"

    def write_task(self, text: str) -> None:
        task_file = self.episode_dir / "task.md"
        task_file.write_text(text)
        task_file.chmod(0o644)

    def environment(self) -> dict[str, str]:
        """PATH (the runtime's directories first), HOME and LANG; the caller adds the episode's own."""
        path = SYSTEM_PATH
        if self.runtime_dir is not None:
            path = f"{RUNTIME_DIR}/bin:{RUNTIME_DIR}/node_modules/.bin:{path}"
        return {"PATH": path, "HOME": HOME, "LANG": "C.UTF-8"}

    def run(self, command: str, env: dict[str, str], wall_time_s: float) -> SandboxResult:
        """Start the forwarder, then run `command` with `env` until it exits or `wall_time_s` ends the
        sandbox. AgentSandboxError when the sandbox or the forwarder did not start."""
        limits = dataclasses.replace(DEFAULT_GRADE_LIMITS, wall_time_s=wall_time_s,
                                     cpu_time_s=wall_time_s * (os.cpu_count() or 1), memory_mb=self.memory_mb,
                                     max_output_bytes=OUTPUT_BYTES)
        ro_mounts = {EPISODE_DIR: self.episode_dir}
        if self.runtime_dir is not None:
            ro_mounts[RUNTIME_DIR] = self.runtime_dir
        # not exec'd: under docker the wrapper is the container's pid 1, which the forwarder must recognise
        # and which no kill(-1) reaches; the command is a child that such a kill ends
        wrapper = (f"python3 {FORWARDER} {GATEWAY_SOCKET} {GATEWAY_PORT} || exit\n"
                   f"/bin/sh -c {shlex.quote(command)} </dev/null >>{LOG_FILE} 2>&1\n")
        run = run_wrapped(self.backend, wrapper, self.workspace, limits, ro_mounts, {HOME: self.home}, env,
                          self.image, self.workspace.workdir, kept_mounts={LOG_DIR: self.log_dir})
        if run.error:
            raise AgentSandboxError(f"the black-box agent's sandbox ({self.backend.name}) did not start: "
                                    f"{run.error}")
        if run.stdout.partition("\n")[0] != READY:
            python = (f"the image {self.image or DEFAULT_IMAGE} must have python3 on PATH"
                      if self.backend.name == "docker" else "the host's /usr/bin/python3")
            raise AgentSandboxError(
                f"the gateway forwarder did not start in the black-box agent's sandbox "
                f"({run.result.reason}): {run.result.stderr.strip()[:500] or 'nothing on stderr'} "
                f"(it runs with the sandbox's python3: {python})")
        return run.result

    def take_log(self) -> Path:
        """The command's log, once the sandbox is over (nothing can swap it then). Where the sandbox runs as
        our own uid (bubblewrap, not root) the command could have replaced it, e.g. with a symlink to a host
        file: anything but a regular file is not read, and a note takes its place."""
        log_file = self.log_dir / "command.log"
        try:
            if stat.S_ISREG(os.lstat(log_file).st_mode):
                return log_file
        except FileNotFoundError:
            pass
        note = self.workspace.base / "command.log"
        note.write_text("rollstream: the command removed or replaced its log file; nothing of it is kept\n")
        return note


def task_environment(metadata: dict[str, Any]) -> Path | None:
    """A Harbor row's environment/ directory, whose Dockerfile is the task's image under docker (the grader
    checks the task itself); None for other rows."""
    grader = metadata.get("grader") or {}
    if grader.get("kind") != "harbor" or not grader.get("task_dir"):
        return None
    return Path(grader["task_dir"]) / "environment"


def remove_orphaned_containers(settings: Settings) -> list[str]:
    """When black-box agents run under docker: remove the containers that processes of this host which are
    gone left (an agent-runner killed mid-episode); returns their ids. A warning, not an error, when no engine
    answers now: episodes then fail with the reason."""
    if (settings.agent.command_sandbox or settings.grader.backend) != "docker":
        return []
    try:
        removed = DockerBackend().remove_orphaned_containers()
    except (BackendUnavailable, DockerException) as exc:
        log.warning("could not look for containers a dead agent-runner left: %s", exc)
        return []
    if removed:
        log.warning("removed %d containers of processes that are gone: %s", len(removed), ", ".join(removed))
    return removed
