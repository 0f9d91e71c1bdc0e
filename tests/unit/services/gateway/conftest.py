"""What the gateway's tests share: the served model's chat template, and the gateway's HTTP app over a
scripted fleet (scripted_app.py)."""

from __future__ import annotations

import pytest

from rollstream.services.gateway.prompts import ChatTemplate
from tests.unit.services.gateway.scripted_app import MODEL, gateway_apps


@pytest.fixture(scope="module")
def template():
    if not (MODEL / "tokenizer.json").exists():
        pytest.skip("the tiny model is built by make setup")
    from transformers import AutoTokenizer

    return ChatTemplate(AutoTokenizer.from_pretrained(MODEL))


@pytest.fixture
def gateway_app(bus, template, redis_url):
    """gateway_app(**settings) -> (client, fleet, store): scripted_app.gateway_apps."""
    with gateway_apps(bus, template, redis_url) as make:
        yield make
