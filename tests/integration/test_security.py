"""Secrets stay where they are configured, and every service works as its own Redis user.

A whole run (vLLM on the CPU, every service as a process) on the machine's Redis 7, each service connecting
as its own ACL user made from infra/redis-users.acl (the compose deployment's rules) with its own password,
the run itself as an admin user, and HTTP tokens on the services' routes: the integration tests' deployed run
(tests/integration/deployed.py), which test_local_run.py reads too. Afterwards: no service was denied
a command or crashed, each connected as its own user, /metrics asked for its token, and no configured secret
appears in any file of the run (logs of every service and of vLLM, config.json, archive, batches,
checkpoints, sandbox logs) or in what the run printed. A smaller run does the same on the local run's
embedded Redis with a password.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from rollstream.cli.local_run import LocalRun
from rollstream.shared.runtime.config import Settings
from tests.integration.deployed import DEPLOYED_VERSIONS, HTTP_TOKEN

pytestmark = pytest.mark.integration


def leaks(run_dir: Path, printed: str, secrets: list[str]) -> list[str]:
    """Every file under the run directory, and what was printed, that holds one of the secrets."""
    found = []
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found += [f"{path.relative_to(run_dir)}: secret #{i}"
                  for i, s in enumerate(secrets) if s.encode() in data]
    found += [f"printed output: secret #{i}" for i, s in enumerate(secrets) if s in printed]
    return found


@pytest.fixture(scope="module")
def acl_run(deployed_run):
    return deployed_run


def test_every_service_worked_as_its_own_redis_user_and_was_denied_nothing(acl_run):
    local = acl_run["local"]
    assert acl_run["progress"].version >= DEPLOYED_VERSIONS
    assert acl_run["denied"] == []
    assert local.unexpected_exits() == [], "\n".join(e.describe() for e in local.unexpected_exits())
    assert set(acl_run["exit_codes"].values()) == {0}, acl_run["exit_codes"]
    services = {"dispatcher", "agent-runner", "sandbox-grader", "reward", "trainer", "recorder"}
    assert {acl_run["prefix"] + name for name in services} <= acl_run["connected_users"]
    assert acl_run["progress"].graded > 0  # the sandbox-grader's RQ work ran under its own user too


def test_healthz_is_open_and_metrics_asks_for_its_own_token(acl_run):
    assert set(acl_run["healthz"].values()) == {200}
    for name, (without, with_http_token, with_metrics_token) in acl_run["metrics"].items():
        assert (without, with_http_token, with_metrics_token) == (401, 403, 200), name


def test_no_secret_is_in_any_file_of_the_run_or_in_its_output(acl_run):
    local = acl_run["local"]
    assert list(local.log_dir.glob("*.log")), "the services logged nothing"
    assert leaks(local.run_dir, "\n".join(acl_run["printed"]), acl_run["secrets"]) == []
    config = (local.run_dir / "config.json").read_text()
    assert "redis_password" not in config and "http_token" not in config and "**" not in config


def test_sandbox_jobs_carry_no_redis_url(acl_run):
    assert acl_run["rq_jobs"], "no sandbox job ran"
    for job in acl_run["rq_jobs"]:
        assert b"redis://" not in job and not [s for s in acl_run["secrets"] if s.encode() in job]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_the_local_run_works_with_a_password_on_its_embedded_redis(tmp_path):
    password = f"embedded-{uuid.uuid4().hex}"
    settings = Settings(run_id=f"sec-{uuid.uuid4().hex[:8]}", redis_password=password,
                        storage_uri=str(tmp_path), security={"http_token": HTTP_TOKEN},
                        data={"samples_per_prompt": 2}, train={"batch_size": 4, "total_versions": 1})
    printed: list[str] = []
    local = LocalRun(settings, services=("dispatcher", "sandbox-grader", "reward", "recorder"))
    try:
        local.start(on_step=printed.append)  # not `with`: a failure also removes the run's Redis users
        client = redis.Redis.from_url(local.settings.redis)
        deadline = time.monotonic() + 60
        while not client.xlen(local.bus.keys.stream("prompts")):  # the dispatcher admits samples
            assert time.monotonic() < deadline, local.log_tail("dispatcher")
            time.sleep(0.2)
        with pytest.raises(redis.exceptions.NoPermissionError):  # nobody gets in without the password
            redis.Redis.from_url(local.settings.redis_url).xlen(local.bus.keys.stream("prompts"))
        port = local.health_ports["reward"]
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 401
    finally:
        codes = local.stop()
    assert set(codes.values()) == {0}, codes
    assert leaks(local.run_dir, "\n".join(printed), [password, HTTP_TOKEN]) == []
