"""The sandbox contract: what one run may use (SandboxLimits), what it gives back (SandboxResult), the
protocol every backend implements, where in the sandbox a caller may put things (`place_mounts`), and a
task's test environment as a backend provides it (SandboxEnvironment; a backend that prepares environments
has `environment_for(spec, build=True)`, shared/sandbox/venv_environments.py for bubblewrap).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from rollstream.shared.errors import SandboxError

DEFAULT_WORKDIR = "/workspace"
"""Where the workspace is in the sandbox unless the caller names another place (a Harbor task's
WORKDIR, e.g. /app)."""

SYSTEM_PATHS = ("/", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc",
                "/sys", "/dev", "/tmp")
"""The sandbox's own paths: the workspace and extra mounts may be none of them nor lie under one
(except "/", under which everything lies)."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_time_s: float = 10
    """Wall-clock limit; then every process in the sandbox is killed."""
    cpu_time_s: float = 10
    """CPU seconds per process (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later)."""
    memory_mb: int = 512
    """Memory per process, in MiB: what it may map writable (RLIMIT_DATA) under bubblewrap, the container's
    memory under docker."""
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


@dataclass(frozen=True)
class SandboxEnvironment:
    """A task's test environment as a backend runs it: what to mount read-only, which variables to set and
    which image to run in (None: the backend's default)."""

    ro_mounts: dict[str, Path] = field(default_factory=dict)
    """Sandbox path -> host path, e.g. a prepared virtual environment (bubblewrap)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables the run gets, e.g. PATH with the environment's bin/ first."""
    image: str | None = None
    """The image holding the environment (docker), or None."""


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
            env: dict[str, str] | None = None, image: str | None = None,
            workdir: str = DEFAULT_WORKDIR,
            kept_mounts: dict[str, Path] | None = None) -> SandboxResult:
        """Run `/bin/sh -c command` with `workspace` mounted read-write at `workdir` in the sandbox,
        which is also the command's working directory and HOME; mounts map sandbox paths to host
        paths (see place_mounts). rw_mounts are lent to the sandbox's user for the run, like the
        workspace; kept_mounts are read-write but stay with their owner, so the sandbox may do
        there only what their modes let any user do (write a 0666 file, add to a 1777 directory)
        and cannot chmod, delete or replace what it does not own. That holds where the sandbox's
        user is not the caller's (docker; bubblewrap run as root)."""
        ...


def sandbox_path(path: str, what: str) -> str:
    """`path` with repeated and trailing slashes dropped, when it is a place a caller may mount
    something in the sandbox: absolute, without `.` or `..`, not (under) one of SYSTEM_PATHS.
    Else SandboxError, naming it as `what`."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path \
            or any(part in ("..", ".") for part in path.split("/")):
        raise SandboxError(f"{what} {path!r} must be an absolute path without . or ..")
    path = "/" + "/".join(part for part in path.split("/") if part)
    for reserved in SYSTEM_PATHS:
        if path == reserved or (reserved != "/" and path.startswith(reserved + "/")):
            raise SandboxError(f"{what} {path!r} is (under) the sandbox's {reserved}")
    return path


def place_mounts(workdir: str, targets: Iterable[str]) -> tuple[str, list[str]]:
    """The workspace's sandbox path and the extra mounts' sandbox paths, each checked and
    normalized by sandbox_path. A mount may not be, contain or lie under the workspace (one would
    hide the other), and no target may be given twice."""
    workdir = sandbox_path(workdir, "workdir")
    checked: list[str] = []
    for target in targets:
        target = sandbox_path(target, "bind target")
        if target == workdir or target.startswith(workdir + "/") or workdir.startswith(target + "/"):
            raise SandboxError(f"bind target {target!r} overlaps the workspace at {workdir}")
        if target in checked:
            raise SandboxError(f"bind target {target!r} given twice")
        checked.append(target)
    return workdir, checked
