"""The simulated vLLM fleet (bench/sim_fleet.py): it answers the API
rollstream.shared.inference.fleet.FleetClient uses the way vLLM does, and counts the busy time of its
work; the metering proxy (bench/metered_proxy.py) counts a real server's alike.

    python -m pytest tests/unit/bench/test_sim_fleet.py -q
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from bench.sim_fleet import SimFleet, parse_metrics
from bench.sim_latency import LatencyModel
from rollstream.shared.inference.fleet import FleetClient, FleetRequestError

FAST = LatencyModel(prefill_s_per_token=0.0, decode_s_per_token=0.001, overhead_s=0.0, batch_size=8,
                    reload_s=0.0)


# -------------------------------------------------------------------------------- the HTTP API
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model):
    from rollstream.cli.model.tiny_model import build_tiny_model

    return tiny_model, build_tiny_model(tmp_path_factory.mktemp("sim") / "v1", seed=1)


@pytest.fixture(scope="module")
def fleet(checkpoints):
    with SimFleet(checkpoints[0], 3, latency=FAST) as sim:
        yield sim


def run(coro):
    return asyncio.run(coro)


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics").text)


def test_health_and_models(fleet):
    for url in fleet.urls:
        assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{fleet.urls[0]}/v1/models").json()["data"][0]["id"] == "tiny"


def test_completion_returns_the_requested_token_ids_with_logprobs(fleet):
    async def go():
        async with FleetClient(fleet.urls, model="tiny") as client:
            return await client.complete([1, 40, 41, 42], max_tokens=37, session_id="s1",
                                         extra={"ignore_eos": True})

    completion = run(go())
    assert len(completion.token_ids) == len(completion.logprobs) == 37
    assert completion.finish_reason == "length"
    assert all(0 <= t < 352 for t in completion.token_ids)
    assert all(-20 < lp <= 0 for lp in completion.logprobs)
    assert completion.server_url in fleet.urls


def test_banned_tokens_are_never_sampled_and_a_stop_token_ends_the_completion(fleet):
    allowed = {50, 51}
    bias = {str(i): -100 for i in range(352) if i not in allowed}

    async def go():
        async with FleetClient(fleet.urls, model="tiny") as client:
            free = await client.complete([1, 2, 3], max_tokens=64, session_id="s2",
                                         extra={"logit_bias": bias, "ignore_eos": True})
            stopped = await client.complete([1, 2, 3], max_tokens=200, session_id="s2", stop_token_ids=[51],
                                            extra={"logit_bias": bias})
            return free, stopped

    free, stopped = run(go())
    assert set(free.token_ids) <= allowed and len(free.token_ids) == 64
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids[-1] == 51 and 51 not in stopped.token_ids[:-1]


def test_requests_vllm_rejects_are_rejected(fleet):
    async def go(**kwargs):
        async with FleetClient(fleet.urls, **kwargs) as client:
            return await client.complete([5] * 1000, max_tokens=64, session_id="long")

    with pytest.raises(FleetRequestError, match="maximum context length"):
        run(go(model="tiny"))
    # (the fleet client finds a model the server does not serve on its /v1/models, before a request)
    unserved = httpx.post(f"{fleet.urls[0]}/v1/completions", json={"model": "not-served", "prompt": [5],
                                                                    "max_tokens": 1})
    assert unserved.status_code == 404, unserved.text


def test_prompt_logprobs_follow_the_reloaded_checkpoint(fleet, checkpoints):
    import torch
    from transformers import AutoModelForCausalLM

    probe = [1, 40, 41, 42, 7, 99, 120, 3, 45, 46, 200]

    def expected(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([probe])).logits[0].float(), dim=-1)
        return [logp[i - 1, probe[i]].item() for i in range(1, len(probe))]

    url = fleet.urls[1]

    async def go():
        async with FleetClient(fleet.urls, model="tiny") as client:
            before = await client.prompt_logprobs(url, probe)
            await client.reload_weights(url, str(checkpoints[1]))
            after = await client.prompt_logprobs(url, probe)
            await client.reload_weights(url, str(checkpoints[0]))
            return before, after

    before, after = run(go())
    v0, v1 = expected(checkpoints[0]), expected(checkpoints[1])
    assert max(abs(a - b) for a, b in zip(before, v0, strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(after, v1, strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(v0, v1)) > 1e-2  # the two checkpoints really differ


def test_a_failed_reload_is_a_500_and_keeps_the_old_weights(fleet, tmp_path):
    url = fleet.urls[2]
    response = httpx.post(f"{url}/collective_rpc",
                          json={"method": "reload_weights",
                                "kwargs": {"weights_path": str(tmp_path / "none")}})
    assert response.status_code == 500
    assert "no HF checkpoint" in response.text


def test_pause_keep_freezes_in_flight_requests_until_resume(checkpoints):
    # 2 s of work: on a loaded machine the poll below can stall for a few tenths of a second, and a request
    # that finished unseen would leave it nothing to pause
    slow = LatencyModel(prefill_s_per_token=0.0, decode_s_per_token=0.05, overhead_s=0.0, batch_size=8,
                        reload_s=0.0)
    with SimFleet(checkpoints[0], 1, latency=slow) as sim:
        url = sim.urls[0]

        async def go():
            async with FleetClient(sim.urls, model="tiny") as client:
                request = asyncio.create_task(client.complete([1, 2, 3], max_tokens=40, session_id="p",
                                                              extra={"ignore_eos": True}))
                while metrics(url)["vllm:num_requests_running"] < 1:
                    assert not request.done(), "the request finished before the poll saw it running"
                    await asyncio.sleep(0.01)
                assert (await client._http.post(f"{url}/pause", params={"mode": "keep"})).status_code == 200
                busy = metrics(url)["sim:busy_seconds_total"]
                await asyncio.sleep(0.5)  # a running request would have decoded 10 tokens by now
                frozen = metrics(url)
                assert not request.done()
                assert frozen["sim:busy_seconds_total"] == busy
                assert frozen["vllm:num_requests_waiting"] == 1
                assert httpx.get(f"{url}/is_paused").json() == {"is_paused": True}
                assert (await client._http.post(f"{url}/resume")).status_code == 200
                return await request

        completion = run(go())
        assert len(completion.token_ids) == 40
        assert metrics(url)["vllm:num_requests_running"] == 0


def test_busy_time_and_counters_account_for_the_work_done(checkpoints):
    model = LatencyModel(prefill_s_per_token=0.0, decode_s_per_token=0.002, overhead_s=0.0, batch_size=2,
                         reload_s=0.0)
    with SimFleet(checkpoints[0], 1, latency=model) as sim:
        url = sim.urls[0]

        async def go():
            async with FleetClient(sim.urls, model="tiny") as client:
                # four at once on a batch of two: 50 tokens x 2 ms each, at half speed
                await asyncio.gather(*(client.complete([1, 2, 3], max_tokens=50, session_id=f"b{i}",
                                                       extra={"ignore_eos": True}) for i in range(4)))
                await asyncio.sleep(0.3)  # idle time must not count

        run(go())
        values = metrics(url)
        assert values["vllm:generation_tokens_total"] == 200
        assert values["vllm:request_success_total"] == 4
        # requests can arrive spread out, so the busy time is at least the shared work and the running
        # integral is exactly the sum of the requests' time in the server, each at least its own work
        assert 0.2 - 1e-6 <= values["sim:busy_seconds_total"] < values["sim:uptime_seconds"] - 0.3
        assert values["sim:running_seconds_total"] >= 4 * 0.1 - 1e-6
        assert values["sim:running_seconds_total"] <= 4 * values["sim:busy_seconds_total"]


def test_a_sessions_next_turn_hits_the_prefix_cache(fleet):
    url = fleet.urls[0]
    body = {"model": "tiny", "prompt": [1, 40, 41, 42, 43], "max_tokens": 5, "return_token_ids": True,
            "logprobs": 0, "ignore_eos": True}
    headers = {"X-Session-ID": "cache-me"}
    first = httpx.post(f"{url}/v1/completions", json=body, headers=headers).json()
    turn = body["prompt"] + first["choices"][0]["token_ids"] + [9, 10]
    second = httpx.post(f"{url}/v1/completions", json={**body, "prompt": turn}, headers=headers).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 10
    assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200
    third = httpx.post(f"{url}/v1/completions", json={**body, "prompt": turn}, headers=headers).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_many_servers_share_one_process_and_each_counts_its_own(checkpoints):
    with SimFleet(checkpoints[0], 16, latency=FAST) as sim:
        async def go():
            async with FleetClient(sim.urls, model="tiny") as client:
                await asyncio.gather(*(client.complete([1, 2, 3], max_tokens=4, session_id=f"m{i}",
                                                       extra={"ignore_eos": True}) for i in range(64)))

        run(go())
        served = [metrics(url)["vllm:request_success_total"] for url in sim.urls]
        assert sum(served) == 64
        assert sum(1 for n in served if n > 0) >= 8  # rendezvous routing spreads sessions over the fleet


# ------------------------------------------------------------------ metering a real server's busy time
def test_in_flight_meter_counts_time_with_a_request_in_flight_and_not_paused():
    from bench.metered_proxy import InFlightMeter

    meter = InFlightMeter(now=0.0)
    meter.enter(1.0)
    meter.enter(2.0)
    meter.leave(3.0)
    meter.pause(4.0)
    meter.resume(10.0)
    meter.leave(11.0)
    meter.advance(20.0)
    assert meter.busy_s == pytest.approx(1.0 + 1.0 + 1.0 + 1.0)  # 1-4 and 10-11
    assert meter.running_s == pytest.approx(1.0 + 2.0 + 1.0 + 1.0)


def test_metered_proxy_forwards_the_fleet_api_and_meters_busy_time(checkpoints):
    from bench.metered_proxy import MeteredProxy

    model = LatencyModel(prefill_s_per_token=0.0, decode_s_per_token=0.002, overhead_s=0.0, batch_size=8,
                         reload_s=0.0)
    with SimFleet(checkpoints[0], 1, latency=model) as sim, MeteredProxy(sim.urls[0]) as proxy:
        url = proxy.urls[0]

        async def go():
            async with FleetClient([url], model="tiny") as client:
                completion = await client.complete([1, 2, 3], max_tokens=50, session_id="x",
                                                   extra={"ignore_eos": True})
                await client.reload_weights(url, str(checkpoints[1]))
                probe = await client.prompt_logprobs(url, [1, 40, 41, 42])
                return completion, probe

        completion, probe = run(go())
        assert len(completion.token_ids) == 50 and completion.server_url == url
        assert len(probe) == 3
        metered = parse_metrics(httpx.get(f"{url}/meter/metrics").text)
        served = metrics(url)  # forwarded: the server's own /metrics
        assert served["sim:weight_reloads_total"] == 1
        assert metered["sim:in_flight_requests"] == 0
        # seen from in front, a request is in flight at least as long as the server works on it
        assert metered["sim:busy_seconds_total"] >= served["sim:busy_seconds_total"] - 1e-6
        assert metered["sim:busy_seconds_total"] < metered["sim:uptime_seconds"]


# --------------------------------------------------------------- the bench's heavy-tailed agent on it
def test_heavy_tail_lengths_are_seeded_per_sample_with_a_long_tail():
    import statistics

    from bench.heavy_tail_agent import TailParams, episode_turns

    params = TailParams(seed=3)
    turns = [episode_turns(i, params) for i in range(4000)]
    assert turns == [episode_turns(i, TailParams(seed=3)) for i in range(4000)]
    assert turns != [episode_turns(i, TailParams(seed=4)) for i in range(4000)]
    assert statistics.median(turns) == 2
    long = [t for t in turns if t >= 20]
    assert 0.03 < len(long) / len(turns) < 0.07
    assert max(long) <= 100


def test_heavy_tail_agent_makes_token_exact_segments_through_the_fleet(fleet):
    from transformers import AutoTokenizer

    from bench.heavy_tail_agent import TailParams, episode_turns, heavy_tail_agent
    from rollstream.shared.agent.loop import AgentContext, Limits, Task
    from rollstream.shared.agent.tool_calls import get_format
    from rollstream.shared.agent.tools import Episode, ToolSet

    tokenizer = AutoTokenizer.from_pretrained(fleet.model_path)
    index = next(i for i in range(1000) if episode_turns(i, TailParams()) >= 40)
    drawn = episode_turns(index, TailParams())
    limits = Limits(max_turns=1000, max_tokens_per_turn=16, max_total_tokens=512)
    rollout = f"run-r{index:07d}"

    async def go():
        async with FleetClient(fleet.urls, model="tiny") as client:
            episode = Episode(episode_id=rollout, run_id="run", metadata={}, storage_uri="/tmp")
            ctx = AgentContext(fleet=client, tokenizer=tokenizer, tools=ToolSet([]),
                               tool_format=get_format("hermes"), limits=limits, episode=episode,
                               session_id=rollout)
            task = Task(messages=[{"role": "user", "content": "What is 2 + 3?"}], label="5")
            return await heavy_tail_agent(task, ctx)

    segments = run(go())
    assert len(segments) > 1  # the context was compacted
    assert sum(len(s.turns) for s in segments) == drawn
    for position, segment in enumerate(segments):
        assert len(segment.tokens) <= limits.max_total_tokens
        assert len(segment.loss_mask) == len(segment.rollout_logprobs) == len(segment.tokens)
        sampled = [t for t, m in zip(segment.tokens, segment.loss_mask) if m]
        assert sampled == [t for turn in segment.turns for t in turn.response_ids]
        assert all(len(turn.response_ids) == 16 and turn.segment_index == position for turn in segment.turns)
        for turn in segment.turns:
            assert segment.tokens[turn.offset:turn.offset + 16] == turn.response_ids
            # a turn event holds its logprobs as float32, as the wire carries them
            expected = np.float32(segment.rollout_logprobs[turn.offset:turn.offset + 16]).tolist()
            assert expected == turn.logprobs
    assert segments[-1].status == "completed"
