"""What tests share besides fixtures (those are in tests/conftest.py): where things are, and small
helpers. Tests import it as `tests.support` (tests/ is a package, so pytest puts the repository
root on sys.path)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from rollstream.cli import cpu_cores
from rollstream.cli.vllm_server import VllmServer, free_port
from rollstream.services.recorder.archive_writer import ArchiveWriter
from rollstream.shared.contract.bus import STREAMS, Bus
from rollstream.shared.contract.events import PromptIssued, TrajectorySegment, TrajectoryTurn
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.runtime.storage import Storage
from rollstream.shared.sandbox import host_uids
from rollstream.shared.sandbox.workspace import prepare_workspace

REPO = Path(__file__).resolve().parents[1]
"""The repository root."""
FIXTURES = REPO / "tests" / "fixtures" / "tasks"
"""Example Harbor tasks and SWE-bench rows."""
MODELS = REPO / "models"
"""Where `make setup` builds the tiny models (tiny-llama, tiny-llama-warm)."""
DOES_NOT_APPLY = "does not apply here: "
"""How a skip for a reason that is no missing infrastructure begins (tests/conftest.py: with
RS_TEST_REQUIRE_INFRA=1, as CI runs, every other skip fails)."""


def skip_does_not_apply(reason: str) -> None:
    """Skip a test that has nothing to check on this machine or in this parametrisation (not for missing
    infrastructure: a skip for that fails in CI)."""
    pytest.skip(DOES_NOT_APPLY + reason)


def prompt(i: int, group_size: int = 1) -> PromptIssued:
    """A small PromptIssued event: sample i of a group of `group_size`."""
    return PromptIssued(sample_index=i, group_size=group_size,
                        messages=[{"role": "user", "content": f"q{i}"}], policy_version=0)


def turn(i: int) -> TrajectoryTurn:
    """A small TrajectoryTurn event whose sampled ids depend on i."""
    return TrajectoryTurn(turn=i, offset=3, appended_ids=[1, 2, 3], response_ids=[7, 8 + i],
                          logprobs=[-0.5, -1.25], policy_version=0, policy_version_end=0,
                          finish_reason="stop", server_url="http://s")


def archive_all(bus: Bus, root: Path) -> ArchiveWriter:
    """Archive every stream of the bus's run under `root`, as the recorder would."""
    writer = ArchiveWriter(Storage(str(root)), bus.keys.run_id)
    for stream in STREAMS:
        writer.archive_new(bus, stream, 1000)
    return writer


def sandbox_uid_processes() -> list[int]:
    """Host processes, zombies included, running as a sandbox host uid of this test process's runs
    (there must be none after a sandbox run; only meaningful when the tests run as root)."""
    return host_uids.processes_of_uids(host_uids.this_process_uids())



def docker_client():
    """The docker SDK's client for the engine DOCKER_HOST names, or skip the test with the reason
    (CI starts one with infra/docker-engine.sh)."""
    import docker
    from docker.errors import DockerException

    try:
        client = docker.from_env()
        client.ping()
    except DockerException as exc:
        host = os.environ.get("DOCKER_HOST", "unset")
        pytest.skip(f"no Docker engine answers (DOCKER_HOST={host}): {exc}; "
                    "infra/docker-engine.sh starts one")
    return client

__all__ = ["DOES_NOT_APPLY", "FIXTURES", "MODELS", "REPO", "archive_all", "docker_client", "free_port",
           "prompt", "sandbox_uid_processes", "skip_does_not_apply", "turn"]


def health(port: int) -> tuple[int, dict] | None:
    """A service's /healthz on this machine: (status, body), or None while it does not answer."""
    try:
        reply = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
    except httpx.HTTPError:
        return None
    return reply.status_code, reply.json()


@contextmanager
def host_listener(greeting: bytes = b""):
    """A TCP listener on the host's loopback that accepts every connection (sends it `greeting`, closes it):
    what a sandboxed command must not reach. Yields its port and the list of the connections it accepted;
    closed at exit."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            accepted.append(connection)
            if greeting:
                connection.sendall(greeting)
            connection.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1], accepted
    finally:
        listener.close()


def wait_for(condition, timeout_s: float, what: str):
    """condition()'s first truthy value, polled every 0.2 s; AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


BWRAP_NO_USERNS = ("bwrap: No permissions to create new namespace, likely because the kernel does not allow "
                   "non-privileged user namespaces.")
"""What bwrap says where it may not create its namespaces (user namespaces off, Ubuntu 24.04's AppArmor
default, a container without the security options)."""
REAL_BWRAP = shutil.which("bwrap")
"""The host's bubblewrap, found before any test put a bwrap of its own first on PATH."""


def sandbox_bin_dir() -> Path:
    """A fresh directory to put first on PATH, which the sandbox's host uid may enter (bwrap runs as that uid
    when the tests run as root; pytest's tmp_path is 0700). The caller removes it."""
    path = Path(tempfile.mkdtemp(prefix="rs-test-bin-"))
    path.chmod(0o755)
    return path


def break_bwrap(bin_dir: Path) -> None:
    """Make bin_dir's `bwrap` one that cannot create its namespaces: BWRAP_NO_USERNS on stderr, exit 1,
    nothing run. Swapped in by rename, so that a process looking it up meanwhile finds the old one or this
    one."""
    shim = bin_dir / ".bwrap-broken"
    shim.write_text(f"#!/bin/sh\necho '{BWRAP_NO_USERNS}' >&2\nexit 1\n")
    shim.chmod(0o755)
    os.replace(shim, bin_dir / "bwrap")


def repair_bwrap(bin_dir: Path) -> None:
    """Make bin_dir's `bwrap` the host's real one again (a link; also by rename)."""
    link = bin_dir / ".bwrap-real"
    link.unlink(missing_ok=True)
    os.symlink(REAL_BWRAP or "/usr/bin/bwrap", link)
    os.replace(link, bin_dir / "bwrap")


def edit_diff(source: Path | None, edits: dict[str, str | None],
              symlinks: dict[str, str] | None = None) -> str:
    """The diff that `edits` (path -> new content, None deletes) and `symlinks` (path -> target) make to
    a copy of `source`: what a model's episode would hand the grader."""
    with prepare_workspace(source) as workspace:
        for path, content in edits.items():
            target = workspace.root / path
            if content is None:
                target.unlink()
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(content)
        for path, target in (symlinks or {}).items():
            os.symlink(target, workspace.root / path)
        return workspace.diff()


def stop_process_group(process: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM the process group a test started (start_new_session=True), SIGKILL it when it has not
    drained within timeout_s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextmanager
def supervised_run(tmp_path: Path, monkeypatch, commands: dict[str, list[str]], run_id: str):
    """A local run's supervisor over real processes that stand in for services (name -> command line)."""
    from rollstream.cli import local_run
    from rollstream.shared.runtime.config import Settings

    monkeypatch.setattr(local_run, "service_command", lambda service: commands[service])
    run = local_run.LocalRun(Settings(storage_uri=str(tmp_path), run_id=run_id), services=tuple(commands))
    run.log_dir.mkdir(parents=True)
    for name in commands:
        run.service_of[name] = name
        run.spawn(name)
    try:
        yield run
    finally:
        for process in run.processes.values():
            process.kill()
            process.wait()


def assert_turns_sampled_by_vllm(settings, segment: TrajectorySegment, turns: list[TrajectoryTurn], seed: int,
                                 logprob_tol: float = 2e-3) -> None:
    """Each turn's response ids are what vLLM samples for that prompt with `seed` (asked again, directly), and
    the segment's trainable tokens are exactly those responses, with the logprobs vLLM gives them when it
    scores the prompt and the response."""
    trainable = [t for t, m in zip(segment.tokens, segment.loss_mask) if m]
    assert trainable == [t for turn in turns for t in turn.response_ids]

    async def check() -> None:
        async with FleetClient(settings.fleet.urls, model=settings.model.served_name) as fleet:
            for turn in turns:
                prompt = segment.tokens[: turn.offset]
                again = await fleet.complete(prompt, max_tokens=len(turn.response_ids), temperature=1.0,
                                             session_id="check", seed=seed)
                assert again.token_ids == turn.response_ids
            if not turns:
                return
            # every turn's response sits in the segment at its offset: one scoring of the segment up to the
            # last response gives each of them the logprobs vLLM computes for it after its own prompt
            end = max(turn.offset + len(turn.response_ids) for turn in turns)
            scored = await fleet.prompt_logprobs(fleet.urls[0], segment.tokens[:end])
            for turn in turns:
                assert segment.tokens[turn.offset:turn.offset + len(turn.response_ids)] == turn.response_ids
                mine = scored[turn.offset - 1:turn.offset - 1 + len(turn.response_ids)]
                assert max(abs(a - b) for a, b in zip(mine, turn.logprobs)) < logprob_tol

    asyncio.run(check())


def run_until_version(local, version: int, timeout_s: float, extra_log: Callable[[], str] | None = None):
    """Start the local run, wait until the trainer publishes `version`, stop it; its progress. On a failure,
    every process's log tail (LocalRun's exit) and `extra_log()` are printed."""
    with local:
        try:
            return local.wait_for_version(version, timeout_s=timeout_s)
        except BaseException:
            if extra_log is not None:
                print(extra_log())
            raise


@contextmanager
def vllm_servers(model: Path, log_dir: Path, count: int = 2):
    """`count` vLLM servers of `model`, started together (logs in log_dir); a list, so that a server a test
    killed can be replaced in place (revive). Every server, replaced ones included, is stopped at the end."""
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    servers = [VllmServer(model, port=port, log_path=log_dir / f"vllm-{port}.log") for port in sorted(ports)]
    try:
        for server in servers:
            server.start()
        started = time.monotonic()
        for server in servers:
            server.wait_healthy(timeout_s=600)
        print(f"\n{count} vLLM servers healthy after {time.monotonic() - started:.1f} s, on cores "
              f"{[server.cores for server in servers]}")
        yield servers
    finally:
        for server in servers:
            server.stop()


def held_core_leases(pid: int) -> list[int]:
    """The cores whose lease files (cli/cpu_cores.py) process `pid` holds open, in order."""
    directory = cpu_cores.lease_dir()
    cores = []
    for fd in (Path("/proc") / str(pid) / "fd").iterdir():
        try:
            target = Path(os.readlink(fd))
        except OSError:  # closed since the listing
            continue
        if target.parent == directory and target.name.startswith("core-"):
            cores.append(int(target.name.split("-")[1].split(".")[0]))
    return sorted(cores)


def vllm_workers(server_pid: int) -> list[int]:
    """The pids of a vLLM server's workers (the processes that run the model, below its engine core)."""
    found, pending = [], [server_pid]
    while pending:
        pid = pending.pop()
        for task in (Path("/proc") / str(pid) / "task").iterdir():
            children = (task / "children").read_text().split()
            pending.extend(int(child) for child in children)
        if (Path("/proc") / str(pid) / "comm").read_text().startswith("VLLM::Worker"):
            found.append(pid)
    return sorted(found)


def redis_passwords() -> dict[str, str]:
    """A fresh password per Redis user, as infra/redis-passwords.sh writes them for compose's .env."""
    made = subprocess.run(["sh", str(REPO / "infra" / "redis-passwords.sh")], capture_output=True, text=True,
                          check=True).stdout
    return dict(line.split("=", 1) for line in made.split())


def reload_weights(urls: list[str], weights: Path) -> None:
    """Make the servers serve `weights` (a test that trains into the shared pair puts the tiny model back)."""

    async def reload() -> None:
        async with FleetClient(urls) as fleet:
            for url in urls:
                await fleet.reload_weights(url, str(weights))

    asyncio.run(reload())


def revive(servers: list[VllmServer]) -> list[VllmServer]:
    """The servers (tests/integration/conftest.py's vllm_pair), with any that exited started again on its
    port, in its place."""
    for index, server in enumerate(servers):
        if server.exit_code() is None:
            continue
        server.stop()
        log = server.log_path.with_name(f"{server.log_path.stem}.again.log") if server.log_path else None
        again = VllmServer(server.model_dir, port=server.port, log_path=log)
        servers[index] = again
        again.start()
        again.wait_healthy(timeout_s=600)
    return servers


@contextmanager
def local_redis_cluster(directory: Path, masters: int = 3):
    """A Redis Cluster of `masters` redis-server processes on loopback ports (no replicas), made with
    `redis-cli --cluster create`; yields the URL of its first node. Every process is stopped at the end."""

    def cli(port: int, *args: str) -> str:
        return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True).stdout

    free: set[int] = set()
    while len(free) < 2 * masters:  # a client and a cluster bus port per node (port + 10000 may pass 65535)
        free.add(free_port())
    ports, bus_ports = sorted(free)[:masters], sorted(free)[masters:]
    nodes = []
    try:
        for port, bus_port in zip(ports, bus_ports):
            nodes.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--cluster-port", str(bus_port), "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                 "--dir", str(directory), "--save", "", "--appendonly", "no"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in ports:
            wait_for(lambda port=port: cli(port, "ping").strip() == "PONG", 30, f"redis on {port}")
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        for port in ports:
            wait_for(lambda port=port: "cluster_state:ok" in cli(port, "cluster", "info"), 30,
                     f"cluster state on {port}")
        yield f"redis://127.0.0.1:{min(ports)}/0"
    finally:
        for node in nodes:
            node.terminate()
        for node in nodes:
            node.wait(timeout=30)
