"""Two trainer processes of one run: the second stands by and trains only once the first is gone."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from rollstream.cli.local_run import LocalRun
from rollstream.shared.runtime.config import Settings

STANDBY = "standby: another trainer of this run is training"


def states(local: LocalRun) -> dict[str, str]:
    return {name: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json().get("state")
            for name, port in local.health_ports.items() if name in local.processes}


def wait_for(local: LocalRun, wanted, timeout_s: float = 60) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = states(local)
        if wanted(seen):
            return seen
        time.sleep(0.3)
    raise AssertionError(f"trainers' states: {states(local)}")


@pytest.fixture
def two_trainers(machine_redis_url, tmp_path, tiny_model):
    settings = Settings(run_id=f"lock-{uuid.uuid4().hex[:8]}", redis_url=machine_redis_url,
                        storage_uri=str(tmp_path / "runs"), model={"path": tiny_model},
                        train={"trackers": []}, recorder={"enabled": False})
    fleet = ["http://127.0.0.1:9"]  # never asked: no batch comes
    with LocalRun(settings, services=("trainer",), replicas={"trainer": 2}, fleet_urls=fleet) as local:
        yield local
    local.bus.delete_run()


def test_the_second_trainer_stands_by_and_takes_over_once_the_first_is_killed(two_trainers):
    seen = wait_for(two_trainers, lambda s: sorted(s.values()) == sorted(["training", STANDBY]))
    holder = next(name for name, state in seen.items() if state == "training")
    two_trainers.kill(holder)  # SIGKILL, left down: its lease must lapse by itself
    (other,) = set(seen) - {holder}
    assert wait_for(two_trainers, lambda s: s.get(other) == "training")[other] == "training"
