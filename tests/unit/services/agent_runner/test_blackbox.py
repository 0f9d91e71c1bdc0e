"""Black-box episodes against a real local HTTP server that speaks the gateway's sessions API (and records
what it was sent): the agent is a small Python script run in its real sandbox (bubblewrap; the hostile suite
in test_blackbox_sandbox.py runs both backends), from a runtime directory mounted at /opt/agent: it reads its
environment, calls the session's OpenAI endpoint through the sandbox's forwarders, edits the task's file,
prints a report into its log and exits. The last test runs the agent-runner service itself against the
machine's Redis with no gateway at first.

    python -m pytest tests/unit/services/agent_runner/test_blackbox.py -q
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self

import pytest

from rollstream.services.agent_runner.agent_sandbox import AgentSandbox
from rollstream.services.agent_runner.blackbox import (
    BlackBoxRunner,
    GatewayRefused,
    GatewayUnavailable,
    role_environment,
)
from rollstream.services.agent_runner.main import EpisodeRunner
from rollstream.shared.agent.environments.coding import Workspace
from rollstream.shared.contract.bus import Bus, Delivery
from rollstream.shared.contract.events import PromptIssued, make_envelope
from rollstream.shared.errors import UnknownRole
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage
from rollstream.shared.tasks.prompts import TOOLS_NOTE
from tests.support import MODELS, free_port, health, stop_process_group, wait_for

CALC = "def add(a, b):\n    return a - b\n"
INSTRUCTION = "Fix `add` in calc.py so that it returns the sum of its arguments."
GRADER = {"kind": "harbor", "task_dir": "/data/tasks/fix-add"}
AGENT = """\
import json, os, sys, urllib.request
task_file, model = sys.argv[1:3]
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": model,
                     "messages": [{"role": "user", "content": os.environ["ROLLSTREAM_TASK"]}]}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request))
with open("calc.py") as handle:
    source = handle.read()
with open("calc.py", "w") as handle:
    handle.write(source.replace("a - b", "a + b"))
print("REPORT " + json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv[1:],
                              "task_file_text": open(task_file).read(), "answer": answer}))
print("agent: edited calc.py")
"""
AGENT_COMMAND = "python3 /opt/agent/agent.py {task_file} {model}"
"""The sandbox's python3 (the host's /usr/bin/python3 under bubblewrap, the image's under docker)."""


class FakeGateway:
    """The gateway's sessions API as its contract says (plus a chat-completions endpoint per session),
    served by a real HTTP server in a thread; records every call."""

    def __init__(self, port: int = 0, token: str | None = None, refuse_finish: bool = False) -> None:
        self.token = token
        self.refuse_finish = refuse_finish
        self.sessions: dict[str, dict] = {}
        self.opened: list[dict] = []
        self.finished: list[tuple[str, dict]] = []
        self.deleted: list[str] = []
        self.turns: list[tuple[str, str | None, dict]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self.handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handler(self):
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def reply(self, status: int, body: dict | None = None) -> None:
                data = json.dumps(body).encode() if body is not None else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def body(self) -> dict:
                return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")

            def admitted(self) -> bool:
                if gateway.token and self.headers.get("Authorization") != f"Bearer {gateway.token}":
                    self.reply(401, {"error": {"message": "bearer token required"}})
                    return False
                return True

            def do_POST(self) -> None:
                parts = self.path.strip("/").split("/")
                if parts == ["v1", "sessions"] and self.admitted():
                    request = self.body()
                    gateway.opened.append(request)
                    session_id = f"s{len(gateway.opened)}"
                    base = f"{gateway.url}/s/{session_id}"
                    gateway.sessions[session_id] = {"status": "open", "turns": 0,
                                                    "api_key": f"key-{session_id}"}
                    self.reply(201, {"session_id": session_id, "api_key": f"key-{session_id}",
                                     "openai_base_url": f"{base}/v1", "anthropic_base_url": base,
                                     "status": "open"})
                elif parts[:2] == ["v1", "sessions"] and parts[3:] == ["finish"] and self.admitted():
                    session = gateway.sessions.get(parts[2])
                    if session is None:
                        self.reply(404, {"error": {"message": f"no session {parts[2]!r}"}})
                    elif session["status"] != "open":
                        self.reply(409, {"error": {"message": f"session {parts[2]} is finished already"}})
                    elif gateway.refuse_finish:
                        self.reply(422, {"error": {"message": f"session {parts[2]} has no model turn"}})
                    else:
                        session["status"] = "finished"
                        gateway.finished.append((parts[2], self.body()))
                        self.reply(200, {"session_id": parts[2], "samples": 1, "status": "finished"})
                elif (parts[0] == "s" and parts[2:] == ["v1", "chat", "completions"]
                      and parts[1] in gateway.sessions):
                    gateway.turns.append((parts[1], self.headers.get("Authorization"), self.body()))
                    gateway.sessions[parts[1]]["turns"] += 1
                    self.reply(200, {"id": "c1", "object": "chat.completion", "choices": [
                        {"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "use a + b"}}]})
                else:
                    self.reply(404, {"error": {"message": f"no route {self.path}"}})

            def do_DELETE(self) -> None:
                parts = self.path.strip("/").split("/")
                if parts[:2] == ["v1", "sessions"] and len(parts) == 3 and self.admitted():
                    if gateway.sessions.pop(parts[2], None) is None:
                        self.reply(404, {"error": {"message": f"no session {parts[2]!r}"}})
                    else:
                        gateway.deleted.append(parts[2])
                        self.reply(204)
                else:
                    self.reply(404, {"error": {"message": f"no route {self.path}"}})

            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                if parts[:2] == ["v1", "sessions"] and len(parts) == 3 and parts[2] in gateway.sessions:
                    session = gateway.sessions[parts[2]]
                    self.reply(200, {"session_id": parts[2], "status": session["status"],
                                     "turns": session["turns"]})
                else:
                    self.reply(404, {"error": {"message": f"no route {self.path}"}})

        return Handler


@pytest.fixture(scope="module")
def runtime():
    """The agent's runtime directory (agent.command_runtime_dir): agent.py. Made with tempfile, which the
    sandbox's host uid can reach when the tests run as root (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="rs-test-agent-"))
    path.chmod(0o755)
    (path / "agent.py").write_text(AGENT)
    (path / "agent.py").chmod(0o644)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def settings_for(tmp_path: Path, gateway_url: str, security: dict | None = None, **agent) -> Settings:
    return Settings(run_id="bb", storage_uri=str(tmp_path / "runs"), gateway={"url": gateway_url},
                    model={"served_name": "tiny-served"}, rollout={"temperature": 0.7, "max_tokens": 48},
                    agent={"command_sandbox": "bubblewrap", **agent}, security=security or {})


def task_prompt(command: str | None = None, **metadata) -> PromptIssued:
    metadata = {"files": {"calc.py": CALC}, "grader": GRADER, **metadata}
    if command is not None:
        metadata["command"] = command
    return PromptIssued(sample_index=3, group_size=4, policy_version=0, label=None, reward_fn="exact_match",
                        sandbox_check=None, agent="command", metadata=metadata,
                        messages=[{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": f"{INSTRUCTION}\n\n{TOOLS_NOTE}"}])


IDS = {"trajectory_id": "r7", "rollout_id": "r7", "group_id": "g2", "session_id": "r7"}


def test_a_prompts_role_opens_its_session_for_that_role_and_the_agent_is_told_the_runs_roles(tmp_path):
    settings = Settings(roles={"names": {"planner": {}, "solver": {}}}, train={"lora_rank": 8})
    runner = BlackBoxRunner(settings)
    prompt = task_prompt("agent").model_copy(update={"role": "solver"})
    assert runner.session_request(prompt, IDS, 60)["role"] == "solver"
    assert runner.session_request(task_prompt("agent"), IDS, 60)["role"] == "planner"  # roles.default
    assert role_environment(runner.roles, "solver") == {"ROLLSTREAM_ROLE": "solver",
                                                        "ROLLSTREAM_ROLES": "planner,solver"}
    with pytest.raises(UnknownRole, match="role 'coder' is not one of this run's roles"):
        runner.session_request(prompt.model_copy(update={"role": "coder"}), IDS, 60)


def our_workspaces() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob(f"rs-ws-{os.getpid()}-*"))


def stored(settings: Settings, uri: str) -> str:
    return Storage(settings.storage_uri).read_bytes(uri).decode()


def report_in(log: str) -> dict:
    """What the agent reported about itself, from its log."""
    (line,) = [line for line in log.splitlines() if line.startswith("REPORT ")]
    return json.loads(line.removeprefix("REPORT "))


def test_the_agent_runs_in_the_workspace_through_its_session_and_the_session_finishes_with_its_diff(
        tmp_path, monkeypatch, runtime):
    monkeypatch.setenv("ROLLSTREAM_TEST_SECRET", "not for agents")
    before = our_workspaces()
    with FakeGateway(token="t" * 16) as gateway:
        settings = settings_for(tmp_path, gateway.url, security={"http_token": "t" * 16},
                                command_runtime_dir=runtime)
        prompt = task_prompt(AGENT_COMMAND, time_budget_s=45)
        delivery = Delivery("prompts", "1-0", make_envelope(prompt, run_id="bb", **IDS))
        asyncio.run(EpisodeRunner(settings, bus=None, fleet=None, tokenizer=None).run(delivery))

    (opened,) = gateway.opened
    keys = ("rollout_id", "group_id", "trajectory_id", "sample_index", "group_size", "label", "reward_fn",
            "sandbox_check", "grader", "time_budget_s", "role")
    assert {key: opened[key] for key in keys} == {
        "rollout_id": "r7", "group_id": "g2", "trajectory_id": "r7", "sample_index": 3, "group_size": 4,
        "label": None, "reward_fn": "exact_match", "sandbox_check": None, "grader": GRADER,
        "time_budget_s": 45.0, "role": "policy"}
    assert opened["sampling"] == {"temperature": 0.7, "max_tokens": 48}
    assert opened["metadata"]["grader"] == GRADER

    ((session_id, finish),) = gateway.finished
    report = report_in(stored(settings, finish["artifacts"]["log"]))
    env = report["env"]
    base = "http://127.0.0.1:18300/s/s1"  # the sandbox's forwarder, on the sandbox's own loopback
    assert env["OPENAI_BASE_URL"] == env["OPENAI_API_BASE"] == f"{base}/v1"
    assert env["ANTHROPIC_BASE_URL"] == base
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == "key-s1"
    assert env["ROLLSTREAM_SESSION_ID"] == "s1" and env["ROLLSTREAM_MODEL"] == "tiny-served"
    assert env["ROLLSTREAM_TASK"] == INSTRUCTION == report["task_file_text"]
    assert report["argv"] == [env["ROLLSTREAM_TASK_FILE"], "tiny-served"]
    assert env["ROLLSTREAM_TASK_FILE"] == "/rollstream/episode/task.md"
    assert env["ROLLSTREAM_ROLE"] == env["ROLLSTREAM_ROLES"] == "policy"
    assert env["PATH"].startswith("/opt/agent/bin:/opt/agent/node_modules/.bin:")
    assert "ROLLSTREAM_TEST_SECRET" not in env and not any(name.startswith("RS_") for name in env)
    assert report["cwd"] == "/workspace" and env["HOME"] == "/home/agent"
    assert our_workspaces() == before  # released

    sent = {"model": "tiny-served", "messages": [{"role": "user", "content": INSTRUCTION}]}
    assert gateway.turns == [("s1", "Bearer key-s1", sent)]
    assert session_id == "s1" and finish["status"] == "completed" and finish["error"] is None
    assert finish["artifacts"]["diff"].endswith("/bb/artifacts/r7.diff")
    diff = stored(settings, finish["artifacts"]["diff"])
    assert "--- a/calc.py" in diff and "-    return a - b" in diff and "+    return a + b" in diff
    assert "agent: edited calc.py" in stored(settings, finish["artifacts"]["log"])
    assert gateway.deleted == []


def processes_with(marker: str) -> list[int]:
    """Live host processes whose command line holds `marker` (a sandbox's processes are host processes
    too)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmdline = Path(entry.path, "cmdline").read_bytes()
                state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if marker.encode() in cmdline and state != "Z" and int(entry.name) != os.getpid():
                found.append(int(entry.name))
    return found


def sleeper(marker: str) -> str:
    """A command that sleeps for five minutes with `marker` in its command line."""
    return f'python3 -c "import time; time.sleep(300)" {marker}'


def test_the_time_budget_kills_the_whole_sandbox_and_truncates_the_episode(tmp_path):
    marker = f"rs-sleeper-{uuid.uuid4().hex}"
    command = f"{sleeper(marker)} & echo started; {sleeper(marker)}"
    with FakeGateway() as gateway:
        settings = settings_for(tmp_path, gateway.url, command=command, command_time_budget_s=1.5)
        started = time.monotonic()
        asyncio.run(BlackBoxRunner(settings).run(task_prompt(), IDS))
        took = time.monotonic() - started

    assert gateway.opened[0]["time_budget_s"] == 1.5
    ((_, finish),) = gateway.finished
    assert finish["status"] == "truncated" and "time budget of 1.5 s ran out" in finish["error"]
    assert took < 15
    assert processes_with(marker) == [], "the command's background child outlived the episode"
    assert "started" in stored(settings, finish["artifacts"]["log"])


def test_a_failing_command_fails_the_episode_with_the_end_of_its_log(tmp_path):
    command = "for i in $(seq 1 3000); do echo line $i; done; echo broken >&2; echo 'x = 1' > new.py; exit 3"
    with FakeGateway() as gateway:
        settings = settings_for(tmp_path, gateway.url, command=command)
        asyncio.run(BlackBoxRunner(settings).run(task_prompt(), IDS))

    ((_, finish),) = gateway.finished
    assert finish["status"] == "failed"
    assert finish["error"].startswith("the command exited with status 3")
    assert finish["error"].rstrip().endswith("line 3000\nbroken") and "line 1\n" not in finish["error"]
    assert "+x = 1" in stored(settings, finish["artifacts"]["diff"])  # its changes are kept all the same


def test_a_finish_the_gateway_refuses_deletes_the_session_and_raises(tmp_path):
    before = our_workspaces()
    with FakeGateway(refuse_finish=True) as gateway:
        settings = settings_for(tmp_path, gateway.url, command="exit 0")
        with pytest.raises(GatewayRefused, match="no model turn.*the episode was completed"):
            asyncio.run(BlackBoxRunner(settings).run(task_prompt(), IDS))
    assert gateway.finished == [] and gateway.deleted == ["s1"]
    assert our_workspaces() == before


def test_an_unreachable_gateway_raises_before_anything_runs(tmp_path):
    marker = tmp_path / "ran"
    before = our_workspaces()
    settings = settings_for(tmp_path, f"http://127.0.0.1:{free_port()}", command=f"touch {marker}")
    with pytest.raises(GatewayUnavailable, match="did not answer POST /v1/sessions"):
        asyncio.run(BlackBoxRunner(settings).run(task_prompt(), IDS))
    assert not marker.exists() and our_workspaces() == before


def test_a_prompt_without_a_command_line_opens_no_session(tmp_path):
    with FakeGateway() as gateway:
        settings = settings_for(tmp_path, gateway.url)
        with pytest.raises(ValueError, match="needs a command line"):
            asyncio.run(BlackBoxRunner(settings).run(task_prompt(), IDS))
    assert gateway.opened == []


# ------------------------------------------------------------------------------- the service itself
@pytest.mark.skipif(not (MODELS / "tiny-llama-warm" / "tokenizer.json").exists(),
                    reason="the agent-runner loads the tiny model's tokenizer; make setup builds it")
def test_while_the_gateway_is_away_the_prompt_stays_pending_and_runs_once_it_answers(tmp_path,
                                                                                     machine_redis_url,
                                                                                     runtime):
    run_id = f"bb-{uuid.uuid4().hex[:8]}"
    gateway_port, health_port = free_port(), free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RS_")},
           "RS_REDIS_URL": machine_redis_url, "RS_RUN_ID": run_id, "RS_HEALTH_PORT": str(health_port),
           "RS_STORAGE_URI": str(tmp_path / "runs"), "RS_MODEL__PATH": str(MODELS / "tiny-llama-warm"),
           "RS_FLEET__URLS": '["http://127.0.0.1:9"]', "RS_GATEWAY__URL": f"http://127.0.0.1:{gateway_port}",
           "RS_AGENT__COMMAND": AGENT_COMMAND, "RS_AGENT__COMMAND_SANDBOX": "bubblewrap",
           "RS_AGENT__COMMAND_RUNTIME_DIR": str(runtime), "RS_BUS__RECLAIM_IDLE_MS": "1000"}
    bus = Bus.connect(machine_redis_url, run_id)
    with open(tmp_path / "agent-runner.log", "wb") as log:
        process = subprocess.Popen([str(Path(sys.executable).parent / "rollstream-agent-runner")], env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        bus.publish("prompts", task_prompt(), **IDS)
        _, body = wait_for(lambda: (reply := health(health_port)) and reply[0] == 503 and reply, 90,
                                "the agent-runner to say it waits for the gateway")
        assert "the gateway does not answer" in body["reason"]
        time.sleep(3)  # several reclaim periods: the waiting replica keeps its claim and spends no delivery
        assert bus.group_lag("prompts", "agent-runner") == (0, 1)
        assert bus.read_all("dead") == []

        with FakeGateway(port=gateway_port) as gateway:
            wait_for(lambda: bus.group_lag("prompts", "agent-runner") == (0, 0), 60,
                     "the prompt to be acknowledged")
            assert [finish["status"] for _, finish in gateway.finished] == ["completed"]
            assert gateway.opened[0]["rollout_id"] == "r7"
            assert [session for session, _, _ in gateway.turns] == ["s1"]
            assert wait_for(lambda: health(health_port), 10, "/healthz")[0] == 200
        assert bus.read_all("dead") == []
    finally:
        stop_process_group(process)
        bus.delete_run()


@pytest.mark.parametrize("replace", ["symlink", "fifo", "directory", "remove"])
def test_a_log_the_command_replaced_is_not_read(tmp_path, replace):
    """Where the sandbox runs as the agent-runner's own uid (bubblewrap, not root), the command could swap its
    log for a link to a host file, which would then be stored as the episode's log."""
    secret = tmp_path / "secret"
    secret.write_text("TOP-SECRET\n")
    workspace = Workspace.for_task({"files": {"calc.py": CALC}})
    try:
        sandbox = AgentSandbox(workspace, backend=None, image=None, runtime_dir=None, memory_mb=1024)
        log = sandbox.log_dir / "command.log"
        log.unlink()
        if replace == "symlink":
            log.symlink_to(secret)
        elif replace == "fifo":
            os.mkfifo(log)
        elif replace == "directory":
            log.mkdir()
        kept = sandbox.take_log()
        assert kept.parent == workspace.base and "replaced its log file" in kept.read_text()
        assert not kept.is_symlink()
    finally:
        workspace.cleanup()
