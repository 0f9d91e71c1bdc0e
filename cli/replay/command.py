"""`rollstream replay`: a recorded run re-published into a fresh run, with the services that should
handle it again started beside it.

    rollstream replay RUN --to RUN2 --streams trajectories,grades --services reward
        # re-score: identical rewards, advantages and batches (same code), or new ones (new code)
    rollstream replay RUN --to RUN3 --streams trajectories --finished-only --services sandbox-grader,reward
        # re-grade finished rollouts with a fixed grader, then re-score; no agent-runner, no vLLM
    RS_REWARD__FUNCTION=mypkg.rewards:strict rollstream replay RUN --to RUN4 --streams trajectories \\
        --finished-only --services reward      # re-score with a new reward function
    rollstream replay RUN --to RUN5 --streams batches --services trainer   # reproduce the trainer's steps

The whole selection is read and decoded before anything is written, so a damaged archive fails with
the file and entry named and leaves the target untouched. With --services, the command waits until
they have handled everything (no backlog, no stream growing), stops them, and prints what the
replay produced; the target run is left in Redis and storage for `rollstream inspect`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from rollstream.cli.replay.plan import (
    DEFAULT_STREAMS,
    Pace,
    ReplayError,
    ReplayPlan,
    check_fresh,
    publish,
)
from rollstream.shared.contract.bus import STREAMS, Bus
from rollstream.shared.runtime.config import Settings, redact_url

console = Console()
REPLAY_SERVICES = ("agent-runner", "sandbox-grader", "reward", "trainer")
"""What may run against a replay; the dispatcher never does: the replay is the source of prompts."""


@dataclass
class ReplayResult:
    target_run: str
    published: dict[str, int]
    produced: dict[str, int] = field(default_factory=dict)
    """Entries the services added to each stream of the target."""
    services: tuple[str, ...] = ()
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    undecodable_dead: int = 0
    """Entries of `dead` that do not decode, replayed as they are (ReplayPlan.undecodable_dead)."""


def replay_run(settings: Settings, source_run: str, *, streams: tuple[str, ...] = DEFAULT_STREAMS,
               finished_only: bool = False, skip_dead_lettered: bool = False, pace: Pace = Pace(None),
               source: str = "auto", source_redis_url: str | None = None, services: tuple[str, ...] = (),
               timeout_s: float = 1800.0, quiet_s: float = 3.0, on_step=lambda message: None) -> ReplayResult:
    """Replay `source_run` into `settings.run_id`; see the module docstring."""
    from rollstream.cli.local_run import LocalRun

    bad = [s for s in services if s not in REPLAY_SERVICES]
    if bad:
        raise ValueError(f"cannot run {', '.join(bad)} in a replay; choose from {', '.join(REPLAY_SERVICES)}")
    if settings.run_id == source_run:
        raise ReplayError("the target run id must differ from the source run id")
    source_bus = _source_bus(source, source_redis_url or (settings.redis if settings.redis_url else None),
                             source_run, settings)
    plan = ReplayPlan(source_run, settings.storage_uri, source_bus, tuple(streams),
                      finished_only=finished_only, skip_dead_lettered=skip_dead_lettered)
    on_step(f"reading {source_run} ({'Redis and its archive' if source_bus else 'archive'})")
    plan.validate()

    if not services:
        target = Bus.connect(settings.redis, settings.run_id, settings.bus)
        check_fresh(target, settings.storage_uri)
        on_step(f"publishing into {settings.run_id}")
        return ReplayResult(settings.run_id, publish(plan, target, pace),
                            undecodable_dead=plan.undecodable_dead)

    if settings.redis_url:
        check_fresh(Bus.connect(settings.redis, settings.run_id, settings.bus), settings.storage_uri)
    recorder = ("recorder",) if settings.recorder.enabled else ()
    local = LocalRun(settings, services=tuple(services) + recorder)
    try:
        on_step(f"starting {', '.join(local.services)}")
        local.start(on_step=on_step)
        on_step(f"publishing into {settings.run_id}")
        published = publish(plan, local.bus, pace)
        before = {stream: local.progress_reader.entries_added(stream) for stream in STREAMS}
        on_step("waiting for the services to handle everything")
        local.wait_drained(timeout_s, quiet_s)
        produced = {stream: local.progress_reader.entries_added(stream) - before[stream]
                    for stream in STREAMS}
    finally:
        codes = local.stop()
    return ReplayResult(settings.run_id, published, {s: n for s, n in produced.items() if n}, local.services,
                        codes, plan.undecodable_dead)


def _source_bus(source: str, redis_url: str | None, run_id: str, settings: Settings) -> Bus | None:
    if source not in ("auto", "archive", "redis"):
        raise ValueError(f"source {source!r}: use auto, archive or redis")
    if source == "archive":
        return None
    if not redis_url:
        if source == "redis":
            raise ReplayError("--from redis needs a Redis URL (--source-redis-url or RS_REDIS_URL)")
        return None
    bus = Bus.connect(redis_url, run_id, settings.bus)
    if bus.has_keys():
        return bus
    if source == "redis":
        raise ReplayError(f"run {run_id!r} has no keys in {redact_url(redis_url)}")
    return None


def replay(
    source_run: Annotated[str, typer.Argument(help="The recorded run to replay.")],
    to: Annotated[str, typer.Option(help="The new run id to replay into (must be unused).")],
    streams: Annotated[str, typer.Option(
        help="Comma-separated streams to replay.")] = ",".join(DEFAULT_STREAMS),
    finished_only: Annotated[bool, typer.Option(help="Only entries of rollouts that finished.")] = False,
    skip_dead_lettered: Annotated[bool, typer.Option(
        help="Leave out the entries the source run dead-lettered.")] = False,
    pace: Annotated[str, typer.Option(help="fast, original, or a speed-up factor (10 or 10x).")] = "fast",
    source: Annotated[str, typer.Option("--from", help="auto: the live Redis namespace if it exists (its "
                                        "trimmed part from the archive), else the archive; or archive / "
                                        "redis.")] = "auto",
    source_redis_url: Annotated[str | None, typer.Option(
        help="Redis of the source run; default RS_REDIS_URL.")] = None,
    services: Annotated[str, typer.Option(help=f"Comma-separated services to run on the replay "
                                          f"({', '.join(REPLAY_SERVICES)}); none: publish only.")] = "",
    timeout: Annotated[float, typer.Option(
        help="Give up waiting for the services after this many seconds.")] = 1800.0,
) -> None:
    """Replay a recorded run into a fresh run namespace (all streams or a subset), optionally with
    services."""
    settings = Settings(run_id=to)
    try:
        chosen = tuple(s.strip() for s in streams.split(",") if s.strip())
        wanted = tuple(s.strip() for s in services.split(",") if s.strip())
        with console.status("replaying") as status:
            result = replay_run(settings, source_run, streams=chosen, finished_only=finished_only,
                                skip_dead_lettered=skip_dead_lettered,
                                pace=Pace.parse(pace), source=source, source_redis_url=source_redis_url,
                                services=wanted, timeout_s=timeout, on_step=status.update)
    except (ReplayError, ValueError, TimeoutError) as exc:
        console.print(f"[bold red]replay failed:[/] {exc}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    table = Table(title=f"replay {source_run} -> {result.target_run}")
    for column in ("stream", "replayed", "produced by the services"):
        table.add_column(column)
    for stream in STREAMS:
        if stream in result.published or stream in result.produced:
            table.add_row(stream, str(result.published.get(stream, "")), str(result.produced.get(stream, "")))
    console.print(table)
    if result.undecodable_dead:
        console.print(f"dead: {result.undecodable_dead} entries that do not decode were replayed as they are")
    if result.services:
        console.print(f"services: {', '.join(result.services)}; exit codes {result.exit_codes}")
    console.print(f"inspect it: rollstream inspect streams {result.target_run}; "
                  f"rollstream inspect diff {source_run} {result.target_run}")
