"""Model groups: models served beside the policy (a judge, a reward model), addressed by name, never
weight-synced (fleet.groups in the settings).

A reward function (reward.function, `module:function`) asks one like this:

    from rollstream.shared.inference.model_groups import model_group

    def judged(response: str, label: str | None) -> float:
        question = f"Is {response!r} the answer to {label!r}? yes or no"
        verdict = model_group("judge").chat([{"role": "user", "content": question}], max_tokens=4)
        return 1.0 if verdict.strip().lower().startswith("yes") else 0.0

The group's servers are asked through their OpenAI-compatible Chat Completions, each call starting at the
next server in turn; one that does not answer, or answers 5xx, is passed over for the next. Before its first
call a server is asked what it serves (GET /v1/models, as the fleet client asks the policy's servers:
fleet_servers.py): a group's served_name it does not serve, or a max_model_len longer than its context, is a
FleetSettingsError that says how to fix it; one that does not say is passed over, and asked again at the
next call. When none answers, ModelGroupUnavailable: a reward function lets it through, and the reward
service then leaves the event pending and tries again (bus.max_deliveries times, then the rollout is
dropped with the error as its cause). A judge that cannot be reached never scores a rollout 0. An answer the
group refused (4xx: a bad request) is ModelGroupRequestError.

    python -m pytest tests/integration/test_vllm_fleet.py -q -k model_group
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import Any

import httpx

from rollstream.shared.errors import RollstreamError
from rollstream.shared.inference.fleet_servers import (
    MODELS_TIMEOUT_S,
    ServerGroup,
    ServerNotMet,
    check_context,
    model_cards,
    served_model,
)
from rollstream.shared.runtime.config import ServerGroupSettings, Settings


class ModelGroupUnavailable(RollstreamError, RuntimeError):
    """No server of the model group answered."""


class ModelGroupRequestError(RollstreamError, RuntimeError):
    """A server of the model group refused the request (4xx), or its answer has no text."""


class ModelGroup:
    """A client of one model group's servers; safe to share between threads."""

    def __init__(self, name: str, group: ServerGroupSettings) -> None:
        if not group.urls:
            raise ValueError(f"model group {name!r} has no servers: set fleet.groups.{name}.urls "
                             "(a local run starts them)")
        self.name = name
        self.served_name = group.served_name or name
        self.urls = [url.rstrip("/") for url in group.urls]
        self.servers = ServerGroup(f"fleet.groups.{name}", tuple(self.urls), group.max_model_len,
                                   f"fleet.groups.{name}.max_model_len")
        self.client = httpx.Client(timeout=group.request_timeout_s)
        self._next_first = itertools.count()  # next() on it is one C call: atomic between threads
        self._met: set[str] = set()
        """The servers that said what they serve, and agree with the group's settings."""

    def chat(self, messages: list[dict[str, Any]], *, max_tokens: int = 256, temperature: float = 0.0,
             **sampling: Any) -> str:
        """The text of the model's answer to `messages` (Chat Completions; `sampling`: further fields such as
        seed, top_p, stop)."""
        body = {"model": self.served_name, "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature, **sampling}
        answer = self._post("/v1/chat/completions", body)
        try:
            return answer["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise ModelGroupRequestError(f"model group {self.name!r} answered without a message: "
                                         f"{str(answer)[:300]}") from None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        first = next(self._next_first) % len(self.urls)
        failures = []
        for url in self.urls[first:] + self.urls[:first]:
            try:
                if url not in self._met:
                    self._meet(url)
                response = self.client.post(url + path, json=body)
            except ServerNotMet as exc:
                failures.append(str(exc))
                continue
            except httpx.HTTPError as exc:
                failures.append(f"{url}: {type(exc).__name__}: {exc}")
                continue
            if response.status_code >= 500:
                failures.append(f"{url}: HTTP {response.status_code}: {response.text[:200]}")
                continue
            if response.status_code >= 400:
                raise ModelGroupRequestError(f"model group {self.name!r} refused the request at {url} "
                                             f"(HTTP {response.status_code}): {response.text[:500]}")
            return response.json()
        raise ModelGroupUnavailable(f"no server of model group {self.name!r} answered: "
                                    + "; ".join(failures))


    def _meet(self, url: str) -> None:
        """Reads what `url` serves; FleetSettingsError when it disagrees with the group's settings,
        ServerNotMet when it does not say."""
        try:
            response = self.client.get(url + "/v1/models", timeout=MODELS_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise ServerNotMet(f"{url} did not answer GET /v1/models: {type(exc).__name__}: {exc}") from exc
        served = served_model(model_cards(response, url), url, self.served_name,
                              f"fleet.groups.{self.name}.served_name")
        check_context(url, self.servers, served)
        self._met.add(url)


_groups: dict[str, ModelGroup] = {}
_groups_lock = threading.Lock()


@functools.cache
def _settings() -> Settings:
    return Settings()


def model_group(name: str, settings: Settings | None = None) -> ModelGroup:
    """The client of the model group `name` of the run's settings (the service's own, read once, unless
    `settings` is given); one per name and process."""
    with _groups_lock:
        if name not in _groups:
            groups = (settings or _settings()).fleet.groups
            if name not in groups or groups[name].policy:
                known = ", ".join(sorted(key for key, group in groups.items() if not group.policy))
                raise ValueError(f"no model group {name!r} in fleet.groups (its model groups, not the "
                                 f"policy's: {known or 'none'})")
            _groups[name] = ModelGroup(name, groups[name])
        return _groups[name]
