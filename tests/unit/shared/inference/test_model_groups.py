"""A model group's servers are asked what they serve before their first call, as the fleet client asks the
policy's (GET /v1/models), against small real HTTP servers answering as vLLM does: a group setting that
disagrees with a server is an error that says how to fix it, and a server that does not say is passed over
until it does. Against real vLLM: tests/integration/test_vllm_fleet.py -k model_group.

    python -m pytest tests/unit/shared/inference/test_model_groups.py -q
"""

from __future__ import annotations

import pytest

from rollstream.shared.inference.fleet import FleetSettingsError
from rollstream.shared.inference.model_groups import ModelGroup
from rollstream.shared.runtime.config import ServerGroupSettings


def group(urls: list[str], **settings) -> ModelGroup:
    return ModelGroup("judge", ServerGroupSettings(urls=urls, **settings))


@pytest.mark.parametrize(("served", "settings", "said"), [
    ({"served_name": "tiny"}, {}, ["does not serve 'judge'", "fleet.groups.judge.served_name"]),
    ({"served_name": "judge", "max_model_len": 1024}, {"max_model_len": 4096},
     ["a context of 1024 tokens", "fleet.groups.judge.max_model_len, 4096", "--max-model-len 4096"]),
])
def test_a_group_setting_that_disagrees_with_a_server_is_an_error_saying_how_to_fix_it(
        servers, served, settings, said):
    server = servers(**served)
    with pytest.raises(FleetSettingsError) as info:
        group([server.url], **settings).chat([{"role": "user", "content": "?"}])
    for words in (server.url, *said):
        assert words in str(info.value), str(info.value)
    assert "/v1/chat/completions" not in server.requests


def test_a_server_that_does_not_say_what_it_serves_is_passed_over_until_it_does(servers):
    silent, answering = servers(served_name="judge"), servers(served_name="judge")
    silent.models_status = 503
    judge = group([silent.url, answering.url])
    answers = [judge.chat([{"role": "user", "content": "?"}]) for _ in range(4)]
    silent.models_status = 200
    answers += [judge.chat([{"role": "user", "content": "?"}]) for _ in range(2)]
    assert answers == ["yes"] * 6
    # each call starts at the next server: the silent one was asked at the first and the third (passed over
    # for the other), then said what it serves at the fifth, and answered it
    assert answering.requests == {"/v1/models": 1, "/v1/chat/completions": 5}  # read once, then trusted
    assert silent.requests == {"/v1/models": 3, "/v1/chat/completions": 1}
