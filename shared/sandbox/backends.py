"""Pick a sandbox backend by name: the one switch the grader and the coding tools go through.

    from rollstream.shared.sandbox.backends import get_backend
    backend = get_backend("bubblewrap")     # or "docker"; "unsafe-local" needs allow_unsafe=True
    result = backend.run("pytest -q", workspace, limits=SandboxLimits(wall_time_s=60))

"unsafe-local" runs model-written code on the host with no isolation; it must be asked for by its
exact name and with allow_unsafe=True, so a typo never selects it.
"""

from __future__ import annotations

from typing import Any

from rollstream.shared.sandbox.base import SandboxBackend
from rollstream.shared.sandbox.bubblewrap import BubblewrapBackend
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

