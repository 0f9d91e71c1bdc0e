"""One whole run as it is deployed (tests/integration/conftest.py deployed_run): vLLM on the CPU and every
service a process on the machine's Redis, each service its own ACL user (infra/redis-users.acl, the compose
deployment's rules), HTTP and metrics tokens on the services' routes."""

from __future__ import annotations

import asyncio
import uuid
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import redis

from rollstream.cli.local_run import LocalRun
from rollstream.shared.runtime.config import Settings
from tests.integration.prometheus import ask, dashboard_queries, prometheus_scraping, scrape_health
from tests.support import REPO

DEPLOYED_VERSIONS = 3
DEPLOYED_BATCH = 8
DEPLOYED_GROUP = 4
DEPLOYED_STALENESS = 1
HTTP_TOKEN = f"http-token-{uuid.uuid4().hex}"
METRICS_TOKEN = f"metrics-token-{uuid.uuid4().hex}"


@contextmanager
def run_as_deployed(root: Path, redis_url: str, model: Path) -> Iterator[dict]:
    """A whole run (vLLM on the CPU, every service a process) of 3 policy versions on the machine's Redis,
    each service as its own ACL user made from infra/redis-users.acl with its own password, the run itself as
    an admin user, HTTP tokens on the services' routes. Two malformed entries are written into it (prompts,
    batches). What it saw on the way is kept: the users connected, /healthz and /metrics with each token, what
    it printed, the sandbox jobs RQ held, the probe's logprobs from vLLM and from the trainer's
    checkpoints."""
    admin = redis.Redis.from_url(redis_url, decode_responses=True)
    prefix = f"deployed-{uuid.uuid4().hex[:8]}-"
    passwords = {name: uuid.uuid4().hex for name in service_users()}
    for name, rules in service_users().items():
        admin.execute_command("ACL", "SETUSER", prefix + name, "on", f">{passwords[name]}", *rules)
    run_id = f"deployed-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        run_id=run_id, redis_url=redis_url, redis_username=prefix + "admin",
        redis_password=passwords["admin"], storage_uri=str(root / "runs"), model={"path": model},
        data={"samples_per_prompt": DEPLOYED_GROUP, "synthetic_sandbox_every": 2},
        rollout={"max_tokens": 12, "concurrency": 8},
        train={"batch_size": DEPLOYED_BATCH, "total_versions": DEPLOYED_VERSIONS,
               "max_staleness": DEPLOYED_STALENESS, "learning_rate": 3e-3},
        bus={"reclaim_idle_ms": 5000}, security={"http_token": HTTP_TOKEN, "metrics_token": METRICS_TOKEN},
    )
    service_env = {name: {"RS_REDIS_USERNAME": prefix + name, "RS_REDIS_PASSWORD": passwords[name]}
                   for name in service_users() if name != "admin"}
    local = LocalRun(settings, service_env=service_env)
    printed: list[str] = []
    result = {"local": local, "prefix": prefix, "printed": printed, "model": model,
              "secrets": [*passwords.values(), HTTP_TOKEN, METRICS_TOKEN]}
    try:
        try:
            # scraping from the services' first seconds (outside the run's files, which must hold no secret:
            # it reads the metrics token from a file)
            with prometheus_scraping(local, root / "prometheus", METRICS_TOKEN) as prometheus:
                local.start(on_step=printed.append)
                watch_the_deployed_run(local, admin, prefix, result, prometheus)
        finally:
            result["exit_codes"] = local.stop()
        result["denied"] = [entry for entry in admin.acl_log(count=10_000)
                            if str(entry.get("username", "")).startswith(prefix)]
        yield result
        # as the run's own user: deleting the users first would leave its client retrying
        local.bus.delete_run()
    except BaseException:
        print(local.log_tails())
        raise
    finally:
        for name in service_users():
            admin.execute_command("ACL", "DELUSER", prefix + name)


def service_users() -> dict[str, list[str]]:
    """infra/redis-users.acl: user -> its rules."""
    out = {}
    for line in (REPO / "infra" / "redis-users.acl").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, *rules = line.split()
            out[name] = rules
    return out


def watch_the_deployed_run(local: LocalRun, admin: redis.Redis, prefix: str, result: dict,
                           prometheus: str | None) -> None:
    """prometheus: the URL of a Prometheus scraping the run (None where none is installed)."""
    result["connected_users"] = {c["user"] for c in admin.client_list() if c["user"].startswith(prefix)}
    result["metrics"] = {
        name: [httpx.get(f"http://127.0.0.1:{port}/metrics", headers=headers, timeout=5).status_code
               for headers in ({}, {"Authorization": f"Bearer {HTTP_TOKEN}"},
                               {"Authorization": f"Bearer {METRICS_TOKEN}"})]
        for name, port in local.health_ports.items()}
    result["healthz"] = {name: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code
                         for name, port in local.health_ports.items()}
    bus = local.bus
    # Malformed entries on two streams: they must be dead-lettered while the services keep going.
    bus.redis.xadd(bus.keys.stream("prompts"), {"type": "PromptIssued", "v": "1", "body": b"\x00garbage"})
    bus.redis.xadd(bus.keys.stream("batches"), {"type": "BatchReady", "v": "99", "body": b""})
    result["progress"] = local.wait_for_version(DEPLOYED_VERSIONS, timeout_s=600)
    result["exposition"] = {name: httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5,
                                            headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text
                            for name, port in local.health_ports.items()}
    result["prometheus"] = None if prometheus is None else {
        "targets": scrape_health(prometheus),
        "panels": {(title, query): ask(prometheus, query) for title, query in dashboard_queries()},
        "moved": {what: ask(prometheus, query) for what, query in RUN_MOVES.items()}}
    result["served"] = asyncio.run(probe_served_logprobs(local, result["model"]))
    result["rq_jobs"] = sandbox_jobs(bus.redis, local.settings.run_id)


RUN_MOVES = {
    "samples admitted": "sum(increase(rollstream_dispatcher_samples_admitted_total[10m]))",
    "episodes": "sum(increase(rollstream_agent_runner_episodes_total[10m]))",
    "batches": "sum(increase(rollstream_reward_batch_samples_count[10m]))",
    "policy version": "max(max_over_time(rollstream_trainer_policy_version[10m]) "
                      "- min_over_time(rollstream_trainer_policy_version[10m]))",
    "rewards": "sum(increase(rollstream_reward_value_count[10m]))",
}
"""How far the run's main series moved while Prometheus scraped it."""


def sandbox_jobs(client: redis.Redis, run_id: str) -> list[bytes]:
    """What Redis keeps of the run's sandbox jobs: each job's fields, its arguments decompressed."""
    out = []
    for key in client.scan_iter(match=f"rq:job:grade-{run_id}-*", count=1000):
        job = client.hgetall(key)
        data = job.get(b"data", b"")
        out.append(b" ".join(job.values()) + (zlib.decompress(data) if data else b""))
    return out


async def probe_served_logprobs(local: LocalRun, model: Path) -> dict:
    """vLLM's prompt logprobs on a probe, and the trainer's final checkpoint's own, computed here."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollstream.shared.inference.fleet import FleetClient

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids) + tokenizer.encode("42", add_special_tokens=False)
    url = local.settings.fleet.urls[0]
    fleet = FleetClient(local.settings.fleet.urls, model=local.settings.model.served_name)
    served = await fleet.prompt_logprobs(url, ids)
    await fleet.aclose()
    checkpoint = local.progress().updates[-1].checkpoint_uri

    def expected(path) -> list[float]:
        net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logp = torch.log_softmax(net(torch.tensor([ids])).logits[0, :-1].float(), -1)
        return logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()

    return {"served": served, "final": expected(checkpoint), "initial": expected(model)}
