"""The sandbox grader's settings (`grader.*`, RS_GRADER__*): the sandbox it grades in, its job queue and
retries, the limits of one check, and where SWE rows' environments are built.

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from rollstream.shared.runtime.sections import Section


class GraderSettings(Section):
    backend: Literal["bubblewrap", "docker"] = "bubblewrap"
    """Sandbox of the grader: bubblewrap (no daemon needed) or docker (an engine must be reachable)."""
    queue: str = "sandbox"
    """RQ queue of sandbox jobs."""
    retries: int = Field(3, ge=0)
    """Retries of a grading job whose sandbox failed to run (never of failing tests)."""
    wall_time_s: float = Field(10.0, gt=0)
    """Wall-clock limit of one check."""
    memory_mb: int = Field(512, ge=16)
    """Memory limit of one check (per process under bubblewrap: RLIMIT_DATA)."""
    job_timeout_s: int = Field(60, ge=1)
    """RQ job timeout."""
    probe_interval_s: float = Field(30.0, gt=0)
    """How often a grading sandbox-grader runs a trivial command in a real sandbox to tell whether its backend
    still works (/healthz 503 with the reason when not); one that is not ready yet tries every 5 s."""
    environments_dir: Path | None = None
    """Where the bubblewrap backend builds SWE rows' environments (a virtual environment per repository,
    environment commit and install), mounted read-only at the same path in the sandbox: not under /tmp, /usr
    or /etc. Default: ~/.cache/rollstream/environments, /var/cache/rollstream/environments for root."""
