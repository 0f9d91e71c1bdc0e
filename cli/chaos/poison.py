"""Poison entries for every stream of a run, injected into a live run while it trains, and an audit of
what became of them.

    rollstream chaos poison --seed 7 --rate 4 --versions 3     # a local run, fuzzed; prints the figures

`poison_plan` (cli/chaos/poison_make.py) makes, deterministically per seed, entries of every kind below
for every stream (`STREAM_KINDS` says which kinds a stream gets); `fuzz` writes them into a started
`LocalRun` at a rate while it trains (cli/chaos/poison_inject.py), lets the run reach its target version
and handle everything, and `audit` (cli/chaos/poison_report.py) reads back what the run did with each
entry; `run_poison` starts the local run around it (as `rollstream run` does) and stops it after.

    random_bytes     fields of random bytes, or a known type with a random body
    truncated        a valid event's body cut short
    mutated          a valid event's body with bytes flipped, until it no longer decodes
    malformed        no type, no body, a body that is a list, a string, a map with integer keys, no
                     payload, a type that is not UTF-8
    unknown_version  a known type at a schema version this code does not read, or an unknown type
    wrong_types      a valid event with one payload field of the wrong type
    invalid_payload  a valid envelope whose payload breaks the contract: misaligned token arrays,
                     negative or zero counts, NaN scores, unknown or missing fields
    oversized        a random body of a few MB
    huge_tokens      a well-formed segment of 10^6 tokens (trajectories); a prompt of a few MB of text
                     (prompts)
    foreign_event    a valid event of a type that belongs on another stream
    unknown_agent    a prompt naming an agent loop that does not exist
    missing_file     valid events pointing at files that do not exist: a coding prompt's repository, a
                     rollout's diff artifact, a batch file, a checkpoint
    replayed_batch   a real batch file announced again under another batch id
    untrainable_rows a batch file whose rows no model can train on: token ids outside any vocabulary,
                     longer than any model's positions, a NaN advantage, a policy version from the future
    forged           valid events of prompts, rollouts, grades, rewards, batches and policy versions
                     the dispatcher, the agent-runner, the reward service or the trainer never made
    orphan_finish    (off by default: STALLING_KINDS) a finished rollout of a group of one whose
                     segment never comes: the reward service seals its group and holds back every
                     group after it until reward.grade_timeout_s

What each must come to (`Poison.must_dead_letter`): an entry that cannot be handled, on a stream read
through consumer groups, is dead-lettered once per group, with its error; a rollout whose diff
artifact is missing gets its verdict (GradingFailed) instead, so that its group is not held back; the
trainer leaves out every untrainable row and goes on; a forged entry must never become a training
sample (counted: forged rollouts in batches, and trained).
Streams that no group reads keep their poison; readers pass over it, and the recorder archives it.
Around all of it, every service stays up and healthy (no process exits: the local run's supervisor
records every exit it sees, one it restarted and one during the drain included, and every process is
checked once more at the end), the run reaches its target version, and every sample the dispatcher
admitted is in exactly one batch the trainer trained, each of its segments in one row, as the audit of
any run counts it (cli/chaos/audit.py).

    python -m pytest tests/integration/test_poison.py -q
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import httpx

from rollstream.cli.chaos.audit import RowLimits
from rollstream.cli.chaos.poison_inject import Injected, PoisonError, inject_at_rate
from rollstream.cli.chaos.poison_make import HUGE_TOKENS, OVERSIZED_BYTES, Poison, poison_plan
from rollstream.cli.chaos.poison_report import PoisonReport, audit, trainer_version
from rollstream.shared.contract.archive import archived_id, parse_id
from rollstream.shared.contract.bus import Bus, StreamName
from rollstream.shared.runtime.storage import Storage

HEALTH_EVERY_S = 2.0


def health_states(local) -> tuple[dict[str, str], dict[str, dict]]:
    """Process -> 'ok' or what is wrong; and each /healthz body that answered."""
    states, bodies = {}, {}
    for name, process in local.processes.items():
        code = process.poll()
        if code is not None:
            states[name] = f"exited with code {code}"
            continue
        try:
            response = httpx.get(f"http://127.0.0.1:{local.health_ports[name]}/healthz", timeout=2)
        except (httpx.HTTPError, KeyError) as exc:
            states[name] = f"/healthz did not answer: {exc}"
            continue
        try:
            bodies[name] = response.json()
        except ValueError:
            bodies[name] = {}
        states[name] = ("ok" if response.status_code == 200
                        else f"/healthz {response.status_code}: {response.text[:200]}")
    return states, bodies



class HealthWatch:
    """Looks at the run every HEALTH_EVERY_S while it is fuzzed: notes each /healthz that answered anything
    but 200 and the highest policy version the dispatcher reported, and supervises the local run."""

    def __init__(self, local, started: float) -> None:
        self.local = local
        self.started = started
        self.unhealthy: list[str] = []
        self.dispatcher_version = 0
        self.next_look = time.monotonic()

    def look(self, now: bool = False) -> None:
        """Look if it is time to (or `now`)."""
        if not now and time.monotonic() < self.next_look:
            return
        self.next_look = time.monotonic() + HEALTH_EVERY_S
        states, bodies = health_states(self.local)
        at = f"{time.monotonic() - self.started:.0f}s"
        self.unhealthy.extend(f"{at} {name}: {state}" for name, state in states.items() if state != "ok")
        self.dispatcher_version = max(self.dispatcher_version,
                                      int(bodies.get("dispatcher", {}).get("policy_version") or 0))
        self.local.check_alive()


def wait_archived(bus: Bus, injected: list[Injected], timeout_s: float) -> None:
    """Until the recorder's archived position of every stream is past the last entry injected there."""
    last: dict[StreamName, str] = {}
    for item in injected:
        last[item.poison.stream] = item.entry_id
    deadline = time.monotonic() + timeout_s
    while True:
        behind = [s for s, entry_id in last.items()
                  if (archived := archived_id(bus, s)) is None or parse_id(archived) < parse_id(entry_id)]
        if not behind:
            return
        if time.monotonic() > deadline:
            raise PoisonError(f"the recorder has not archived the poison of {', '.join(behind)} "
                              f"after {timeout_s:.0f}s")
        time.sleep(0.5)



def fuzz(local, plan: list[Poison], *, seed: int, rate: float, target_version: int, timeout_s: float,
         drain_timeout_s: float = 300.0,
         on_progress: Callable[[str], None] = lambda message: None) -> PoisonReport:
    """Inject `plan` into the started LocalRun at `rate` entries a second while it trains, then wait
    until the trainer reaches `target_version`, every consumer has handled everything and the recorder
    has archived it; check every service's health all along, and audit."""
    bus, settings = local.bus, local.settings
    started = time.monotonic()
    watch = HealthWatch(local, started)
    injected = inject_at_rate(bus, Storage(settings.storage_uri), plan, rate, started=started,
                              timeout_s=timeout_s, between=watch.look)
    injected_ids = {(item.poison.stream, item.entry_id) for item in injected}
    on_progress(f"{len(injected)} poison entries injected; waiting for version {target_version}")
    while (version := trainer_version(bus, settings.storage_uri, injected_ids)) < target_version:
        if time.monotonic() > started + timeout_s:
            raise PoisonError(f"policy version {version} after {timeout_s:.0f}s, wanted {target_version}")
        watch.look()
        time.sleep(1.0)
    on_progress("target version reached; waiting until every entry is handled")
    local.wait_drained(timeout_s=drain_timeout_s)
    wait_archived(bus, injected, timeout_s=max(30.0, 3 * settings.recorder.flush_s))
    watch.look(now=True)
    health, _ = health_states(local)
    report = audit(bus, settings.storage_uri, injected, seed=seed, rate=rate, target_version=target_version,
                   health=health, unhealthy_moments=watch.unhealthy,
                   dispatcher_version_seen=watch.dispatcher_version,
                   max_staleness=settings.train.max_staleness, limits=RowLimits.of_model(settings.model.path),
                   sandbox_queue=settings.grader.queue)
    local.check_alive()  # an exit after the last look counts as much as one while the run went on
    report.unexpected_exits = local.unexpected_exits()
    report.seconds = time.monotonic() - started
    return report


def run_poison(settings, *, seed: int, rate: float, timeout_s: float, per_kind: int = 1,
               kinds: Iterable[str] | None = None, oversized_bytes: int = OVERSIZED_BYTES,
               huge_tokens: int = HUGE_TOKENS, fleet_urls: list[str] | None = None,
               on_progress: Callable[[str], None] = lambda message: None):
    """Start a local run with `settings`, fuzz it with the seed's plan, stop it. Returns the report
    and the services' exit codes."""
    from rollstream.cli.local_run import LocalRun

    local = LocalRun(settings, fleet_urls=fleet_urls)
    codes: dict[str, int | None] = {}
    try:
        local.start(on_step=on_progress)
        plan = poison_plan(seed, local.settings.run_id, local.settings.storage_uri, per_kind=per_kind,
                           kinds=kinds, oversized_bytes=oversized_bytes, huge_tokens=huge_tokens)
        on_progress(f"services up; injecting {len(plan)} poison entries at {rate:g}/s "
                    f"(logs in {local.log_dir})")
        report = fuzz(local, plan, seed=seed, rate=rate, target_version=local.settings.train.total_versions,
                      timeout_s=timeout_s, on_progress=on_progress)
    finally:
        codes = local.stop()  # whatever of the run started: Redis, vLLM, server groups, services
    return report, codes, local
