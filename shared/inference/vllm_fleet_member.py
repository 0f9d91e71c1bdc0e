"""rollstream's fleet registration inside a vLLM server: with fleet.registry, the server joins the run's fleet
once it answers /health and stays a member while it lives (shared/inference/fleet_registry.py).

vLLM runs `register` in each of its processes (the `vllm.general_plugins` entry point
rollstream_fleet_member in pyproject.toml). It acts only in the API server's own process, not in the engine
core and workers that vLLM starts through multiprocessing (those have a parent process), and only when the
launcher asked for it: MEMBER_VARIABLE holds the member to register as ({"url", "version", "group"}: the URL
the other services reach the server at, the policy version it loads, its policy group); the run's settings
(its id, Redis, fleet.member_ttl_s) come from RS_* as in every rollstream process. `rollstream serve-policy`
sets it when fleet.registry is on (cli/vllm_server.py: VllmServer.join_fleet, exec_newest_policy).

A daemon thread then waits until /health answers 200 at the member's url (vLLM answers once its weights are
loaded, and serves that version from its first request), records the version the server serves
(run_facts.FLEET_VERSIONS; before it registers, so that a client that finds the server finds its version too),
registers, and renews the registration every third of fleet.member_ttl_s until the process ends. An exit
that runs Python's exit handlers (SIGTERM: vLLM shuts down) deregisters it at once; after a SIGKILL its
registration lapses. Nothing here touches the model: the weight-transfer engine is vllm_weight_engine.py's.

Runs in vLLM's API server, not in rollstream's services.
    python -m pytest tests/integration/test_fleet_registry.py -q
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import sys
import threading
import time

import httpx

from rollstream.shared.contract.roles import served_versions
from rollstream.shared.contract.run_facts import FLEET_VERSIONS
from rollstream.shared.inference.fleet_registry import FleetMember, FleetRegistry

MEMBER_VARIABLE = "ROLLSTREAM_FLEET_MEMBER"
"""The environment variable of the member a vLLM server registers as (JSON); unset: it registers nothing."""
HEALTH_POLL_S = 0.5
DEREGISTER_WAIT_S = 5.0
"""The longest an exiting server waits for Redis to take its deregistration (Redis may be away)."""

_started = False


def member_environment(member: FleetMember) -> dict[str, str]:
    """What a launcher adds to a vLLM server's environment for it to register as `member`."""
    fields = {"url": member.url, "version": member.version, "group": member.group,
              "adapters": dict(member.adapters)}
    return {MEMBER_VARIABLE: json.dumps(fields)}


def member_from_environment(value: str) -> FleetMember:
    """The member MEMBER_VARIABLE names; ValueError that says what is wrong with it."""
    try:
        fields = json.loads(value)
        return FleetMember(fields["url"], fields["version"], fields.get("group"),
                           tuple(sorted((fields.get("adapters") or {}).items())))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{MEMBER_VARIABLE}={value!r} is not the JSON of a fleet member "
                         f'({{"url": "http://host:port", "version": N, "group": null}}): {exc}') from exc


def register() -> None:
    """vLLM's general-plugin hook: in the API server of a server asked to register, start its membership."""
    global _started
    value = os.environ.get(MEMBER_VARIABLE)
    if not value or _started or multiprocessing.parent_process() is not None:
        return
    _started = True
    from rollstream.shared.runtime.config import Settings

    # a member or settings that are wrong stop the server's start here, saying why
    member = member_from_environment(value)
    registry = FleetRegistry.for_run(Settings())
    threading.Thread(target=keep_membership, args=(registry, member), daemon=True,
                     name="rollstream-fleet-member").start()


def keep_membership(registry: FleetRegistry, member: FleetMember) -> None:
    """Once the server answers /health: its version recorded, registered, renewed until the process ends. A
    write Redis refuses (NOPERM: a user without the rights) does not mend itself: it is said once, and tried
    again at every beat."""
    wait_until_healthy(member.url)
    registered, failing = False, None
    while True:
        try:
            if registered:
                registry.heartbeat(member)
            else:
                join(registry, member)
                atexit.register(deregister, registry, member.url)
                registered = True
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            if error != failing:
                say("the server could not register in the run's fleet", url=member.url, error=error)
            failing = error
        else:
            failing = None
        time.sleep(registry.heartbeat_s)


def join(registry: FleetRegistry, member: FleetMember) -> None:
    """The versions `member` serves recorded (the policy's, and each adapter's it started with), then `member`
    registered."""
    served = served_versions(member.url, member.version, dict(member.adapters))
    registry.redis.hset(FLEET_VERSIONS.key(registry.keys), mapping=served)
    registry.register(member)
    say("registered in the run's fleet", run_id=registry.keys.run_id, url=member.url, version=member.version,
        group=member.group)


def wait_until_healthy(url: str) -> None:
    with httpx.Client(timeout=5.0) as client:
        while True:
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL_S)


def deregister(registry: FleetRegistry, url: str) -> None:
    """At exit: leave the fleet now rather than when the registration lapses, unless Redis does not answer
    within DEREGISTER_WAIT_S (the exit does not wait longer for it)."""
    left = threading.Event()

    def leave() -> None:
        try:
            registry.deregister(url)
        except Exception as exc:
            say("could not leave the run's fleet: its registration lapses instead", url=url,
                error=f"{type(exc).__name__}: {exc}")
        else:
            left.set()

    threading.Thread(target=leave, daemon=True).start()
    if left.wait(DEREGISTER_WAIT_S):
        say("left the run's fleet", url=url)


def say(message: str, **fields: object) -> None:
    """A line of the server's log (stderr, as the launcher's own): vLLM leaves other loggers unconfigured."""
    print(json.dumps({"message": message, **fields}), file=sys.stderr, flush=True)
