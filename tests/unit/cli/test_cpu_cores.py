"""Core leases and start slots for vLLM CPU servers (cli/cpu_cores.py): leases spread over the cores and
then share them evenly, hold across processes taking them at once, end with their holder (a SIGKILLed one
too), stay within the process's allowed cores; a start slot makes the next start wait; a server binds to the
core it leased unless its environment binds it already."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections import Counter

import pytest

from rollstream.cli import cpu_cores, vllm_server
from rollstream.cli.cpu_cores import LEASE_DIR_VARIABLE, lease_cores, leases_per_core, wait_for_start_slot
from rollstream.cli.vllm_server import VllmServer
from tests.support import REPO, held_core_leases, skip_does_not_apply

HOLDER = """
import os, sys
from pathlib import Path
from rollstream.cli import cpu_cores
directory, what, affinity, cores = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
if affinity:
    os.sched_setaffinity(0, {int(affinity)})
if what == "slot":
    print(f"slot {cpu_cores.wait_for_start_slot(1, directory).index}", flush=True)
else:
    lease = cpu_cores.lease_cores(cores=[int(core) for core in cores] or None, directory=directory)
    print(lease.bind, flush=True)
sys.stdin.read()  # holds until its stdin closes, or it is killed
"""
"""A process that takes a lease (on the given cores, else on those it may use after narrowing its affinity to
`affinity` when given) or start slot 0 of 1, prints what it holds, and holds it."""


def start_holder(directory, what: str, *cores: int, affinity: int | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), what,
                             "" if affinity is None else str(affinity), *map(str, cores)],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def holder(directory, what: str, *cores: int, affinity: int | None = None) -> tuple[subprocess.Popen, str]:
    """A holder that holds it now, and what it holds."""
    process = start_holder(directory, what, *cores, affinity=affinity)
    return process, process.stdout.readline().strip()


def end(process: subprocess.Popen, sig: int | None = None) -> None:
    if sig is not None:
        process.send_signal(sig)
    process.stdin.close()
    process.wait(timeout=30)


def test_leases_take_cores_of_their_own_while_there_are_enough_then_share_them_evenly(tmp_path):
    leases = [lease_cores(cores=[0, 1, 2], directory=tmp_path) for _ in range(7)]
    assert [lease.cores for lease in leases] == [(0,), (1,), (2,), (0,), (1,), (2,), (0,)]
    assert leases_per_core([0, 1, 2], tmp_path) == {0: 3, 1: 2, 2: 2}
    leases[1].close()
    leases[4].close()
    assert lease_cores(cores=[0, 1, 2], directory=tmp_path).cores == (1,)  # the least-leased again


def test_a_lease_of_several_cores_takes_the_least_leased(tmp_path):
    first = lease_cores(cores=[0, 1, 2, 3], directory=tmp_path)
    pair = lease_cores(2, cores=[0, 1, 2, 3], directory=tmp_path)
    assert (first.cores, pair.cores, pair.bind) == ((0,), (1, 2), "1,2")
    assert pair.environment() == {"VLLM_CPU_OMP_THREADS_BIND": "1,2", "OMP_NUM_THREADS": "2"}
    with pytest.raises(ValueError, match="cannot lease 5 cores of the 4"):
        lease_cores(5, cores=[0, 1, 2, 3], directory=tmp_path)


def test_processes_leasing_at_once_spread_evenly_and_a_killed_holders_lease_ends(tmp_path):
    processes = [start_holder(tmp_path, "lease", 0, 1, 2) for _ in range(6)]  # all at once
    taken = [process.stdout.readline().strip() for process in processes]
    assert Counter(taken) == {"0": 2, "1": 2, "2": 2}
    assert leases_per_core([0, 1, 2], tmp_path) == {0: 2, 1: 2, 2: 2}
    killed = processes[taken.index("1")]
    end(killed, signal.SIGKILL)  # no clean-up of its own: the kernel drops its locks
    assert leases_per_core([0, 1, 2], tmp_path) == {0: 2, 1: 1, 2: 2}
    own = lease_cores(cores=[0, 1, 2], directory=tmp_path)
    assert own.cores == (1,)
    for process in processes:
        if process is not killed:
            end(process)
    assert leases_per_core([0, 1, 2], tmp_path) == {0: 0, 1: 1, 2: 0}  # this test's own lease is left
    own.close()


def test_a_lease_stays_within_the_cores_the_process_may_use(tmp_path):
    cores = cpu_cores.allowed_cores()
    if len(cores) < 2:
        skip_does_not_apply("one core: every lease is on it")
    busy = lease_cores(cores=[cores[-1]], directory=tmp_path)  # every other core is less leased ...
    process, taken = holder(tmp_path, "lease", affinity=cores[-1])
    try:
        assert taken == str(cores[-1])  # ... but the holder may use this one only
    finally:
        end(process)
        busy.close()


EXECS = """
import os, sys
from rollstream.cli import cpu_cores
lease = cpu_cores.lease_cores()
if sys.argv[1] == "keep":
    lease.keep_across_exec()
os.execv(sys.executable, [sys.executable, "-c", "import sys; print('exec', flush=True); sys.stdin.read()"])
"""
"""A process that leases a core, then becomes another program (as `rollstream serve-policy` becomes vLLM)."""


@pytest.mark.parametrize("keep", [True, False])
def test_a_lease_kept_across_exec_is_held_by_the_program_the_process_becomes(tmp_path, monkeypatch, keep):
    monkeypatch.setenv(LEASE_DIR_VARIABLE, str(tmp_path))
    process = subprocess.Popen([sys.executable, "-c", EXECS, "keep" if keep else "drop"], cwd=REPO,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "exec\n"
        core = cpu_cores.allowed_cores()[0]
        assert held_core_leases(process.pid) == ([core] if keep else [])
        assert leases_per_core([core], tmp_path) == {core: 1 if keep else 0}
    finally:
        end(process)
    assert leases_per_core([core], tmp_path) == {core: 0}


def test_a_start_waits_for_a_slot_and_a_killed_holders_slot_frees(tmp_path):
    first = wait_for_start_slot(2, tmp_path, poll_s=0.01)
    second = wait_for_start_slot(2, tmp_path, poll_s=0.01)
    assert (first.index, second.index) == (0, 1)
    third = []
    waiter = threading.Thread(target=lambda: third.append(wait_for_start_slot(2, tmp_path, poll_s=0.01)))
    waiter.start()
    waiter.join(0.3)
    assert not third  # both slots are held: it cannot have one
    second.release()
    waiter.join(10)
    assert [slot.index for slot in third] == [1]
    for slot in (first, *third):
        slot.release()
    process, taken = holder(tmp_path, "slot")
    assert taken == "slot 0"
    end(process, signal.SIGKILL)
    assert wait_for_start_slot(1, tmp_path, poll_s=0.01).index == 0


@pytest.fixture
def lease_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(LEASE_DIR_VARIABLE, str(tmp_path))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(vllm_server, "cpu_build", lambda: True)
    return tmp_path


def test_servers_bind_to_the_cores_they_lease(lease_dir):
    servers = [VllmServer("models/tiny-llama", 8000 + index) for index in range(2)]
    envs = [server.environment() for server in servers]
    cores = cpu_cores.allowed_cores()
    expected = [cores[0], cores[1 % len(cores)]]  # cores of their own where there are two
    assert [env["VLLM_CPU_OMP_THREADS_BIND"] for env in envs] == [str(core) for core in expected]
    assert [env["OMP_NUM_THREADS"] for env in envs] == ["1", "1"]
    assert [server.cores for server in servers] == [(core,) for core in expected]
    assert servers[0].environment() == envs[0]  # asked again before its start: the same lease


def test_a_server_leases_the_cores_the_setting_asks_and_no_more_than_it_may_use(lease_dir, monkeypatch):
    cores = cpu_cores.allowed_cores()
    monkeypatch.setenv(cpu_cores.CORES_PER_SERVER_VARIABLE, "2")
    env = VllmServer("models/tiny-llama", 8000).environment()
    leased = cores[:2]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(str(core) for core in leased)
    assert env["OMP_NUM_THREADS"] == str(len(leased))
    monkeypatch.setenv(cpu_cores.CORES_PER_SERVER_VARIABLE, str(len(cores) + 5))
    assert cpu_cores.cores_per_server() == len(cores)
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(cpu_cores.CORES_PER_SERVER_VARIABLE, bad)
        with pytest.raises(ValueError, match="ROLLSTREAM_VLLM_CORES_PER_SERVER"):
            VllmServer("models/tiny-llama", 8000).environment()


def test_a_binding_the_environment_sets_wins_and_leases_nothing(lease_dir, monkeypatch):
    server = VllmServer("models/tiny-llama", 8000, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert server.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert server.cores is None
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    assert VllmServer("models/tiny-llama", 8000).environment()["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert set(leases_per_core(directory=lease_dir).values()) == {0}


def test_other_builds_bind_nothing(lease_dir, monkeypatch):
    monkeypatch.setattr(vllm_server, "cpu_build", lambda: False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in VllmServer("models/tiny-llama", 8000).environment()
