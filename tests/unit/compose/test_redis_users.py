"""The compose deployment's Redis users (infra/redis-users.acl, infra/redis-start.sh): one per service, each
service connecting as its own with its own password, none allowed an admin or dangerous command or another
service's keys; checked statically, on the machine's Redis 7, and with the start script on a real
redis-server. That the rules let every service do its work is tests/integration/test_security.py's part."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support import REPO, free_port

SERVICES = {"dispatcher", "gateway", "agent-runner", "sandbox-grader", "reward", "trainer", "recorder"}
READERS = {"vllm": "vllm-cpu", "console": "console"}
"""Users that only read, and the compose service that connects as each (the vLLM server finds the newest
policy, the console shows the run)."""
USERS_FILE = REPO / "infra" / "redis-users.acl"


def users() -> dict[str, list[str]]:
    out = {}
    for line in USERS_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, *rules = line.split()
            out[name] = rules
    return out


def password_variable(user: str) -> str:
    return "RS_REDIS_PASSWORD_" + user.upper().replace("-", "_")


def compose():
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def test_every_service_connects_as_its_own_user_with_its_own_required_password():
    services = compose()
    assert set(users()) == SERVICES | set(READERS) | {"admin"}
    for name, service in [(name, name) for name in SERVICES] + list(READERS.items()):
        env = services[service]["environment"]
        assert env["RS_REDIS_USERNAME"] == name
        assert env["RS_REDIS_PASSWORD"].startswith("${" + password_variable(name) + ":?"), name
    redis_env = services["redis"]["environment"]
    for user in users():
        assert redis_env[password_variable(user)].startswith("${" + password_variable(user) + ":?"), user
    assert services["ops"]["environment"]["RS_REDIS_USERNAME"] == "admin"


def test_no_service_user_has_admin_rights_or_every_key():
    for name, rules in users().items():
        if name == "admin":
            continue
        assert rules[:4] == ["resetkeys", "resetchannels", "-@all", "+@read"], name
        granted = {rule for rule in rules if rule.startswith("+")}
        assert not granted & {"+@all", "+@admin", "+@dangerous", "+@scripting", "+eval",
                              "+config", "+flushall"}
        assert not {"allkeys", "allcommands", "allchannels", "~*", "&*", "nopass"} & set(rules), name
        # passwords come from the environment
        assert not any(rule.startswith((">", "#")) for rule in rules), name


@pytest.fixture
def acl_users(machine_redis_url):
    """The file's service users on the machine's Redis under names of this test's own, with a password:
    service name -> (user name, client)."""
    client = redis.Redis.from_url(machine_redis_url)
    prefix = f"acltest-{uuid.uuid4().hex[:8]}-"
    created = {}
    try:
        for name, rules in users().items():
            if name != "admin":
                client.execute_command("ACL", "SETUSER", prefix + name, "on", ">pw", *rules)
                created[name] = (prefix + name,
                                 redis.Redis.from_url(machine_redis_url, username=prefix + name,
                                                      password="pw"))
        yield created
    finally:
        for user, _ in created.values():
            client.execute_command("ACL", "DELUSER", user)


DANGEROUS = [("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "SET", "appendonly", "no"), ("KEYS", "*"),
             ("DEBUG", "SLEEP", "0"), ("SHUTDOWN", "NOSAVE"), ("ACL", "SETUSER", "x"), ("MONITOR",),
             ("CLIENT", "KILL", "ID", "1"), ("CLIENT", "LIST"), ("EVAL", "return 1", "0"),
             ("FUNCTION", "FLUSH"), ("SAVE",), ("BGREWRITEAOF",),
             ("MIGRATE", "h", "1", "rs:x:prompts", "0", "1"),
             ("RESTORE", "rs:x:prompts", "0", "x"), ("SWAPDB", "0", "1"), ("REPLICAOF", "NO", "ONE"),
             ("SORT", "rs:x:admitted", "BY", "nosort", "STORE", "rs:x:prompts")]


def test_service_users_are_refused_every_dangerous_command(acl_users, machine_redis_url):
    admin = redis.Redis.from_url(machine_redis_url, decode_responses=True)
    for name, (user, _) in acl_users.items():
        for command in DANGEROUS:
            # ACL DRYRUN: asked without running it, so that a mistake here cannot shut the shared Redis down
            verdict = admin.execute_command("ACL", "DRYRUN", user, *command)
            assert verdict != "OK" and "no permissions" in verdict, (name, command, verdict)


def test_service_users_write_only_what_they_own(acl_users, run_id, machine_redis_url):
    from rollstream.shared.contract.bus import Keys

    keys = {stream: Keys(run_id).stream(stream) for stream in
            ("prompts", "trajectories", "grades", "rewards", "batches", "policy", "dead")}
    writes = {"dispatcher": {"prompts"}, "gateway": {"trajectories"},
              "agent-runner": {"prompts", "trajectories", "dead"},
              "sandbox-grader": {"trajectories", "grades", "dead"},
              "reward": {"trajectories", "grades", "dead", "rewards", "batches"},
              "trainer": {"batches", "dead", "policy"}, "recorder": set(keys), "vllm": set(),
              "console": set()}
    try:
        for name, (_, client) in acl_users.items():
            for stream, key in keys.items():
                assert client.xlen(key) >= 0  # everyone reads every stream of a run
                if stream in writes[name]:
                    client.xadd(key, {"by": name})
                else:
                    with pytest.raises(redis.exceptions.NoPermissionError):
                        client.xadd(key, {"by": name})
            if name != "sandbox-grader":
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.get(f"rq:job:{run_id}")
    finally:
        redis.Redis.from_url(machine_redis_url).delete(*keys.values())


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_the_start_script_gives_each_user_its_password_and_keeps_the_passwords_off_disk(tmp_path):
    port = free_port()
    conf = tmp_path / "redis.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\nsave \"\"\ndir {tmp_path}\n")
    passwords = {password_variable(user): uuid.uuid4().hex for user in users()}
    env = {**os.environ, **passwords, "TMPDIR": str(tmp_path)}
    incomplete = {k: v for k, v in env.items() if k != password_variable("trainer")}
    refused = subprocess.run(["sh", str(REPO / "infra" / "redis-start.sh"), str(conf)], env=incomplete,
                             capture_output=True, text=True, timeout=30, check=False)
    assert refused.returncode != 0 and password_variable("trainer") + " is not set" in refused.stderr
    process = subprocess.Popen(["sh", str(REPO / "infra" / "redis-start.sh"), str(conf)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        anonymous = redis.Redis(port=port)
        deadline = time.monotonic() + 15
        while True:
            try:
                assert anonymous.ping()  # the healthcheck
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            anonymous.get("rs:x:admitted")
        for user in users():
            assert redis.Redis(port=port, username=user, password=passwords[password_variable(user)]).ping()
            # at once: redis-py retries it otherwise
            with pytest.raises(redis.exceptions.AuthenticationError):
                redis.Redis(port=port, username=user, password="wrong", retry=Retry(NoBackoff(), 0)).ping()
        admin = redis.Redis(port=port, username="admin", password=passwords[password_variable("admin")])
        environ = (Path("/proc") / str(admin.info("server")["process_id"]) / "environ").read_bytes()
        acl_text = b"".join(p.read_bytes() for p in tmp_path.glob("redis-users.*"))
        assert acl_text.count(b"\nuser ") == len(users())
        for password in passwords.values():
            assert password.encode() not in acl_text and password.encode() not in environ
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_gateway_user_can_keep_sessions_and_publish_their_samples(acl_users, run_id, machine_redis_url):
    """Everything the gateway does to Redis, as its own ACL user: a session, a turn, the finish."""
    from rollstream.services.gateway.samples import publish_samples
    from rollstream.services.gateway.sessions import ROOT, SessionSpec, SessionStore, TurnNode
    from rollstream.shared.contract.bus import Bus
    from rollstream.shared.contract.redis_round_trips import connect_round_trips

    user, client = acl_users["gateway"]
    bus = Bus(client, run_id)

    async def serve() -> None:  # its asyncio client and its bus's, as the gateway holds them, as its user
        parts = urlsplit(machine_redis_url)
        url = urlunsplit(parts._replace(netloc=f"{user}:pw@{parts.hostname}:{parts.port or 6379}"))
        store = SessionStore(bus, connect_round_trips(url, ride_out_outages=False), ttl_s=60,
                             finish_grace_s=60)
        try:
            session, _ = await store.create(SessionSpec(rollout_id="r", group_id="g", trajectory_id="r",
                                                        session_id="s"))
            node = TurnNode(ROOT, [1, 2], [3], [-0.1], 0, 0, "stop", "http://v", "x", 0.0)
            assert await store.add_turn("s", "k", node)
            assert (await store.get("s")).fleet_versions == {}  # reads the fleet's versions
            assert store.finish("s", lambda pipe, samples: publish_samples(
                bus, pipe, session, samples, status="completed", reward=1.0, response_text=None, artifacts={},
                error=None))
            assert not await store.delete("gone")
        finally:
            await store.aclose()

    try:
        asyncio.run(serve())
        assert len(bus.read_all("trajectories")) == 4  # started, turn, segment, finished
        # its scripts are loaded again into a Redis that restarted (the run above found them loaded, or not)
        admin = redis.Redis.from_url(machine_redis_url, decode_responses=True)
        assert admin.execute_command("ACL", "DRYRUN", user, "SCRIPT", "LOAD", "return 1") == "OK"
    finally:
        Bus(redis.Redis.from_url(machine_redis_url), run_id).delete_run()


def test_the_vllm_user_finds_the_newest_policy_joins_the_fleet_and_writes_nothing_else(
        acl_users, run_id, machine_redis_url, tmp_path):
    """What `rollstream serve-policy` does to Redis, as the compose vLLM server's own user: it reads the
    newest policy, and with fleet.registry records the version it serves and registers
    (vllm_fleet_member.py)."""
    from rollstream.cli.vllm_server import newest_policy
    from rollstream.shared.contract.bus import Bus
    from rollstream.shared.contract.events import PolicyUpdated
    from rollstream.shared.inference.fleet_registry import FleetMember, FleetRegistry
    from rollstream.shared.inference.vllm_fleet_member import join
    from rollstream.shared.runtime.config import Settings

    admin = Bus(redis.Redis.from_url(machine_redis_url), run_id)
    checkpoint = tmp_path / "v1"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    try:
        admin.publish("policy", PolicyUpdated(version=1, checkpoint_uri=str(checkpoint),
                                              batch_id="b-1", servers=[], parity_max_abs_diff=0.0, loss=0.0,
                                              trained_samples=1))
        admin.redis.sadd(admin.keys.trained_batches, "b-1")
        _, client = acl_users["vllm"]
        settings = Settings(run_id=run_id, storage_uri=str(tmp_path))
        assert newest_policy(Bus(client, run_id), settings) == (checkpoint, 1)
        registry = FleetRegistry(client, admin.keys, ttl_s=30)
        join(registry, FleetMember("http://vllm:8000", 1))
        registry.heartbeat(FleetMember("http://vllm:8000", 1))
        assert registry.members() == [FleetMember("http://vllm:8000", 1)] and admin.fleet_versions() == {
            "http://vllm:8000": 1}
        registry.deregister("http://vllm:8000")
        for forbidden in (admin.keys.trained_batches, admin.keys.admitted, admin.keys.state("trainer", "x")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.set(forbidden, 1)
    finally:
        admin.delete_run()


def test_the_sandbox_grader_user_can_make_the_runs_incarnation(acl_users, run_id, machine_redis_url):
    from rollstream.shared.contract.bus import Bus

    _, client = acl_users["sandbox-grader"]
    try:
        incarnation = Bus(client, run_id).incarnation()
        assert Bus(redis.Redis.from_url(machine_redis_url), run_id).incarnation() == incarnation
    finally:
        Bus(redis.Redis.from_url(machine_redis_url), run_id).delete_run()
