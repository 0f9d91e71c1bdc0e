"""Pick a sandbox backend by name: the one switch the grader and the coding tools go through.

    from rollstream.shared.sandbox.backends import get_backend
    backend = get_backend("bubblewrap")     # or "docker"; "unsafe-local" needs allow_unsafe=True
    result = backend.run("pytest -q", workspace, limits=SandboxLimits(wall_time_s=60))

"unsafe-local" runs model-written code on the host with no isolation; it must be asked for by its
exact name and with allow_unsafe=True, so a typo never selects it.

`probe_sandbox` makes a real sandbox of a backend and runs a trivial command in it: that bwrap is on
PATH or an engine answers does not mean a sandbox can be made (user namespaces forbidden, a container
without the security options, a full /tmp, a missing image). The grader's readiness and `rollstream
run`'s preflight use it.

    probe_sandbox("bubblewrap")             # BackendUnavailable with the reason and what to do
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from rollstream.shared.errors import BackendUnavailable, SandboxError
from rollstream.shared.sandbox.base import SandboxBackend, SandboxLimits
from rollstream.shared.sandbox.bubblewrap import BubblewrapBackend, setup_failure_hint
from rollstream.shared.sandbox.docker import DockerBackend
from rollstream.shared.sandbox.unsafe_local import UnsafeLocalBackend

_BACKENDS = {"bubblewrap": BubblewrapBackend, "bwrap": BubblewrapBackend, "docker": DockerBackend}


def get_backend(name: str, *, allow_unsafe: bool = False, **options: Any) -> SandboxBackend:
    """A backend by name: "bubblewrap" (alias "bwrap"), "docker", or "unsafe-local" (only with
    allow_unsafe=True and that exact name)."""
    if name == "unsafe-local":
        if allow_unsafe is not True:
            raise ValueError("backend 'unsafe-local' runs model-written code on the host with no "
                             "isolation at all; pass allow_unsafe=True to use it (debugging only)")
        return UnsafeLocalBackend(**options)
    if "unsafe" in name.lower() or "local" in name.lower():
        raise ValueError(f"unknown backend {name!r}: the unsafe backend must be named exactly "
                         "'unsafe-local' and needs allow_unsafe=True")
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: bubblewrap, docker, unsafe-local")
    return _BACKENDS[name](**options)


PROBE_MARKER = "rs-sandbox: probe ran"
"""What the probe's command prints: seen on stdout, the sandbox ran a command of ours."""

PROBE_LIMITS = SandboxLimits(wall_time_s=30, cpu_time_s=5, memory_mb=256, max_processes=16,
                             max_output_bytes=4096, tmp_size_mb=1)
"""Small, but with time for a docker engine to create and start a container."""


def probe_sandbox(name: str, **options: Any) -> None:
    """Run a trivial command in a real sandbox of backend `name` (options as for get_backend), on a
    fresh temp workspace. BackendUnavailable with the backend's own words, and what to do where we
    know it, when no sandbox can be made or the command does not run in it."""
    backend = get_backend(name, **options)
    try:
        with tempfile.TemporaryDirectory(prefix="rs-probe-") as workspace:
            result = backend.run(f"echo '{PROBE_MARKER}'", Path(workspace), limits=PROBE_LIMITS)
    except (SandboxError, OSError) as exc:
        raise BackendUnavailable(f"{name} could not make a sandbox: {exc}") from exc
    if result.exit_code == 0 and result.stdout.strip() == PROBE_MARKER:
        return
    status = result.reason if result.timed_out else f"exit {result.exit_code}"
    said = result.stderr.strip()[:500] or "nothing on stderr"
    hint = setup_failure_hint(result.stderr) if backend.name == "bubblewrap" else ""
    raise BackendUnavailable(f"{name} could not run a command in a sandbox ({status}): {said}"
                             + (f" -- {hint}" if hint else ""))
