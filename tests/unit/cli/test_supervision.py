"""The local run's supervisor: a service process that exits is started again after a back-off and
counted; one that keeps crashing stops the run with its log tail; one stopped on purpose stays down."""

from __future__ import annotations

import sys
import time

import pytest

from rollstream.cli import restart_policy
from rollstream.cli.local_run import LocalRun, ServiceDied
from tests.support import supervised_run

CRASHING = [sys.executable, "-c", "import sys; print('boom: bad state', flush=True); sys.exit(3)"]
SLEEPING = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def supervised(tmp_path, monkeypatch):
    monkeypatch.setattr(restart_policy, "RESTART_BACKOFF_S", (0.0, 0.1, 0.2))
    with supervised_run(tmp_path, monkeypatch, {"reward": CRASHING, "trainer": SLEEPING}, "sup") as run:
        yield run


def supervise_until(run: LocalRun, done, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        run.check_alive()
        assert time.monotonic() < deadline, f"supervisor state: restarts {run.restarts}, exits {run.exits}"
        time.sleep(0.05)


def test_a_crashed_service_is_restarted_and_counted_and_one_that_keeps_crashing_stops_the_run(supervised):
    supervise_until(supervised, lambda: supervised.restarts.get("reward", 0) >= 2)
    assert {e.process for e in supervised.exits} == {"reward"}
    assert all(e.exit_code == 3 and not e.injected and "boom: bad state" in e.log_tail
               for e in supervised.exits)
    with pytest.raises(ServiceDied) as died:
        supervise_until(supervised, lambda: False)
    assert f"reward exited {restart_policy.MAX_CRASHES + 1} times" in str(died.value)
    assert "boom: bad state" in str(died.value)  # the log tail says why
    assert supervised.processes["trainer"].poll() is None  # the healthy one was left alone


def test_an_injected_crash_is_restarted_without_counting_towards_a_crash_loop_and_a_kill_is_not_restarted(
        supervised):
    supervised.kill("reward")
    first = supervised.processes["trainer"].pid
    supervised.crash("trainer")
    supervise_until(supervised, lambda: supervised.restarts.get("trainer", 0) == 1)
    assert supervised.processes["trainer"].pid != first and supervised.processes["trainer"].poll() is None
    for _ in range(restart_policy.MAX_CRASHES + 2):  # crashes brought about on purpose never stop the run
        supervised.crash("trainer")
        restarts = supervised.restarts["trainer"]
        supervise_until(supervised, lambda restarts=restarts: supervised.restarts["trainer"] == restarts + 1)
    supervised.kill("trainer")
    for _ in range(10):
        supervised.check_alive()
        time.sleep(0.05)
    assert supervised.processes == {} and supervised.restarts == {"trainer": restart_policy.MAX_CRASHES + 3}
    # every exit is on record as brought about on purpose: none is a crash a chaos audit would fail on
    assert [e.process for e in supervised.exits] == (["reward"]
                                                     + ["trainer"] * (restart_policy.MAX_CRASHES + 4))
    assert all(e.injected for e in supervised.exits) and supervised.unexpected_exits() == []


def test_while_the_run_starts_an_exit_is_fatal_at_once(supervised):
    supervised.processes["reward"].wait()
    with pytest.raises(ServiceDied, match="reward exited with code 3"):
        supervised.check_alive(restart=False)
