"""Where the vLLM CPU servers of one machine run: each server leases cores (its own where there are enough,
else the least-shared ones), and only as many servers start at once as there are cores. Both hold across
processes (a run, a benchmark, two pytest workers): they are locks on files in one machine-wide directory,
which the kernel releases when their holder dies, so a killed server or test never leaves a lease behind.

Left to itself, every vLLM CPU server binds its OpenMP threads to the same cores (vLLM's automatic binding
knows nothing of the other servers: on a 2-core machine all of them take core 0). A lease sets
VLLM_CPU_OMP_THREADS_BIND instead:

    with lease_cores() as lease:           # the least-leased core of those this process may use
        env.update(lease.environment())    # VLLM_CPU_OMP_THREADS_BIND=1, OMP_NUM_THREADS=1
        subprocess.Popen(command, env=env, pass_fds=lease.fds)   # the server holds the lease from now on

    slot = wait_for_start_slot()           # blocks while as many servers start as there are cores
    ...                                    # start the server; slot.release() once it answers

A lease on core c is a held lock on `core-<c>.<n>.lock`; the leases of a core are counted by trying each of
its files. Leases are taken under `allocate.lock`, so two takers never count the same free file. A start
slot is a held lock on `start-<i>.lock`, i below the number of cores. ROLLSTREAM_CPU_LEASE_DIR moves the
directory (default: <tmp>/rollstream-cpu-leases).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import tempfile
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

LEASE_DIR_VARIABLE = "ROLLSTREAM_CPU_LEASE_DIR"
"""Environment variable naming the lease directory (tests give each of theirs its own)."""


def lease_dir() -> Path:
    """The machine-wide directory of the lease and start-slot files, made on first use; writable by every user
    (sticky, like /tmp), so that the servers of several users share the machine as well."""
    default = Path(tempfile.gettempdir()) / "rollstream-cpu-leases"
    directory = Path(os.environ.get(LEASE_DIR_VARIABLE) or default)
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        try:
            directory.chmod(0o1777)
        except PermissionError:  # made by another user between the two calls: theirs is as good
            pass
    return directory


CORES_PER_SERVER_VARIABLE = "ROLLSTREAM_VLLM_CORES_PER_SERVER"
"""Environment variable: how many cores each vLLM CPU server leases (default 1). One core a server suits
the tiny models and a machine shared by several servers; a larger model served alone on a large machine
wants more (vLLM's automatic binding would have given it a NUMA node's cores)."""


def cores_per_server() -> int:
    """The cores each server leases: ROLLSTREAM_VLLM_CORES_PER_SERVER, at most those this process may use."""
    text = os.environ.get(CORES_PER_SERVER_VARIABLE, "1")
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{CORES_PER_SERVER_VARIABLE}={text!r}: give a whole number of cores, 1 or more")
    return min(int(text), len(allowed_cores()))


def allowed_cores() -> list[int]:
    """The cores this process may run on (its affinity: taskset, a cgroup's cpuset), in order."""
    return sorted(os.sched_getaffinity(0))


def _open_lock_file(path: Path) -> int:
    # Read-only is enough for flock, and opens a file another user made (0o644) as well.
    return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _take_free(paths: Iterable[Path]) -> int | None:
    """An open, locked descriptor of the first file of `paths` nobody holds; None when all are held."""
    for path in paths:
        fd = _open_lock_file(path)
        if _try_lock(fd):
            return fd
        os.close(fd)
    return None


def _held(path: Path) -> bool:
    fd = _take_free([path])
    if fd is None:
        return True
    os.close(fd)  # closing the descriptor drops its lock
    return False


class CoreLease:
    """Cores leased to one server, held for as long as a process holds one of `fds`: this one until close(),
    and the server's process, which start() hands them to (subprocess's pass_fds), until it exits."""

    def __init__(self, cores: Sequence[int], fds: Sequence[int]) -> None:
        self.cores = tuple(cores)
        self.fds = tuple(fds)
        self._finalizer = weakref.finalize(self, _close_all, self.fds)

    @property
    def bind(self) -> str:
        """The cores as VLLM_CPU_OMP_THREADS_BIND lists them: `0`, `2,3`."""
        return ",".join(str(core) for core in self.cores)

    def environment(self) -> dict[str, str]:
        """A vLLM server's variables for these cores: its OpenMP threads bound one to each of them (vLLM's
        worker sets the same OMP_NUM_THREADS for itself; here it also sizes torch's pool in vLLM's other
        processes, which would otherwise count every core of the machine)."""
        return {"VLLM_CPU_OMP_THREADS_BIND": self.bind, "OMP_NUM_THREADS": str(len(self.cores))}

    def keep_across_exec(self) -> None:
        """Let the lease survive os.exec* (a process that becomes the server keeps holding it)."""
        for fd in self.fds:
            os.set_inheritable(fd, True)

    def close(self) -> None:
        """This process's hold ends; a process the descriptors were handed to still holds the lease."""
        self._finalizer()

    def __enter__(self) -> CoreLease:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


@contextmanager
def _allocating(directory: Path) -> Iterator[None]:
    fd = _open_lock_file(directory / "allocate.lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _core_files(directory: Path, core: int) -> Iterator[Path]:
    return (directory / f"core-{core}.{index}.lock" for index in itertools.count())


def leases_per_core(cores: Sequence[int] | None = None, directory: Path | None = None) -> dict[int, int]:
    """How many leases each core has now (every core this process may use, unless `cores` names some)."""
    directory = directory or lease_dir()
    counts = {}
    for core in cores if cores is not None else allowed_cores():
        existing = {path.name for path in directory.glob(f"core-{core}.*.lock")}
        counts[core] = sum(_held(directory / name) for name in existing)
    return counts


def lease_cores(count: int = 1, cores: Sequence[int] | None = None,
                directory: Path | None = None) -> CoreLease:
    """A lease on the `count` least-leased of `cores` (default: those this process may use; ties go to the
    lowest), so that servers get cores of their own while there are enough and share them evenly after."""
    cores = sorted(cores) if cores is not None else allowed_cores()
    if not 1 <= count <= len(cores):
        raise ValueError(f"cannot lease {count} cores of the {len(cores)} this process may use ({cores})")
    directory = directory or lease_dir()
    with _allocating(directory):
        counts = leases_per_core(cores, directory)
        chosen = sorted(sorted(cores, key=lambda core: (counts[core], core))[:count])
        fds = [_take_free(_core_files(directory, core)) for core in chosen]
    return CoreLease(chosen, fds)


class StartSlot:
    """One of the machine's start slots, held by this process until release() (or its exit)."""

    def __init__(self, fd: int, index: int) -> None:
        self.index = index
        self._finalizer = weakref.finalize(self, _close_all, (fd,))

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        """Idempotent: a second call does nothing."""
        self._finalizer()


def start_slots() -> int:
    """How many vLLM servers may start at once: one per core this process may use. A start is about one core's
    work (three processes import torch and vLLM, then the weights load and the KV cache is allocated), so
    with a core each the starts take about what each takes alone; with more starts than cores they stretch
    together, and all of them near their health timeouts at once.

    The slots bound the starts, not the servers' lives: a server that answers and idles costs next to nothing
    (the tiny model's: 0.07 CPU-seconds in 10 s), one that serves is on its leased core, and a bound on
    lives would make a test wait for the whole module that holds the shared pair, or two workers each
    holding some servers wait on each other for good."""
    return len(allowed_cores())


def wait_for_start_slot(slots: int | None = None, directory: Path | None = None,
                        poll_s: float = 0.5) -> StartSlot:
    """A start slot of `slots` (default: start_slots()), waiting while every one is held."""
    slots = slots or start_slots()
    directory = directory or lease_dir()
    paths = [directory / f"start-{index}.lock" for index in range(slots)]
    while True:
        for index, path in enumerate(paths):
            fd = _take_free([path])
            if fd is not None:
                return StartSlot(fd, index)
        time.sleep(poll_s)
