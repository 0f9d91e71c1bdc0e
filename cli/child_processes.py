"""The processes the command line starts, and how they end with it.

Each child starts in a session (and process group) of its own: a Ctrl-C in the terminal then reaches only the
command, which stops its children in order (the services first, while Redis still answers, then vLLM and
Redis), and a signal to the group reaches the child's own children too (vLLM's engine core and workers).

Each child also gets a parent-death signal (Linux PR_SET_PDEATHSIG), so that an OOM-killed or SIGKILLed
command takes its children along: the kernel sends the child that signal when the command dies, and the
child stops as it would when asked (a service drains and exits, vLLM stops its engine). A small exec wrapper
sets it (`python -c`, which then becomes the command, same pid), not a preexec_fn, which may deadlock a
process that has threads (`rollstream run`'s progress display has one). The wrapper exits at once if the
command died before the signal was set. The kernel sends the signal when the *thread* that started the
child ends, not the process, so it is set only for children started from the main thread, which lives as
long as the process; a child started from another thread runs without one.

    process = start_child(command, parent_death_signal=signal.SIGTERM, stdout=log)

What asks a command to stop (STOP_SIGNALS): Ctrl-C, `kill`, a closed terminal (SIGHUP), Ctrl-\\ (SIGQUIT).
`interrupt_on_stop_signals` makes each the KeyboardInterrupt a Ctrl-C is, and every further one a forced
stop; `forced_by_signals` forces the stop that a block runs (a second Ctrl-C SIGKILLs what a graceful stop
still waits for, as docker compose and torchrun do, instead of abandoning the stop).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""Ctrl-C, `kill`, the terminal closed, Ctrl-\\: each asks a command to stop, and the second forces it."""

_SET_PARENT_DEATH_SIGNAL = """
import ctypes, os, sys
parent, death_signal = int(sys.argv[1]), int(sys.argv[2])
if ctypes.CDLL(None, use_errno=True).prctl(1, death_signal) != 0:  # 1: PR_SET_PDEATHSIG
    sys.exit(f"cannot set the parent-death signal: {os.strerror(ctypes.get_errno())}")
if os.getppid() != parent:  # it died before the signal was set: nothing is left to run for
    sys.exit(f"not started: its parent (pid {parent}) is gone")
os.execvp(sys.argv[3], sys.argv[3:])
"""
"""Run as `python -I -S -c` (no site, no environment: the standard library alone) before a child's command."""


def with_parent_death_signal(command: Sequence[str], death_signal: signal.Signals) -> list[str]:
    """`command`, started so that it receives `death_signal` when this process (its starting thread) ends."""
    return [sys.executable, "-I", "-S", "-c", _SET_PARENT_DEATH_SIGNAL, str(os.getpid()),
            str(int(death_signal)), *command]


def start_child(command: Sequence[str], *, parent_death_signal: signal.Signals,
                **options) -> subprocess.Popen:
    """Popen(command, **options) in a session of its own, with `parent_death_signal` where the kernel has one
    (Linux) and this is the main thread (see the module docstring)."""
    if sys.platform == "linux" and threading.current_thread() is threading.main_thread():
        command = with_parent_death_signal(command, parent_death_signal)
    return subprocess.Popen(list(command), start_new_session=True, **options)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send `sig` to a process group; nothing when it is gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user took the number: ours is gone
        return False
    return True


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Until no process is left in the group (False when some still are after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while group_exists(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


@contextmanager
def forced_by_signals(force: Callable[[], None]) -> Iterator[None]:
    """While the block runs, each stop signal calls force() (and the block goes on: what it waits for is then
    gone) instead of what it did; on the main thread only, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda _signum, _frame: force()) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def interrupt_on_stop_signals(force: Callable[[], None] | None = None) -> None:
    """Each stop signal raises KeyboardInterrupt the first time, as Ctrl-C does (the command then stops what
    it started); from then on each calls force(), which must end what a graceful stop still waits for.
    Without force, each raises KeyboardInterrupt."""

    def interrupt(_signum, _frame) -> None:
        if force is not None:
            for sig in STOP_SIGNALS:
                signal.signal(sig, lambda _signum, _frame: force())
        raise KeyboardInterrupt

    for sig in STOP_SIGNALS:
        signal.signal(sig, interrupt)
