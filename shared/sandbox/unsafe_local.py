"""The unsafe-local backend: a plain subprocess on the host, NO isolation, for debugging only.

`get_backend` (shared/sandbox/backends.py) refuses it unless the name is exactly "unsafe-local" and
allow_unsafe=True. It cannot provide mounts (no /tests, /logs), so it runs commands, not Harbor
grading; nor can it put the workspace at a `workdir`: the command runs in the host directory
itself, so absolute paths such as /app or /workspace do not lead to it.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from rollstream.shared.errors import BackendUnavailable
from rollstream.shared.sandbox.base import DEFAULT_WORKDIR, SandboxLimits, SandboxResult


class UnsafeLocalBackend:
    """Runs the command with subprocess on the host, NO isolation (debugging only)."""

    name = "unsafe-local"

    def image_for(self, environment_dir: Path | None) -> str | None:
        return None

    def run(self, command: str, workspace: Path, *, limits: SandboxLimits,
            ro_mounts: dict[str, Path] | None = None, rw_mounts: dict[str, Path] | None = None,
            env: dict[str, str] | None = None, image: str | None = None,
            workdir: str = DEFAULT_WORKDIR,
            kept_mounts: dict[str, Path] | None = None) -> SandboxResult:
        mounts = {**(ro_mounts or {}), **(rw_mounts or {}), **(kept_mounts or {})}
        if mounts:
            raise BackendUnavailable(f"unsafe-local cannot mount {sorted(mounts)}: it "
                                     "runs on the host as is; grade with bubblewrap or docker")
        started = time.monotonic()
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workspace),
                    "LANG": "C.UTF-8", **(env or {})}
        try:
            proc = subprocess.run(["/bin/sh", "-c", command], cwd=workspace, env=full_env,
                                  stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=limits.wall_time_s, start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            return SandboxResult(None, _cap_bytes(exc.stdout, limits), _cap_bytes(exc.stderr, limits),
                                 True, False, time.monotonic() - started,
                                 f"killed: wall-clock limit {limits.wall_time_s:g}s")
        cap = limits.max_output_bytes
        return SandboxResult(proc.returncode, _cap_bytes(proc.stdout, limits),
                             _cap_bytes(proc.stderr, limits), False,
                             len(proc.stdout) > cap or len(proc.stderr) > cap,
                             time.monotonic() - started, f"exit {proc.returncode}")


def _cap_bytes(data: bytes | None, limits: SandboxLimits) -> str:
    return (data or b"")[:limits.max_output_bytes].decode("utf-8", errors="replace")

