"""The hostile suite as a black-box agent, in both real sandboxes (bubblewrap, and docker on a real engine):
the agent's command tries to read the host's files and the agent-runner's environment, to write outside its
workspace, to reach the network (the host's Redis, the gateway itself, an outside address), to leave processes
behind, to overrun its budget, and to use the forwarder for another session or the sessions API. Each fails,
the host is unchanged and nothing keeps running afterwards; and its own session is reached. A stub gateway
(test_blackbox.FakeGateway, a real HTTP server) stands behind the agent-runner's forwarder.

    python -m pytest tests/unit/services/agent_runner/test_blackbox_sandbox.py -q

Network tests only ever use this machine's loopback, and one outside address that must not be reached.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from rollstream.services.agent_runner.agent_sandbox import AgentSandboxError, remove_orphaned_containers
from rollstream.services.agent_runner.blackbox import BlackBoxRunner
from rollstream.shared.runtime.config import Settings
from rollstream.shared.sandbox.docker import OWNER_LABEL, process_owner
from rollstream.shared.sandbox.workspace import remove_orphaned_workspaces
from rollstream.shared.tasks.harbor import load_harbor_task
from rollstream.shared.tasks.prompts import task_prompt_row
from tests.support import FIXTURES, REPO, host_listener, sandbox_uid_processes, skip_does_not_apply, wait_for
from tests.unit.services.agent_runner.test_blackbox import (
    IDS,
    FakeGateway,
    our_workspaces,
    processes_with,
    sleeper,
    stored,
    task_prompt,
)

MARKER = f"rs-hostile-{uuid.uuid4().hex}"
"""In the command line of every process a test's agent starts: none may be alive after the test."""


@pytest.fixture
def runtime():
    """A runtime directory (agent.command_runtime_dir) holding the agent's scripts, reachable by the sandbox's
    host uid (made with tempfile: pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="rs-test-agent-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def host_unaffected(sandbox, request):
    """After each test: nothing the agent started runs, no sandbox uid has a process, no container of ours is
    left, no workspace of ours is left."""
    client = request.getfixturevalue("docker_engine") if sandbox == "docker" else None
    before = our_workspaces()
    yield
    wait_for(lambda: not processes_with(MARKER), 10, "the agent's processes to end")
    assert sandbox_uid_processes() == []
    if client is not None:
        assert client.containers.list(all=True, filters={"label": f"{OWNER_LABEL}={process_owner()}"}) == []
    assert our_workspaces() == before


def settings_for(tmp_path: Path, gateway: FakeGateway, sandbox: str, runtime: Path | None = None,
                 **agent) -> Settings:
    return Settings(run_id="hostile", storage_uri=str(tmp_path / "runs"), gateway={"url": gateway.url},
                    model={"served_name": "tiny"},
                    agent={"command_sandbox": sandbox, "command_runtime_dir": runtime, **agent})


def episode(tmp_path: Path, sandbox: str, command: str, runtime: Path | None = None, budget_s: float = 30,
            gateway: FakeGateway | None = None, **metadata) -> tuple[dict, str, str]:
    """Run `command` as a black-box episode; its finish request, its log and its diff."""
    with (gateway or FakeGateway()) as fake:
        settings = settings_for(tmp_path, fake, sandbox, runtime)
        asyncio.run(BlackBoxRunner(settings).run(task_prompt(command, time_budget_s=budget_s,
                                                             **metadata), IDS))
        (opened,) = fake.opened
    ((_, finish),) = fake.finished
    return finish, stored(settings, finish["artifacts"]["log"]), stored(settings, finish["artifacts"]["diff"])


def python(runtime: Path, name: str, code: str) -> str:
    """A Python script in the runtime directory, and the command that runs it with the sandbox's python3."""
    (runtime / name).write_text(code)
    (runtime / name).chmod(0o644)
    return f"python3 /opt/agent/{name} {MARKER}"


# ------------------------------------------------------------------------------------------ the host's files
def test_the_hosts_files_and_the_agent_runners_environment_are_out_of_reach(tmp_path, sandbox, monkeypatch):
    secret_env = f"env-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("ROLLSTREAM_TEST_SECRET", secret_env)  # the agent-runner's environment (this process)
    base = Path(tempfile.mkdtemp(prefix="rs-hostile-"))
    base.chmod(0o711)  # reachable: only the sandbox keeps it out
    planted = [base / "secret.txt", Path("/root") / f"{MARKER}.txt"]
    try:
        for path in planted:
            path.write_text("TOP-SECRET\n")
            path.chmod(0o644)
        reads = " ".join(str(p) for p in [*planted, REPO / "README.md", "/etc/shadow",
                                          f"/proc/{os.getpid()}/environ"])
        command = (f"for f in {reads}; do cat $f && echo READ:$f; done; ls /root /work {base} 2>&1; "
                   "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; env")
        finish, log, _ = episode(tmp_path, sandbox, command)
    finally:
        for path in planted:
            path.unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)
    assert finish["status"] == "completed", finish["error"]
    assert "READ:" not in log and "TOP-SECRET" not in log and "Fully asynchronous" not in log  # README.md's
    assert secret_env not in log and not [line for line in log.splitlines() if line.startswith("RS_")]
    assert "No such file or directory" in log


# --------------------------------------------------------------------------- writing outside the workspace
def test_writes_outside_the_workspace_leave_the_host_unchanged(tmp_path, sandbox, runtime):
    (runtime / "tool").write_text("the agent's own\n")
    targets = [f"/tmp/{MARKER}", f"/root/{MARKER}", f"{REPO}/{MARKER}", f"/{MARKER}", f"/usr/{MARKER}",
               f"/opt/agent/{MARKER}", f"/rollstream/episode/{MARKER}", f"/rollstream/log/{MARKER}"]
    writes = "; ".join(f"echo x > {target}" for target in targets)
    command = (f"{writes}; echo x > ../{MARKER}; echo x > /opt/agent/tool; "
               f"echo x > /rollstream/episode/task.md; echo kept > $HOME/.agent-config; "
               f"echo answer > answer.txt; ls -a $HOME")
    finish, log, diff = episode(tmp_path, sandbox, command, runtime)
    assert finish["status"] == "completed", finish["error"]
    for target in targets:  # the host's paths of the same names (the sandbox's /tmp is its own tmpfs)
        assert not Path(target).exists(), target
    assert (runtime / "tool").read_text() == "the agent's own\n" and sorted(os.listdir(runtime)) == ["tool"]
    assert "Read-only file system" in log or "Permission denied" in log
    assert ".agent-config" in log  # HOME is the agent's to write ...
    assert "+answer" in diff and ".agent-config" not in diff and MARKER not in diff  # ... and in no diff


# ----------------------------------------------------------------------------------------------- the network
def test_the_network_is_out_of_reach(tmp_path, sandbox, runtime):
    gateway = FakeGateway()
    with host_listener() as (port, accepted):
        targets = [("127.0.0.1", port), ("127.0.0.1", 6379),  # the host's Redis
                   # the gateway itself, not through the forwarder
                   ("127.0.0.1", gateway.server.server_address[1]),
                   ("1.1.1.1", 53), ("example.com", 80)]
        command = python(runtime, "net.py", f"""
import socket
for host, port in {targets!r}:
    try:
        socket.create_connection((host, port), timeout=3)
        print("CONNECTED", host, port)
    except OSError as exc:
        print("refused", host, port, type(exc).__name__, exc)
""")
        finish, log, _ = episode(tmp_path, sandbox, command, runtime, gateway=gateway)
    assert finish["status"] == "completed", finish["error"]
    outcomes = [line.split()[0] for line in log.splitlines()]
    assert outcomes == ["refused"] * len(targets), log
    assert accepted == []


# --------------------------------------------------------------------------- processes and the time budget
def test_processes_left_behind_die_with_the_episode(tmp_path, sandbox, runtime):
    sleep = sleeper(MARKER)
    command = "\n".join([
        f"setsid {sleep} &",
        f"nohup {sleep} >/dev/null 2>&1 &",
        f"sh -c '({sleep} &) &'",  # double fork: its parent is gone at once
        python(runtime, "daemon.py", "import os, sys, time\n"
                                     "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                                     "        time.sleep(300)\n"),
        "sleep 0.5", "echo started", "exit 0"])
    finish, log, _ = episode(tmp_path, sandbox, command, runtime)
    assert finish["status"] == "completed" and "started" in log, (finish, log)
    wait_for(lambda: not processes_with(MARKER), 10, "the processes the agent left to be killed")


def test_the_time_budget_is_enforced_and_the_episode_truncated(tmp_path, sandbox):
    started = time.monotonic()
    finish, log, _ = episode(tmp_path, sandbox, f"echo started; {sleeper(MARKER)} & while :; do :; done",
                             budget_s=2)
    took = time.monotonic() - started
    assert finish["status"] == "truncated" and "time budget of 2 s ran out" in finish["error"], finish
    assert "started" in log and took < 20
    wait_for(lambda: not processes_with(MARKER), 10, "the processes the agent left to be killed")


def test_a_killed_agent_runner_leaves_nothing_running(tmp_path, sandbox, request):
    """The agent-runner dies (SIGKILL) in the middle of an episode: bubblewrap dies with it, a container is
    ended by its forwarder's lifeline and removed by the next agent-runner's sweep."""
    runner = tmp_path / "runner.py"  # the command is in the script, not in the agent-runner's command line
    runner.write_text("import asyncio, sys\n"
                      "from rollstream.services.agent_runner.blackbox import BlackBoxRunner\n"
                      "from rollstream.shared.runtime.config import Settings\n"
                      "from tests.unit.services.agent_runner.test_blackbox import IDS, task_prompt\n"
                      "settings = Settings.model_validate_json(sys.argv[1])\n"
                      f"asyncio.run(BlackBoxRunner(settings).run(task_prompt({sleeper(MARKER)!r}), IDS))\n")
    with FakeGateway() as gateway:
        settings = settings_for(tmp_path, gateway, sandbox)
        process = subprocess.Popen([sys.executable, str(runner), settings.model_dump_json()],
                                   env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for(lambda: processes_with(MARKER), 60, "the agent to start")
        finally:
            process.kill()  # the agent-runner alone: its sandbox's processes are in sessions of their own
            process.wait()
        wait_for(lambda: not processes_with(MARKER), 10, "the agent to die with its agent-runner")
        assert gateway.finished == []
    if sandbox == "docker":  # its container is stopped, and still there until an agent-runner starts
        client = request.getfixturevalue("docker_engine")
        left = {container.id for container in client.containers.list(all=True, filters={"label": OWNER_LABEL})
                if container.labels[OWNER_LABEL].split("/")[2] == str(process.pid)}
        assert len(left) == 1
        assert left <= set(remove_orphaned_containers(settings))
        assert not left & {container.id for container in client.containers.list(all=True)}
    remove_orphaned_workspaces("ws")  # the dead agent-runner's workspace


# ------------------------------------------------------------------------------------------ its own session
def test_the_agent_reaches_its_own_session_and_nothing_else_of_the_gateway(tmp_path, sandbox, runtime):
    command = python(runtime, "probe.py", """
import http.client, json, os
key = os.environ["OPENAI_API_KEY"]
own = os.environ["OPENAI_BASE_URL"].split("127.0.0.1:18300", 1)[1]
def call(method, target, body=None):
    connection = http.client.HTTPConnection("127.0.0.1", 18300, timeout=10)
    connection.request(method, target, body=body, headers={"Authorization": "Bearer " + key,
                                                          "Content-Type": "application/json"})
    response = connection.getresponse()
    print("STATUS", response.status, method, target, response.read()[:200])
call("POST", own + "/chat/completions",
     json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
for target in ["/s/other/v1/chat/completions", "/v1/sessions", "/s/s1x/v1/chat/completions",
               "/s/s1/../other/v1/chat/completions", "/s/s1/%2e%2e/other/v1/chat/completions",
               "/s/s1//v1/chat/completions", "http://127.0.0.1/s/s1/v1/chat/completions"]:
    call("POST", target, "{}")
""")
    gateway = FakeGateway()
    gateway.sessions["other"] = {"status": "open", "turns": 0, "api_key": "key-other"}
    finish, log, _ = episode(tmp_path, sandbox, command, runtime, gateway=gateway)
    assert finish["status"] == "completed", finish["error"]
    statuses = [line.split()[1] for line in log.splitlines() if line.startswith("STATUS")]
    assert statuses == ["200"] + ["403"] * 7, log
    assert [session for session, _, _ in gateway.turns] == ["s1"]
    assert gateway.sessions["other"]["turns"] == 0 and len(gateway.opened) == 1


def test_the_workspace_is_at_a_harbor_tasks_workdir(tmp_path, sandbox):
    row = task_prompt_row(load_harbor_task(FIXTURES / "harbor" / "fix-add"))
    finish, log, diff = episode(tmp_path, sandbox, "pwd; ls; sed -i 's/a - b/a + b/' calc.py",
                                **{k: v for k, v in row.metadata.items() if k != "time_budget_s"})
    assert finish["status"] == "completed", finish["error"]
    assert log.startswith("/app\n") and "calc.py" in log
    assert "+    return a + b" in diff


def test_an_image_without_python3_is_a_clear_error_and_no_outcome(tmp_path, sandbox):
    if sandbox != "docker":
        skip_does_not_apply("bubblewrap's python3 is the host's")
    task = tmp_path / "no-python"
    shutil.copytree(FIXTURES / "harbor" / "fix-add", task)
    (task / "environment" / "Dockerfile").write_text("FROM local/debian-base:bookworm\nWORKDIR /app\n")
    row = task_prompt_row(load_harbor_task(task))
    with FakeGateway() as gateway:
        settings = settings_for(tmp_path, gateway, sandbox)
        with pytest.raises(AgentSandboxError, match="python3"):
            asyncio.run(BlackBoxRunner(settings).run(task_prompt("true", **row.metadata), IDS))
    assert gateway.finished == [] and gateway.deleted == ["s1"]
