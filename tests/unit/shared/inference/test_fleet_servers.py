"""What the fleet client reads of a server before its first turn (GET /v1/models: the model's name and context
length), against small real HTTP servers that answer as vLLM does: the server's context is what a turn is held
to, a setting that disagrees with a server is an error that says how to fix it, a server that does not answer
takes no turn until it does, and a group's servers are held to their smallest context. Against real vLLM:
tests/integration/test_vllm_fleet.py.

    python -m pytest tests/unit/shared/inference/test_fleet_servers.py -q
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from rollstream.shared.inference.fleet import FleetClient, FleetSettingsError, FleetUnavailable
from rollstream.shared.runtime.config import Settings
from tests.unit.shared.inference.served_models import VllmLikeServer


@pytest.fixture
def servers():
    """Makes servers answering as vLLM does (each stopped at the end)."""
    made: list[VllmLikeServer] = []

    def make(*args, **kwargs) -> VllmLikeServer:
        made.append(VllmLikeServer(*args, **kwargs))
        return made[-1]

    yield make
    for server in made:
        server.close()


def fleet_of(fleet_urls: list[str], **settings) -> FleetClient:
    return FleetClient.for_run(Settings(fleet={"urls": fleet_urls, **settings.pop("fleet", {})}, **settings),
                               cooldown_s=0.05)


def test_a_servers_own_longer_context_is_what_a_turn_is_held_to_read_once_before_its_first_turn(servers):
    server = servers(max_model_len=131072)

    async def go():
        async with fleet_of([server.url]) as fleet:  # model.max_model_len is 1024
            assert await fleet.meet_servers() == {}
            turns = [await fleet.complete(list(range(59000)), max_tokens=1, session_id=f"s{i}")
                     for i in range(3)]
            return fleet.contexts, fleet.servers.served[server.url], await fleet.longest_context(), turns

    contexts, served, longest, turns = asyncio.run(go())
    assert contexts == {server.url: 131072} and longest == 131072
    assert (served.name, served.root, served.max_model_len) == ("tiny", "/models/tiny", 131072)
    assert [turn.server_url for turn in turns] == [server.url] * 3
    assert server.requests == {"/v1/models": 1, "/v1/completions": 3}


def test_a_model_name_the_server_does_not_serve_is_an_error_that_says_how_to_fix_it(servers):
    server = servers(served_name="qwen3-8b")

    async def go():
        async with fleet_of([server.url]) as fleet:  # model.served_name is "tiny"
            with pytest.raises(FleetSettingsError) as info:
                await fleet.complete([1, 2], max_tokens=1, session_id="s")
            with pytest.raises(FleetSettingsError):  # and every turn after it, until the settings are fixed
                await fleet.longest_context()
            return str(info.value)

    message = asyncio.run(go())
    for said in (server.url, "'tiny'", "model.served_name", "it serves qwen3-8b", "--served-model-name tiny"):
        assert said in message, message
    assert "/v1/completions" not in server.requests


def test_a_context_setting_longer_than_the_servers_is_an_error_naming_the_server_and_the_setting(servers):
    short, long = servers(max_model_len=512), servers(max_model_len=4096)
    groups = {"long": {"policy": True, "urls": [long.url], "max_model_len": 8192}}

    async def go():
        async with fleet_of([short.url], fleet={"groups": groups}) as fleet:  # model.max_model_len is 1024
            with pytest.raises(FleetSettingsError) as info:
                await fleet.meet_servers()
            return str(info.value)

    message = asyncio.run(go())
    first, second = message.splitlines()
    for said in (short.url, "(fleet.urls)", "a context of 512 tokens", "model.max_model_len, 1024",
                 "set model.max_model_len to 512 or less", "--max-model-len 1024"):
        assert said in first, first
    for said in (long.url, "(fleet.groups.long)", "4096", "fleet.groups.long.max_model_len, 8192"):
        assert said in second, second


def test_a_server_that_does_not_say_what_it_serves_takes_no_turn_until_it_does(servers, caplog):
    answering, failing = servers(max_model_len=2048), servers(max_model_len=4096)
    failing.models_status = 503

    async def go():
        async with fleet_of([answering.url, failing.url]) as fleet:
            with caplog.at_level(logging.WARNING, logger="rollstream.shared.inference.fleet_servers"):
                not_met = await fleet.meet_servers()
            turns = {(await fleet.complete([1], max_tokens=1, session_id=f"s{i}")).server_url
                     for i in range(20)}
            turns_on_failing = failing.requests.get("/v1/completions", 0)
            before = await fleet.longest_context()
            failing.models_status = 200  # it answers once its cool-down is over
            await asyncio.sleep(0.06)
            await fleet.complete([1], max_tokens=1, session_id="s0")
            return not_met, (turns, turns_on_failing), before, await fleet.longest_context(), fleet.contexts

    not_met, (turns, turns_on_failing), before, after, contexts = asyncio.run(go())
    assert list(not_met) == [failing.url]
    assert "answered GET /v1/models with HTTP 503" in not_met[failing.url]
    said = [record for record in caplog.records if "did not say what it serves" in record.getMessage()]
    assert [record.server for record in said] == [failing.url]  # once, not at every turn meanwhile
    assert turns == {answering.url} and turns_on_failing == 0
    assert (before, after) == (2048, 2048)  # the two are one group: held to the smaller
    assert contexts == {answering.url: 2048, failing.url: 2048}


def test_no_server_that_said_what_it_serves_is_fleet_unavailable_saying_why(servers):
    down = servers()
    down.close()  # nothing listens there
    without_context = servers()
    del without_context.models["data"][0]["max_model_len"]

    async def go():
        async with fleet_of([down.url, without_context.url]) as fleet:
            with pytest.raises(FleetUnavailable) as turn:
                await fleet.complete([1], max_tokens=1, session_id="s")
            with pytest.raises(FleetUnavailable):
                await fleet.longest_context()
            return str(turn.value)

    message = asyncio.run(go())
    assert f"{down.url} did not answer GET /v1/models: ConnectError" in message
    assert f"{without_context.url} does not report the context length of 'tiny'" in message


def test_a_groups_servers_are_held_to_their_smallest_context_and_a_long_turn_goes_to_a_longer_group(
        servers, caplog):
    a, b, long = servers(max_model_len=2048), servers(max_model_len=4096), servers(max_model_len=8192)
    groups = {"long": {"policy": True, "urls": [long.url], "max_model_len": 8192}}

    async def go():
        async with fleet_of([a.url, b.url], fleet={"groups": groups}) as fleet:
            with caplog.at_level(logging.WARNING, logger="rollstream.shared.inference.fleet_servers"):
                await fleet.meet_servers()
            # 3000 tokens would fit b, but not a, which may take a turn of b's sessions over
            turns = {(await fleet.complete(list(range(3000)), max_tokens=8, session_id=f"s{i}")).server_url
                     for i in range(10)}
            return fleet.contexts, await fleet.longest_context(), turns

    contexts, longest, turns = asyncio.run(go())
    assert contexts == {a.url: 2048, b.url: 2048, long.url: 8192} and longest == 8192
    assert turns == {long.url}
    (warning,) = [record.getMessage() for record in caplog.records]
    assert "fleet.urls report different context lengths" in warning and "2048" in warning


def test_a_lora_adapters_context_is_its_base_models(servers):
    server = servers(max_model_len=4096)
    adapter = {"id": "math-lora", "object": "model", "root": "/adapters/math", "parent": "tiny",
               "max_model_len": None}
    server.models["data"].append(adapter)

    async def go():
        async with fleet_of([server.url], model={"served_name": "math-lora"}) as fleet:
            await fleet.meet_servers()
            return fleet.servers.served[server.url]

    served = asyncio.run(go())
    assert (served.name, served.root, served.max_model_len) == ("math-lora", "/adapters/math", 4096)
