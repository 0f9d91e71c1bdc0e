"""What a vLLM server's failed start says of the machine (cli/vllm_neighbours.py): the other vLLM servers
running (pid, age, bound cores, port, CPU time) and the load, read from /proc. The servers here are processes
whose command line is a vLLM server's, so that the listing and the message are checked in a second."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from rollstream.cli import vllm_server
from rollstream.cli.cpu_cores import LEASE_DIR_VARIABLE
from rollstream.cli.vllm_neighbours import describe_machine, vllm_servers
from rollstream.cli.vllm_server import VllmServer, VllmStartError, free_port

SILENT = "import time; time.sleep(120)"
"""A process that never answers anything."""


@contextmanager
def server_lookalike(port: int, bind: str | None) -> Iterator[subprocess.Popen]:
    """A process whose command line is a vLLM server's (on `port`, its cores bound to `bind` when given)."""
    env = {key: value for key, value in os.environ.items() if key != "VLLM_CPU_OMP_THREADS_BIND"}
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    process = subprocess.Popen([sys.executable, "-c", SILENT, "-m", "vllm.entrypoints.openai.api_server",
                                "--model", "tiny", "--port", str(port)], env=env)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def test_the_vllm_servers_of_the_machine_with_their_cores_and_ports():
    with server_lookalike(4321, "1") as bound, server_lookalike(4322, None) as unbound:
        found = {server.pid: server for server in vllm_servers()}
        assert (found[bound.pid].cores, found[bound.pid].port) == ("1", 4321)
        assert (found[unbound.pid].cores, found[unbound.pid].port) == ("auto", 4322)  # vLLM's own choice
        assert found[bound.pid].age_s >= 0 and found[bound.pid].cpu_s >= 0
        assert unbound.pid not in {server.pid for server in vllm_servers(exclude_pid=unbound.pid)}
        described = describe_machine(exclude_pid=unbound.pid)
    assert "load average" in described and f"on {len(os.sched_getaffinity(0))} cores" in described
    assert f"pid {bound.pid}, up " in described and "cores 1, port 4321" in described
    assert f"pid {unbound.pid}," not in described


def test_a_health_timeout_says_what_else_ran_on_the_machine(tmp_path, monkeypatch):
    monkeypatch.setenv(LEASE_DIR_VARIABLE, str(tmp_path / "leases"))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(vllm_server, "cpu_build", lambda: True)
    monkeypatch.setattr(VllmServer, "command", lambda self: [sys.executable, "-c", SILENT])
    server = VllmServer("models/tiny-llama", free_port(), log_path=tmp_path / "vllm.log")
    with server_lookalike(4323, "0") as neighbour:
        server.start()
        try:
            with pytest.raises(VllmStartError, match="not healthy after 1 s") as failed:
                server.wait_healthy(timeout_s=1)
        finally:
            server.stop()
    message = str(failed.value)
    assert f"its cores: {server.cores[0]}; this machine: load average" in message
    assert f"pid {neighbour.pid}, up " in message and "cores 0, port 4323" in message
