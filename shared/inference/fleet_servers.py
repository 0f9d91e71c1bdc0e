"""The fleet's servers: the group each belongs to, what each serves (read from its /v1/models when the fleet
client first meets it), the context a turn may use there, and whether it is in its unhealthy cool-down.

A server says what it serves on GET /v1/models (vLLM 0.32: one card per served name, `id` the name requests
ask for, `root` the model directory, `max_model_len` the context it was started with; a LoRA adapter's card
names its base model's card as its `parent`). That, not a setting, is what a turn is held to:

- a setting that disagrees with a server is a FleetSettingsError, which names the server, what it reports,
  the setting and how to fix it: a model name (model.served_name) it does not serve, or a context length
  (model.max_model_len, a policy group's max_model_len) longer than the one it reports. A server that
  reports a longer context than the setting is taken at its word (the setting is what `rollstream run`
  starts its own servers with; a server started elsewhere knows its own).
- a server that does not answer /v1/models (or answers it without its model's context) is the machinery
  failure it is: it is put in its cool-down, takes no turn, and is asked again once the cool-down is over;
  its context is never assumed.
- servers of one group (fleet.urls, a policy group) that report different contexts are held to the
  smallest: the servers of a group are interchangeable, and a session's turn fails over from one to another
  in the middle of a generation, so a turn the group takes must fit every server of it. (An error would stop
  a run for a difference that only costs context; a warning names the servers.)

Library module, not run directly (FleetClient.meet_servers uses it):
    python -m pytest tests/unit/shared/inference/test_fleet_servers.py -q
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from rollstream.shared.errors import RollstreamError

if TYPE_CHECKING:
    from rollstream.shared.inference.fleet_registry import FleetMember
    from rollstream.shared.runtime.config import Settings

MODELS_TIMEOUT_S = 5.0
log = logging.getLogger(__name__)


class FleetSettingsError(RollstreamError, ValueError):
    """A server of the fleet disagrees with the settings: it does not serve the configured model name, or
    reports a shorter context than the configured one. The message says which server, what it reports,
    which setting, and how to fix it."""


class ServerNotMet(RollstreamError, RuntimeError):
    """A server did not say what it serves: /v1/models did not answer, or answered without a usable card."""


@dataclass(frozen=True)
class ServerGroup:
    """Servers that serve alike, as the settings list them: a session's turns may go to any of them."""

    name: str
    """Where the settings list them, for messages: "fleet.urls", "fleet.groups.long"."""
    urls: tuple[str, ...]
    max_model_len: int | None = None
    """The context length the settings give them: a server reporting a shorter one is a FleetSettingsError.
    None: whatever they report."""
    max_model_len_setting: str = "max_model_len"
    """The setting max_model_len comes from, for messages."""


@dataclass(frozen=True)
class ServedModel:
    """The model a server serves the fleet's requests with, as its /v1/models card says."""

    name: str
    root: str
    max_model_len: int


def policy_server_groups(settings: Settings) -> list[ServerGroup]:
    """The run's listed policy servers by group, each with the context its settings give it: fleet.urls (with
    model.max_model_len), then each policy group of fleet.groups with servers."""
    groups = policy_groups(settings)
    listed = {name: group.urls for name, group in settings.fleet.groups.items()}
    listed[None] = settings.fleet.urls
    return [dataclasses.replace(group, urls=tuple(url.rstrip("/") for url in listed[name]))
            for name, group in groups.items() if listed[name]]


def policy_groups(settings: Settings) -> dict[str | None, ServerGroup]:
    """Each group of policy servers by the name a registered server gives it (FleetMember.group: None for
    the policy's main servers, fleet.urls'; a policy group's name of fleet.groups), with the context its
    settings give it and no servers yet."""
    groups = {None: ServerGroup("fleet.urls", (), settings.model.max_model_len, "model.max_model_len")}
    for name, group in settings.fleet.groups.items():
        if group.policy:
            groups[name] = ServerGroup(f"fleet.groups.{name}", (), group.max_model_len,
                                       f"fleet.groups.{name}.max_model_len")
    return groups


async def read_served_model(http: httpx.AsyncClient, url: str, model: str | None,
                            model_setting: str) -> ServedModel:
    """What `url` serves `model` as (None: its base model, which vLLM uses for a request naming none).
    ServerNotMet when it does not say; FleetSettingsError when it does not serve `model`."""
    try:
        response = await http.get(f"{url}/v1/models", timeout=MODELS_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise ServerNotMet(f"{url} did not answer GET /v1/models: {type(exc).__name__}: {exc}") from exc
    return served_model(model_cards(response, url), url, model, model_setting)


def model_cards(response: httpx.Response, url: str) -> dict[str, dict[str, Any]]:
    """The model cards of a GET /v1/models answer, by name; ServerNotMet when it holds none."""
    if response.status_code != 200:
        raise ServerNotMet(f"{url} answered GET /v1/models with HTTP {response.status_code}: "
                           f"{response.text[:300]}")
    try:
        return {str(card["id"]): card for card in response.json()["data"] if isinstance(card, dict)}
    except (ValueError, KeyError, TypeError) as exc:
        raise ServerNotMet(f"{url} answered GET /v1/models with no list of models: "
                           f"{response.text[:300]}") from exc


def served_model(cards: dict[str, dict[str, Any]], url: str, model: str | None,
                 model_setting: str) -> ServedModel:
    """The card of `model` among a server's cards (by name), its context from its own card or, for a LoRA
    adapter, its base model's."""
    bases = [name for name, card in cards.items() if not card.get("parent")]
    if not bases:
        raise ServerNotMet(f"{url} lists no model on GET /v1/models: {list(cards)}")
    name = bases[0] if model is None else model
    if name not in cards:
        raise FleetSettingsError(
            f"{url} does not serve {name!r}, which {model_setting} names: it serves "
            f"{', '.join(cards)} (GET {url}/v1/models). Set {model_setting} to the name it serves, or start "
            f"the server with --served-model-name {name}")
    card = cards[name]
    length = card.get("max_model_len") or cards.get(str(card.get("parent")), {}).get("max_model_len")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ServerNotMet(f"{url} does not report the context length of {name!r} on GET /v1/models "
                           f"(max_model_len: {length!r}); the fleet takes each server's context from there")
    return ServedModel(name=name, root=str(card.get("root") or ""), max_model_len=length)


def check_context(url: str, group: ServerGroup, served: ServedModel) -> None:
    """FleetSettingsError when the context `url` reports is shorter than its group's setting."""
    setting = group.max_model_len
    if setting is not None and setting > served.max_model_len:
        raise FleetSettingsError(
            f"{url} ({group.name}) serves {served.name!r} with a context of {served.max_model_len} "
            f"tokens (its --max-model-len), shorter than {group.max_model_len_setting}, {setting}: set "
            f"{group.max_model_len_setting} to {served.max_model_len} or less, or start the server with "
            f"--max-model-len {setting}")
    if setting is not None and setting < served.max_model_len:
        log.info("a vLLM server holds a longer context than its setting; its turns may use it",
                 extra={"server": url, "max_model_len": served.max_model_len,
                        "setting": f"{group.max_model_len_setting}={setting}"})


class FleetServers:
    """The fleet's servers by group, what each serves once met, the context a turn may use on it (its
    group's smallest), and each one's unhealthy cool-down. Servers join and leave (`join`, `leave`) when the
    fleet follows a registry (fleet_registry.py); a group is known by its name."""

    def __init__(self, groups: Sequence[ServerGroup], cooldown_s: float) -> None:
        self.group_of = {url: group for group in groups for url in group.urls}
        self.cooldown_s = cooldown_s
        self.served: dict[str, ServedModel] = {}
        """Each server met so far: what its /v1/models says it serves."""
        self.contexts: dict[str, int] = {}
        """Each server met so far: the context a turn may use on it, its group's smallest."""
        self.not_met: dict[str, str] = dict.fromkeys(self.group_of, "not asked yet")
        """Each server not met yet: why (it did not answer /v1/models, ...)."""
        self.longest_context: int | None = None
        """The longest context of a server met so far; None before one is."""
        self._unhealthy_until = dict.fromkeys(self.group_of, 0.0)
        self._refused: dict[str, str] = {}
        """Each registered server left out of the fleet: why (FleetServers.follow)."""

    # -- health -------------------------------------------------------------------------------------
    def is_healthy(self, url: str) -> bool:
        return url in self.group_of and time.monotonic() >= self._unhealthy_until[url]

    def mark_unhealthy(self, url: str, cooldown_s: float | None = None) -> None:
        if url in self.group_of:  # not one that left the fleet while a request was on it
            cooldown = self.cooldown_s if cooldown_s is None else cooldown_s
            self._unhealthy_until[url] = time.monotonic() + cooldown

    def mark_healthy(self, url: str) -> None:
        if url in self.group_of:
            self._unhealthy_until[url] = 0.0

    # -- membership ---------------------------------------------------------------------------------
    def to_meet(self) -> list[str]:
        """The servers not met yet that are not cooling down: those to ask what they serve now."""
        return [url for url in self.not_met if self.is_healthy(url)]

    def did_not_answer(self, url: str, why: str) -> None:
        """`url` did not say what it serves: it takes no turn, and is asked again after its cool-down."""
        if self.not_met.get(url) != why:
            log.warning("a vLLM server did not say what it serves; it takes no turn until it does",
                        extra={"server": url, "error": why})
        self.not_met[url] = why
        self.mark_unhealthy(url)

    def meet(self, url: str, served: ServedModel) -> None:
        """Records what `url` serves, once it agrees with its group's setting; FleetSettingsError if not."""
        group = self.group_of[url]
        check_context(url, group, served)
        self.served[url] = served
        self.not_met.pop(url, None)
        self._hold_group_to_its_smallest_context(group)

    def follow(self, members: Sequence[FleetMember], listed: Collection[str],
               groups: Mapping[str | None, ServerGroup]) -> tuple[list[str], list[str]]:
        """The servers become those `listed` and the registered `members` (fleet_registry.py), each member in
        the group of `groups` it names; returns the servers that joined and those that left. A member naming a
        group that is not there, or refused (`refuse`), is left out until it registers anew."""
        registered = {member.url: member for member in members if member.url not in listed}
        for url in [url for url in self._refused if url not in registered]:
            del self._refused[url]  # it left: it may come back as it should be
        left = [url for url in self.group_of if url not in listed and url not in registered]
        for url in left:
            self.leave(url)
            log.info("a policy server left the fleet", extra={"server": url})
        joined = []
        for url, member in registered.items():
            group = groups.get(member.group)
            if url in self._refused or url in self.group_of:
                continue
            if group is None:
                self.refuse(url, f"{url} registered in the policy group {member.group!r}, which fleet.groups "
                                 "does not have as a policy group")
                continue
            self.join(url, group)
            joined.append(url)
            log.info("a policy server joined the fleet",
                     extra={"server": url, "group": group.name, "version": member.version})
        return joined, left

    def refuse(self, url: str, why: str) -> None:
        """A registered server is left out of the fleet (it takes no turn and is not synced) until it leaves
        the registry and registers anew: its settings are not the run's."""
        log.error(f"a registered policy server is left out of the fleet: {why}", extra={"server": url})
        self._refused[url] = why
        if url in self.group_of:
            self.leave(url)

    def join(self, url: str, group: ServerGroup) -> None:
        """`url` joins the fleet in `group` (a registered server): it is met before its first turn."""
        if url in self.group_of:
            raise ValueError(f"{url} is in the fleet already")
        self.group_of[url] = group
        self.not_met[url] = "not asked yet"
        self._unhealthy_until[url] = 0.0

    def leave(self, url: str) -> None:
        """`url` leaves the fleet; its group is held to the smallest context of the servers it still has."""
        group = self.group_of.pop(url)
        for record in (self.served, self.contexts, self.not_met, self._unhealthy_until):
            record.pop(url, None)
        self._hold_group_to_its_smallest_context(group)

    def _hold_group_to_its_smallest_context(self, group: ServerGroup) -> None:
        members = [url for url, its_group in self.group_of.items() if its_group.name == group.name]
        reported = {url: self.served[url].max_model_len for url in members if url in self.served}
        self.longest_context = max(self.contexts.values(), default=None)
        if not reported:
            return
        smallest = min(reported.values())
        if len(set(reported.values())) > 1:
            log.warning(f"the servers of {group.name} report different context lengths: each of its turns is "
                        f"held to the smallest, {smallest} tokens, so that any of them can take a session's "
                        "turn over", extra={"contexts": reported})
        for url in reported:
            self.contexts[url] = smallest
        self.longest_context = max(self.contexts.values())
