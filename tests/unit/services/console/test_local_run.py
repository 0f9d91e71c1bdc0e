"""The local run starts the console after the other services, telling it where each one's /healthz answers:
real service processes on the machine's Redis (nothing generates, so no vLLM).

    python -m pytest tests/unit/services/console/test_local_run.py -q
"""

from __future__ import annotations

import uuid

import httpx

from rollstream.cli.local_run import LocalRun
from rollstream.shared.runtime.config import Settings
from tests.unit.services.console.conftest import TOKEN


def test_the_local_runs_console_shows_its_services_health(machine_redis_url, tiny_model, tmp_path):
    settings = Settings(run_id=f"console-{uuid.uuid4().hex[:8]}", redis_url=machine_redis_url,
                        storage_uri=str(tmp_path / "runs"), model={"path": tiny_model},
                        recorder={"enabled": False}, security={"http_token": TOKEN})
    local = LocalRun(settings, services=("reward", "console"))
    try:
        local.start()
        assert local.console_url == f"http://127.0.0.1:{local.console_port}/"
        reply = httpx.get(f"{local.console_url}api/overview", headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=30)
        assert reply.status_code == 200, reply.text
        (reward,) = [row for row in reply.json()["replicas"] if row["service"] == "reward"]
        assert (reward["status"], reward["url"]) == ("ok", f"http://127.0.0.1:{local.health_ports['reward']}")
        assert httpx.get(local.console_url, timeout=30).text.startswith("<!doctype html>")
    finally:
        local.stop()
        if local.bus is not None:
            local.bus.delete_run()
