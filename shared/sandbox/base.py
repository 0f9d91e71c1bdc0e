"""The sandbox contract: what one run may use (SandboxLimits), what it gives back (SandboxResult), and
the protocol every backend implements.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SandboxLimits:
    wall_time_s: float = 10
    """Wall-clock limit; then every process in the sandbox is killed."""
    cpu_time_s: float = 10
    """CPU seconds per process (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later)."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS), in MiB."""
    max_processes: int = 64
    """Processes and threads the sandbox may have at once (RLIMIT_NPROC on a per-run uid)."""
    max_file_size_mb: int = 64
    """Largest file the command may write (RLIMIT_FSIZE), in MiB."""
    max_open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_output_bytes: int = 64 * 1024
    """stdout and stderr are each kept up to this many bytes; the rest is drained and dropped."""
    tmp_size_mb: int = 64
    """Size of the tmpfs at /tmp (and of the one at /dev/shm), in MiB."""


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int | None
    """The command's exit status (128+N when it died of signal N); None when the wall clock killed it."""
    stdout: str
    """Captured stdout, at most max_output_bytes of it (decoded as UTF-8, bad bytes replaced)."""
    stderr: str
    """Captured stderr, likewise capped."""
    timed_out: bool
    """The wall-clock limit killed the sandbox."""
    output_truncated: bool
    """stdout or stderr had more than max_output_bytes; the rest was dropped."""
    duration_s: float
    """Wall time from starting bwrap to its end."""
    reason: str
    """What happened, in words: "exit 0", "killed: wall-clock limit 10s", ..."""


@runtime_checkable
class SandboxBackend(Protocol):
    """What the grader and the coding tools need of a sandbox: run a command on a workspace, within
    limits, with extra mounts and environment, in the task's image where the backend has images."""

    name: str

    def image_for(self, environment_dir: Path | None) -> str | None:
        """The image to run a task in, built from its environment directory; None: the backend's
        default (or no images at all)."""
        ...

    def run(self, command: str, workspace: Path, *, limits: SandboxLimits,
            ro_mounts: dict[str, Path] | None = None, rw_mounts: dict[str, Path] | None = None,
            env: dict[str, str] | None = None, image: str | None = None) -> SandboxResult: ...
