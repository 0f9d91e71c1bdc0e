"""A collective weight sync against real vLLM CPU servers: the trainer's side (CollectiveTransport) and
rollstream's engine inside vLLM (shared/inference/vllm_weight_engine.py) over gloo, whole and as deltas.

The package's two tiny-model servers (vllm_pair) join one group; the weights change between versions the way
a test can know exactly, and every server must serve the trainer's logprobs after every version. The servers
serve the tiny model again at the end (a disk reload), as the other modules expect.

    python -m pytest tests/integration/test_collective_weight_sync.py -q
"""

from __future__ import annotations

import asyncio

import pytest

from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.inference.serving_weights import write_serving_checkpoint
from rollstream.shared.inference.weight_sync import sync_weights
from rollstream.shared.inference.weight_transport import (
    CollectiveTransport,
    DiskTransport,
    WeightUpdate,
)
from tests.support import reload_weights, revive

pytestmark = pytest.mark.integration

PROBE = list(range(1, 48))
TOLERANCE = 1e-3
"""The trainer's parity tolerance (train.parity_tolerance)."""


def trainer_logprobs(model) -> list[float]:
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROBE])).logits[0].float(), dim=-1)
    return [logp[i - 1, PROBE[i]].item() for i in range(1, len(PROBE))]


@pytest.fixture(scope="module")
def servers(vllm_pair, tiny_model):
    urls = [server.url for server in revive(vllm_pair)]
    yield urls
    reload_weights([server.url for server in revive(vllm_pair)], tiny_model)


@pytest.fixture
def model(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def push(urls, transport, model, version, checkpoint=None):
    """One version to every server: (each server's parity gap, the push's report, each server's logprobs)."""
    async def go():
        async with FleetClient(urls, model="tiny") as fleet:
            update = WeightUpdate(version, checkpoint=checkpoint, weights=lambda: model.state_dict().items())
            diffs, report = await sync_weights(fleet, transport, update, PROBE, trainer_logprobs(model))
            served = {url: await fleet.prompt_logprobs(url, PROBE) for url in urls}
            return diffs, report, served

    return asyncio.run(go())


def nudge(model, seed: int) -> None:
    """Every weight moves, as after an optimizer step."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)


def test_every_server_serves_each_version_broadcast_whole_then_as_a_delta_of_what_changed(
        servers, model, tmp_path):
    import torch

    transport = CollectiveTransport("gloo", "127.0.0.1", delta=True, bucket_bytes=256 << 10, timeout_s=60)
    model_bytes = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    try:
        nudge(model, 1)
        diffs, report, _ = push(servers, transport, model, 1)
        assert report.kind == "full" and report.loaded == servers
        assert report.bytes_sent == model_bytes  # every tensor, in buckets of 256 KiB
        assert report.changed_fraction is None  # nothing to compare with yet
        assert max(diffs.values()) < TOLERANCE

        nudge(model, 2)  # every element changed: a delta would be larger than the model
        diffs, report, _ = push(servers, transport, model, 2)
        assert report.kind == "full" and report.changed_fraction > 0.99
        assert max(diffs.values()) < TOLERANCE

        # a step that changes a known part: 5 rows of one layer's MLP and one element of the embeddings
        down = model.model.layers[1].mlp.down_proj.weight
        with torch.no_grad():
            down[:5] += 0.05
            model.model.embed_tokens.weight[7, 3] += 0.5
        changed = 5 * down.shape[1] + 1
        elements = sum(tensor.numel() for tensor in model.state_dict().values())
        diffs, report, by_delta = push(servers, transport, model, 3)
        assert report.kind == "delta"
        assert report.bytes_sent == changed * (4 + 4)  # an int32 index and a float32 value per element
        assert report.changed_fraction == pytest.approx(changed / elements)
        assert max(diffs.values()) < TOLERANCE

        # what a full reload of the same weights serves, exactly
        checkpoint = write_serving_checkpoint(model, tmp_path / "v3")
        _, report, by_disk = push(servers, DiskTransport(2), model, 3, checkpoint=checkpoint)
        assert report.kind == "disk"
        assert by_delta == by_disk
    finally:
        transport.close()


def test_a_new_group_starts_whole_and_a_server_that_cannot_join_fails_the_push_for_itself(servers, model):
    transport = CollectiveTransport("gloo", "127.0.0.1", delta=True, bucket_bytes=1 << 20, timeout_s=20)
    try:
        nudge(model, 3)
        diffs, report, _ = push(servers, transport, model, 1)
        assert report.kind == "full" and max(diffs.values()) < TOLERANCE

        nudge(model, 4)
        gone = "http://127.0.0.1:9"  # nothing listens: it cannot be told to join
        report = asyncio.run(_push_report(servers + [gone], transport, model, 2))
        assert set(report.failures) == {*servers, gone}
        assert report.failures[gone] is not None

        # the next push re-forms the group of the servers that answer, and sends the whole model
        diffs, report, _ = push(servers, transport, model, 2)
        assert report.kind == "full" and report.loaded == servers
        assert max(diffs.values()) < TOLERANCE
    finally:
        transport.close()


async def _push_report(urls, transport, model, version):
    async with FleetClient(urls, model="tiny") as fleet:
        return await transport.push(fleet, urls,
                                    WeightUpdate(version, weights=lambda: model.state_dict().items()))
