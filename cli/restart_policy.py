"""The local run's restart policy: when its supervisor starts an exited process again, and when it gives up.

As Compose's restart policy does: a service process that exits is started again after a back-off
(RESTART_BACKOFF_S, longer with each crash in CRASH_WINDOW_S); one that crashes more than MAX_CRASHES times in
the window stops the run (it will not get better). Exits brought about on purpose (fault injection) are
recorded as such and are no crashes. The supervisor itself, which watches the processes and starts them, is
LocalRun.check_alive (cli/local_run.py).
"""

from __future__ import annotations

from dataclasses import dataclass

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0)
"""Wait before restarting a service: the n-th crash within CRASH_WINDOW_S waits the n-th value."""
CRASH_WINDOW_S = 300.0
MAX_CRASHES = 5
"""More crashes than this of one process within CRASH_WINDOW_S stop the run: it will not get better."""


@dataclass(frozen=True)
class ProcessExit:
    """One exit of a process the local run started, as its supervisor saw it."""

    process: str
    exit_code: int | None
    at_s: float
    """Seconds into the run when the supervisor saw it."""
    injected: bool
    """Brought about on purpose (fault injection: kill(), crash(), restart_vllm(), record_exit()), not by the
    process itself."""
    log_tail: str = ""
    """The last lines of its log when the exit was seen (a restart appends to the same file)."""

    def describe(self) -> str:
        how = "stopped on purpose" if self.injected else "exited on its own"
        return (f"{self.process} {how} with code {self.exit_code} at {self.at_s:.1f}s; "
                "last lines of its log:\n" + (self.log_tail or "(empty)"))


def recent_crashes(exits: list[ProcessExit], process: str, at_s: float) -> int:
    """The process's crashes within CRASH_WINDOW_S up to at_s: its exits that no fault injection brought
    about (those say nothing about its health)."""
    return sum(1 for e in exits
               if e.process == process and not e.injected and at_s - e.at_s <= CRASH_WINDOW_S)


def crash_loop(crashes: int) -> bool:
    """Too many recent crashes: the run stops instead of restarting the process once more."""
    return crashes > MAX_CRASHES


def restart_backoff_s(crashes: int) -> float:
    """How long the supervisor waits before it starts a process with this many recent crashes again."""
    return RESTART_BACKOFF_S[max(0, min(crashes, len(RESTART_BACKOFF_S)) - 1)]
