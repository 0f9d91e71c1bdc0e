"""A disk weight sync of the whole fleet (rollstream.shared.inference.weight_sync) on simulated vLLM servers
(bench/sim_fleet.py), which load real checkpoints and answer prompt logprobs with a real forward pass."""

from __future__ import annotations

import asyncio
import functools

import httpx
import pytest

from bench.sim_fleet import LatencyModel, SimFleet
from rollstream.shared.errors import WeightSyncError
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.inference.weight_sync import sync_weights
from rollstream.shared.inference.weight_transport import DiskTransport, WeightUpdate

SERVERS = 6
PROBE = [1, 40, 41, 42, 7, 99, 120, 3]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model):
    from rollstream.cli.model.tiny_model import build_tiny_model

    return tiny_model, build_tiny_model(tmp_path_factory.mktemp("sync") / "v1", seed=1)


@pytest.fixture(scope="module")
def fleet(checkpoints):
    with SimFleet(checkpoints[0], SERVERS, latency=LatencyModel(reload_s=0.05)) as sim:
        yield sim


@functools.cache
def expected_logprobs(path) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROBE])).logits[0].float(), dim=-1)
    return [logp[i - 1, PROBE[i]].item() for i in range(1, len(PROBE))]


class CountingFleet(FleetClient):
    """Counts the reloads under way at once."""

    def __init__(self, urls):
        super().__init__(urls, model="tiny")
        self.loading, self.most_at_once = 0, 0

    async def reload_weights(self, url: str, weights_dir: str) -> None:
        self.loading += 1
        self.most_at_once = max(self.most_at_once, self.loading)
        try:
            await super().reload_weights(url, weights_dir)
        finally:
            self.loading -= 1


def sync(fleet, weights_dir, expected, concurrency) -> tuple[dict[str, float], int]:
    async def go():
        async with CountingFleet(fleet.urls) as client:
            diffs, report = await sync_weights(client, DiskTransport(concurrency),
                                               WeightUpdate(1, checkpoint=weights_dir), PROBE, expected)
            assert report.kind == "disk" and report.loaded == client.urls and set(diffs) == set(client.urls)
            return diffs, client.most_at_once

    return asyncio.run(go())


@pytest.mark.parametrize("concurrency", [1, 4, SERVERS])
def test_every_server_serves_the_new_weights_with_at_most_the_concurrency_loading_at_once(
        fleet, checkpoints, concurrency):
    base, new = checkpoints
    try:
        diffs, most_at_once = sync(fleet, new, expected_logprobs(new), concurrency)
        assert set(diffs) == set(fleet.urls)
        assert max(diffs.values()) < 1e-5
        assert most_at_once == concurrency
    finally:
        sync(fleet, base, expected_logprobs(base), SERVERS)


def test_a_server_that_cannot_load_is_left_out_of_the_sync_and_the_others_are_synced_and_resumed(
        fleet, checkpoints, tmp_path):
    base, new = checkpoints
    broken = fleet.urls[2]

    async def go():
        async with FleetClient(fleet.urls, model="tiny") as client:
            healthy = [url for url in fleet.urls if url != broken]
            client.urls = [broken, *healthy]  # the broken one first: its failure must not stop the others
            missing = tmp_path / "missing"
            original = client.reload_weights

            async def reload(url, weights_dir):
                await original(url, str(missing) if url == broken else weights_dir)

            client.reload_weights = reload
            update, expected = WeightUpdate(1, checkpoint=new), expected_logprobs(new)
            diffs, report = await sync_weights(client, DiskTransport(2), update, PROBE, expected)
            assert isinstance(report.failures[broken], WeightSyncError)
            assert "reload_weights failed" in str(report.failures[broken])
            assert set(diffs) == set(healthy) == set(report.loaded)
            return {url: await client.prompt_logprobs(url, PROBE) for url in healthy}

    try:
        served = asyncio.run(go())
        expected = expected_logprobs(new)
        for url, logprobs in served.items():
            assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-5, url
            assert httpx.get(f"{url}/is_paused").json()["is_paused"] is False
    finally:
        sync(fleet, base, expected_logprobs(base), SERVERS)
