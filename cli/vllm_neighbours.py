"""The vLLM servers running on this machine and its load: what a vLLM server's failed start prints, so that
a log says what the server was starting beside (on a 2-core CI machine, three or four other servers).

    print(describe_machine(exclude_pid=server.pid))

A server is a process running vLLM's OpenAI API server (`python -m vllm.entrypoints.openai.api_server`,
`vllm serve`), whoever started it; its cores are what its environment binds (VLLM_CPU_OMP_THREADS_BIND:
`auto` when unset, vLLM's own choice; `?` when another user's environment cannot be read), its CPU time that
of all its processes (the API server, the engine core, the worker). Linux only (/proc).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rollstream.cli.cpu_cores import allowed_cores

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Process:
    pid: int
    parent: int
    cpu_s: float
    """User and system time so far."""
    started_s: float
    """Seconds after boot."""


@dataclass(frozen=True)
class Neighbour:
    """A vLLM server running on this machine."""

    pid: int
    age_s: float
    cores: str
    port: int
    cpu_s: float
    """CPU time of the server and every process under it."""

    def line(self) -> str:
        return (f"pid {self.pid}, up {self.age_s:.0f} s, cores {self.cores}, port {self.port}, "
                f"{self.cpu_s:.0f} CPU-s")


def _read_process(pid: int) -> Process | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:  # gone since the listing
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return Process(pid, int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS,
                   int(fields[19]) / CLOCK_TICKS)


def _command_line(pid: int) -> list[str]:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _is_vllm_server(argv: list[str]) -> bool:
    if "vllm.entrypoints.openai.api_server" in argv:
        return True
    return len(argv) > 1 and Path(argv[0]).name == "vllm" and argv[1] == "serve"


def _port(argv: list[str]) -> int:
    for index, arg in enumerate(argv):
        if arg == "--port" and index + 1 < len(argv):
            return int(argv[index + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    return 8000  # vLLM's default


def _bound_cores(pid: int) -> str:
    try:
        environ = (PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return "?"
    for entry in environ:
        name, _, value = entry.partition(b"=")
        if name == b"VLLM_CPU_OMP_THREADS_BIND":
            return value.decode(errors="replace")
    return "auto"


def _tree_cpu_s(root: int, processes: dict[int, Process]) -> float:
    children: dict[int, list[int]] = {}
    for process in processes.values():
        children.setdefault(process.parent, []).append(process.pid)
    total, pending = 0.0, [root]
    while pending:
        pid = pending.pop()
        total += processes[pid].cpu_s
        pending.extend(children.get(pid, ()))
    return total


def vllm_servers(exclude_pid: int | None = None) -> list[Neighbour]:
    """Every vLLM server running on this machine but `exclude_pid`, oldest first."""
    processes = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (process := _read_process(int(entry.name))) is not None:
            processes[process.pid] = process
    now_s = float((PROC / "uptime").read_text().split()[0])
    found = []
    for pid in processes:
        argv = _command_line(pid)
        if pid == exclude_pid or not _is_vllm_server(argv):
            continue
        found.append(Neighbour(pid, now_s - processes[pid].started_s, _bound_cores(pid), _port(argv),
                               _tree_cpu_s(pid, processes)))
    return sorted(found, key=lambda server: -server.age_s)


def describe_machine(exclude_pid: int | None = None) -> str:
    """The load average, the cores this process may use, and the other vLLM servers, one a line."""
    cores = allowed_cores()
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    servers = vllm_servers(exclude_pid)
    head = (f"this machine: load average {load} (1, 5, 15 min) on {len(cores)} cores {cores}; "
            f"other vLLM servers running: {len(servers)}" + (":" if servers else ""))
    return "\n".join([head, *(f"  {server.line()}" for server in servers)])
