"""The command line's children (cli/child_processes.py): each in a session of its own and taken along when
the command dies, and the stop signals: the first interrupts, a further one forces."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from rollstream.cli.child_processes import (
    STOP_SIGNALS,
    forced_by_signals,
    interrupt_on_stop_signals,
    start_child,
    with_parent_death_signal,
)

SLEEPER = "import time; time.sleep(120)"
PARENT = f"""
import signal, sys, time
from rollstream.cli.child_processes import start_child

child = start_child([sys.executable, "-c", {SLEEPER!r}], parent_death_signal=signal.SIGTERM)
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.fixture
def stop_handlers():
    """The test process's handlers of the stop signals, given back afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def wait_until(done, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_child_runs_in_a_session_of_its_own_and_goes_when_its_parent_is_sigkilled():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert os.getsid(child) == child != os.getsid(parent.pid)
        # the wrapper has set the signal and become the command
        assert wait_until(lambda: psutil.Process(child).cmdline()[1:] == ["-c", SLEEPER])
        parent.kill()
        parent.wait()
        assert wait_until(lambda: gone(child)), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        if psutil.pid_exists(child):
            os.kill(child, signal.SIGKILL)


def test_the_wrapper_runs_nothing_when_its_parent_is_gone_before_the_signal_is_set():
    command = with_parent_death_signal(["echo", "ran"], signal.SIGTERM)
    command[command.index(str(os.getpid()))] = "1"  # as if this process had died and left the child to init
    ran = subprocess.run(command, capture_output=True, text=True)
    assert ran.returncode == 1 and ran.stdout == ""
    assert "not started: its parent (pid 1) is gone" in ran.stderr


def test_a_child_started_off_the_main_thread_gets_no_parent_death_signal(monkeypatch):
    # the kernel would send it when that thread ends, long before the process does
    commands = []
    monkeypatch.setattr(subprocess, "Popen", lambda command, **options: commands.append(command))
    thread = threading.Thread(target=start_child, args=(["true"],),
                              kwargs={"parent_death_signal": signal.SIGTERM})
    thread.start()
    thread.join()
    start_child(["true"], parent_death_signal=signal.SIGTERM)
    assert commands[0] == ["true"] and commands[1][-1] == "true" and commands[1][0] == sys.executable


def test_a_stop_signal_during_a_forced_block_forces_and_the_block_goes_on(stop_handlers):
    # Python's own Ctrl-C handler before the block, whatever an earlier test of this process left there
    signal.signal(signal.SIGINT, signal.default_int_handler)
    forced = []
    with forced_by_signals(lambda: forced.append(True)):
        for sig in STOP_SIGNALS:
            signal.raise_signal(sig)
    assert len(forced) == len(STOP_SIGNALS)
    with pytest.raises(KeyboardInterrupt):  # the handler from before is back
        signal.raise_signal(signal.SIGINT)


def test_the_first_stop_signal_interrupts_and_every_further_one_forces(stop_handlers):
    forced = []
    interrupt_on_stop_signals(force=lambda: forced.append(True))
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGHUP)
    signal.raise_signal(signal.SIGQUIT)
    signal.raise_signal(signal.SIGINT)
    assert forced == [True, True]


def test_without_a_force_every_stop_signal_interrupts(stop_handlers):
    interrupt_on_stop_signals()
    for sig in (signal.SIGTERM, signal.SIGTERM):
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(sig)
