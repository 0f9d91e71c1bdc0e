"""The gateway's start (main.serve) reads what each vLLM server serves before its first turn, against small
real HTTP servers answering /v1/models as vLLM does, with real Redis and the tiny model's tokenizer: a
server's own context is what the turns are held to, and a setting that disagrees with a server stops the
start with an error that names the server, the setting and the fix. The turns held to that context:
test_gateway_app.py; against real vLLM: tests/integration/test_gateway.py.

    python -m pytest tests/unit/services/gateway/test_gateway_start.py -q
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollstream.services.gateway.main import load_gateway, meet_the_fleet, serve
from rollstream.shared.inference.fleet import FleetSettingsError
from rollstream.shared.runtime.config import Settings
from tests.unit.shared.inference.served_models import VllmLikeServer

MODEL = Path(__file__).resolve().parents[4] / "models" / "tiny-llama-warm"
pytestmark = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(),
                                reason="the tiny model is built by make setup")


@pytest.fixture
def vllm_like():
    servers: list[VllmLikeServer] = []

    def make(**kwargs) -> VllmLikeServer:
        servers.append(VllmLikeServer(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def runtime() -> SimpleNamespace:
    return SimpleNamespace(status={}, log=logging.getLogger("gateway-test"), stopping=False,
                           not_ready="starting")


def settings_for(redis_url: str, run_id: str, urls: list[str], **model) -> Settings:
    return Settings(run_id=run_id, redis_url=redis_url, model={"path": str(MODEL), **model},
                    fleet={"urls": urls})


def test_the_gateway_starts_with_the_context_each_server_reports(redis_url, run_id, vllm_like):
    long, down = vllm_like(max_model_len=131072), vllm_like()
    down.models_status = 503
    started = runtime()

    async def go():
        gateway = load_gateway(settings_for(redis_url, run_id, [long.url, down.url]))  # max_model_len: 1024
        try:
            await meet_the_fleet(gateway, started)
            return await gateway.fleet.longest_context()
        finally:
            await gateway.fleet.aclose()
            await gateway.store.aclose()

    assert asyncio.run(go()) == 131072
    assert started.status["vllm_contexts"] == {long.url: 131072}  # the one that did not answer: none


@pytest.mark.parametrize(("served", "setting", "said"), [
    ({"served_name": "qwen3-8b"}, {},
     ["does not serve 'tiny'", "model.served_name", "--served-model-name tiny"]),
    ({"max_model_len": 512}, {"max_model_len": 2048},
     ["a context of 512 tokens", "model.max_model_len, 2048", "set model.max_model_len to 512 or less"]),
])
def test_a_setting_that_disagrees_with_a_server_stops_the_start_saying_how_to_fix_it(
        redis_url, run_id, vllm_like, served, setting, said):
    server = vllm_like(**served)
    started = runtime()
    with pytest.raises(FleetSettingsError) as info:
        asyncio.run(serve(settings_for(redis_url, run_id, [server.url], **setting), started))
    for words in (server.url, *said):
        assert words in str(info.value), str(info.value)
    assert "/v1/completions" not in server.requests and started.not_ready == "starting"
