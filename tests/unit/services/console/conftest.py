"""The console's tests' fixtures: a small run of two roles published through the Bus on the machine's Redis
(published_run.py), and a real `rollstream-console` process showing it, with an HTTP token, its own /healthz
as one of the services it asks, a closed port as another, and a policy server on a closed port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rollstream.shared.contract.bus import Bus
from tests.support import free_port, stop_process_group, wait_for
from tests.unit.services.console.published_run import ROLES, PublishedRun, publish_run

TOKEN = f"console-token-{uuid.uuid4().hex}"


@dataclass
class RunningConsole:
    url: str
    """The page's and the API's base URL, with a trailing slash."""
    health_port: int
    closed_port: int
    """A port nothing listens on, named as the `reward` service's health URL."""
    published: PublishedRun
    log: Path

    def get(self, path: str, token: str | None = TOKEN, **params) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.get(self.url + path.lstrip("/"), headers=headers, params=params, timeout=30)


@pytest.fixture(scope="package")
def published(machine_redis_url, tiny_model, tmp_path_factory):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    bus = Bus.connect(machine_redis_url, f"test-console-{uuid.uuid4().hex[:8]}", ride_out_outages=False)
    try:
        yield publish_run(bus, tmp_path_factory.mktemp("console-runs"),
                          lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                          f"http://127.0.0.1:{free_port()}")
    finally:
        bus.delete_run()
        bus.redis.close()


@pytest.fixture(scope="package")
def console(published, machine_redis_url, tiny_model, tmp_path_factory):
    port, health_port, closed_port = free_port(), free_port(), free_port()
    env = {name: value for name, value in os.environ.items() if not name.startswith("RS_")}
    env.update(RS_REDIS_URL=machine_redis_url, RS_RUN_ID=published.run, RS_STORAGE_URI=published.storage,
               RS_MODEL__PATH=str(tiny_model), RS_FLEET__URLS=json.dumps([published.fleet_url]),
               RS_ROLES__NAMES=json.dumps(ROLES), RS_TRAIN__LORA_RANK="8", RS_SECURITY__HTTP_TOKEN=TOKEN,
               RS_CONSOLE__PORT=str(port), RS_HEALTH_PORT=str(health_port),
               RS_CONSOLE__HEALTH_URLS=json.dumps({"console": f"http://127.0.0.1:{health_port}",
                                                   "reward": f"http://127.0.0.1:{closed_port}"}))
    log = tmp_path_factory.mktemp("console-log") / "console.log"
    script = Path(sys.executable).with_name("rollstream-console")
    with open(log, "wb") as out:
        process = subprocess.Popen([str(script)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    running = RunningConsole(f"http://127.0.0.1:{port}/", health_port, closed_port, published, log)

    def ready() -> bool:
        assert process.poll() is None, f"the console exited:\n{log.read_text()}"
        try:
            return httpx.get(f"http://127.0.0.1:{health_port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 60, "the console's /healthz")
        yield running
    finally:
        stop_process_group(process)
    assert process.returncode == 0, f"the console did not stop cleanly on SIGTERM:\n{log.read_text()}"
