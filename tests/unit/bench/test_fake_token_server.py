"""bench/fake_token_server.py answers in the shapes the fleet client reads from vLLM: whole and streamed
completions with their ids and logprobs, /health, /metrics (the load the client routes by) and /v1/models; and
a chat completion for a proxy in front of it.

    python -m pytest tests/unit/bench/test_fake_token_server.py -q
"""

from __future__ import annotations

import asyncio

import httpx

from bench.fake_token_server import LOGPROB, FakeTokenServer
from rollstream.shared.inference.fleet import FleetClient

URL = "http://fake"
IDS = [11, 12, 13]


def fake() -> FakeTokenServer:
    return FakeTokenServer(IDS, "The end.", "tiny", 1024)


def test_the_fleet_client_reads_whole_and_streamed_answers_and_the_load():
    async def scenario():
        async with FleetClient([URL], model="tiny", transport=httpx.ASGITransport(app=fake())) as fleet:
            whole = await fleet.complete([1, 2], max_tokens=8, session_id="s")
            assert (whole.token_ids, whole.logprobs, whole.finish_reason) == (IDS, [LOGPROB] * 3, "stop")
            cut = await fleet.complete([1, 2], max_tokens=2, session_id="s")
            assert (cut.token_ids, cut.finish_reason) == (IDS[:2], "length")
            deltas = [d async for d in fleet.stream([1, 2], max_tokens=7, session_id="s",
                                                    extra={"ignore_eos": True})]
            assert [t for d in deltas for t in d.token_ids] == [11, 12, 13, 11, 12, 13, 11]
            assert [d.finish_reason for d in deltas] == [None] * 6 + ["length"]
            assert all(d.logprobs == [LOGPROB] for d in deltas)
            assert await fleet.health(URL)
            loads = await fleet.refresh_load()
            assert (loads[URL].running, loads[URL].waiting, loads[URL].kv_cache_usage) == (0, 0, 0.0)

    asyncio.run(scenario())


def test_models_and_a_chat_completion_for_a_proxy():
    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fake()), base_url=URL) as client:
            models = (await client.get("/v1/models")).json()
            assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("tiny", 1024)]
            chat = await client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                "ignore_eos": True})
            assert chat.json()["choices"][0]["message"] == {"role": "assistant", "content": "The end."}
            assert chat.json()["usage"]["completion_tokens"] == 5
            assert (await client.post("/v1/completions", content=b"{")).status_code == 400
            assert (await client.get("/v1/nothing")).status_code == 404

    asyncio.run(scenario())
