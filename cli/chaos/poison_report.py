"""What a poisoned run did with every poison entry, and with its own samples: the figures per stream, the
checks `rollstream chaos poison` prints (what each kind must come to: cli/chaos/poison.py), and its tables.

The run's own samples, batches and versions are audited as any run's (audit_run, cli/chaos/audit.py), as if
no poison had been written; the checks on top: each entry that cannot be handled dead-lettered by every
group reading its stream, verdicts for rollouts whose artifact is missing, untrainable rows left out, no
forged sample batched or trained, services healthy and no process exit, the target version, the archive.

    python -m pytest tests/unit/cli/test_poison.py tests/unit/cli/test_chaos_audit.py -q
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from rollstream.cli.chaos.audit import BATCHED_DROP_CAUSES, AuditReport, RowLimits, audit_run, run_events
from rollstream.cli.chaos.poison_inject import Injected
from rollstream.cli.local_run import ProcessExit
from rollstream.shared.contract.archive import ArchiveReader
from rollstream.shared.contract.batches import read_batch
from rollstream.shared.contract.bus import STREAMS, Bus, StreamName
from rollstream.shared.contract.events import (
    BatchReady,
    DeadLettered,
    GradingFailed,
    PolicyUpdated,
    PromptIssued,
    TrajectoryFinished,
    decode,
)
from rollstream.shared.runtime.storage import Storage


@dataclass
class StreamFigures:
    stream: StreamName
    groups: tuple[str, ...]
    """Consumer groups reading the stream at the end of the run."""
    tried: int = 0
    bytes_written: int = 0
    kinds: Counter = field(default_factory=Counter)
    must_dead_letter: int = 0
    """Entries every group must dead-letter (on a stream no group reads: none must)."""
    dead_lettered: int = 0
    """Of those, the ones every group did dead-letter, each with an error."""
    missed: list[str] = field(default_factory=list)
    """'kind entry-id: group' for each dead letter that should be there and is not."""
    dead_lettered_other: int = 0
    """Entries not required to be dead-lettered that some group dead-lettered anyway."""
    verdicts: int = 0
    """Rollouts with a missing diff artifact that got their GradingFailed."""
    forged: int = 0
    untrainable_rows: int = 0
    """Rows of the untrainable batches written."""
    rows_left_out: int = 0
    """Of those, the rows the trainer left out (PolicyUpdated.dropped["invalid"] of their batch)."""
    archived: int = 0
    """Entries found in the run's archive (the recorder's copy of the stream)."""




@dataclass
class PoisonReport:
    seed: int
    rate: float
    streams: dict[StreamName, StreamFigures]
    injected: list[Injected]
    dead_letters: dict[tuple[str, str], dict[str, str]]
    """(stream, entry id) -> {group: error} for every dead letter the services wrote."""
    health: dict[str, str]
    """Process -> 'ok', or what was wrong with it at the end (exited, /healthz status)."""
    unhealthy_moments: list[str]
    """Every time a /healthz answered anything but 200 while the run went on."""
    target_version: int
    version: int
    """The trainer's own last policy version (forged PolicyUpdated entries left out)."""
    dispatcher_version_seen: int
    """The highest policy version the dispatcher's /healthz reported while the run went on."""
    run: AuditReport
    """The run's own samples, batches and versions (audit_run), the injected entries left out."""
    forged_rollouts: set[str]
    forged_batched: set[str]
    """Forged rollouts found in a batch the reward service wrote."""
    forged_trained: set[str]
    """Forged rollouts in a batch the trainer trained on."""
    seconds: float = 0.0
    unexpected_exits: list[ProcessExit] = field(default_factory=list)
    """Process exits the local run's supervisor saw while it was fuzzed (no fault is injected here: any is
    one)."""

    @property
    def healthy(self) -> bool:
        return all(state == "ok" for state in self.health.values())


def consumer_groups(bus: Bus, stream: StreamName) -> tuple[str, ...]:
    try:
        groups = bus.redis.xinfo_groups(bus.keys.stream(stream))
    except Exception:  # no such stream
        return ()
    return tuple(sorted(g["name"].decode() if isinstance(g["name"], bytes) else g["name"] for g in groups))


def trainer_version(bus: Bus, storage_uri: str, injected_ids: set[tuple[str, str]]) -> int:
    updates = [d.event.version for d in run_events(bus, "policy", storage_uri, injected_ids)
               if isinstance(d.event, PolicyUpdated)]
    return max(updates, default=0)


def audit(bus: Bus, storage_uri: str, injected: list[Injected], *, seed: int, rate: float,
          target_version: int, health: dict[str, str], unhealthy_moments: list[str],
          dispatcher_version_seen: int, max_staleness: int, limits: RowLimits,
          sandbox_queue: str = "sandbox") -> PoisonReport:
    """What the run did with every injected entry, and with its own samples: audit_run, whose max_staleness,
    limits and sandbox_queue these are, with the injected entries left out."""
    injected_ids = {(i.poison.stream, i.entry_id) for i in injected}
    dead_letters = _dead_letters(bus, storage_uri, injected_ids)
    figures = _stream_figures(bus, storage_uri, injected, injected_ids, dead_letters)
    updates = [d.event for d in run_events(bus, "policy", storage_uri, injected_ids)
               if isinstance(d.event, PolicyUpdated)]
    _count_rows_left_out(figures, injected, updates)
    forged_rollouts = _forged_rollouts(injected)
    forged_batched, forged_trained = _forged_in_batches(bus, storage_uri, injected_ids, forged_rollouts,
                                                        [update.batch_id for update in updates])
    prompts = [d.event for d in run_events(bus, "prompts", storage_uri, injected_ids)
               if isinstance(d.event, PromptIssued)]
    # the version each admission was made under: one the trainer never reached was read from a forged entry
    dispatcher_version_seen = max([dispatcher_version_seen, *(prompt.policy_version for prompt in prompts)])
    return PoisonReport(
        seed=seed, rate=rate, streams=figures, injected=injected, dead_letters=dead_letters, health=health,
        unhealthy_moments=unhealthy_moments, target_version=target_version,
        version=max((update.version for update in updates), default=0),
        dispatcher_version_seen=dispatcher_version_seen,
        run=audit_run(bus, storage_uri, max_staleness, sandbox_queue, limits=limits, leave_out=injected_ids),
        forged_rollouts=forged_rollouts, forged_batched=forged_batched, forged_trained=forged_trained)


def _dead_letters(bus: Bus, storage_uri: str,
                  injected_ids: set[tuple[str, str]]) -> dict[tuple[str, str], dict[str, str]]:
    """(stream, entry id) -> {group: error} of every dead letter the services wrote."""
    dead_letters: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    for delivery in run_events(bus, "dead", storage_uri, injected_ids):
        letter = delivery.event
        if isinstance(letter, DeadLettered):
            dead_letters[(letter.stream, letter.entry_id)][letter.group] = letter.error
    return dict(dead_letters)


def _stream_figures(bus: Bus, storage_uri: str, injected: list[Injected], injected_ids: set[tuple[str, str]],
                    dead_letters: dict[tuple[str, str], dict[str, str]]) -> dict[StreamName, StreamFigures]:
    """Per stream: the entries tried, and what the services and the recorder did with them."""
    verdicts = {d.envelope.rollout_id for d in run_events(bus, "grades", storage_uri, injected_ids)
                if isinstance(d.event, GradingFailed)}
    archive = ArchiveReader(storage_uri, bus.keys.run_id)
    archived_ids = {stream: {entry.entry_id for entry in archive.entries(stream)}
                    for stream in archive.streams()}
    figures = {stream: StreamFigures(stream, consumer_groups(bus, stream)) for stream in STREAMS}
    for item in injected:
        poison, figure = item.poison, figures[item.poison.stream]
        figure.tried += 1
        figure.bytes_written += sum(len(k) + len(v) for k, v in item.fields.items())
        figure.kinds[poison.kind] += 1
        figure.archived += item.entry_id in archived_ids.get(poison.stream, set())
        letters = dead_letters.get((poison.stream, item.entry_id), {})
        if poison.must_dead_letter and figure.groups:
            figure.must_dead_letter += 1
            missing = [g for g in figure.groups if not letters.get(g)]
            if missing:
                figure.missed.extend(f"{poison.kind} {item.entry_id}: {g}" for g in missing)
            else:
                figure.dead_lettered += 1
        elif letters:
            figure.dead_lettered_other += 1
        if poison.kind == "missing_file" and poison.stream == "trajectories" and _is_finish(item.fields):
            figure.verdicts += poison.rollout_id in verdicts
        figure.forged += poison.kind == "forged"
    return figures


def _count_rows_left_out(figures: dict[StreamName, StreamFigures], injected: list[Injected],
                         updates: list[PolicyUpdated]) -> None:
    """The untrainable batches' rows, and those the trainer left out as invalid."""
    left_out = {update.batch_id: update.dropped.get("invalid", 0) for update in updates}
    for item in injected:
        if item.poison.kind == "untrainable_rows":
            figure = figures[item.poison.stream]
            figure.untrainable_rows += len(item.poison.batch_rows)
            figure.rows_left_out += left_out.get(decode(item.fields).payload.batch_id, 0)


def _forged_rollouts(injected: list[Injected]) -> set[str]:
    """The rollouts forged entries claim, with the rows' rollouts of a forged batch."""
    forged: set[str] = set()
    for item in injected:
        if item.poison.kind == "forged" and item.poison.rollout_id:
            forged.add(item.poison.rollout_id)
            forged.update(row.rollout_id for row in item.poison.batch_rows)
    return forged


def _forged_in_batches(bus: Bus, storage_uri: str, injected_ids: set[tuple[str, str]],
                       forged_rollouts: set[str], trained: list[str]) -> tuple[set[str], set[str]]:
    """Forged rollouts in a batch the reward service wrote, and in a batch the trainer trained (its own or
    one injected)."""
    storage = Storage(storage_uri)
    forged_in: dict[str, set[str]] = defaultdict(set)
    own_batches = []
    for delivery in run_events(bus, "batches", storage_uri):
        batch = delivery.event
        if not isinstance(batch, BatchReady):
            continue
        try:
            rows = read_batch(storage, batch.uri)
        except Exception:  # the fuzzer's batches whose file is missing or is no batch
            continue
        forged_in[batch.batch_id].update(row.rollout_id for row in rows if row.rollout_id in forged_rollouts)
        if ("batches", delivery.entry_id) not in injected_ids:
            own_batches.append(batch.batch_id)
    batched = {r for batch_id in own_batches for r in forged_in.get(batch_id, ())}
    trained_on = {r for batch_id in trained for r in forged_in.get(batch_id, ())}
    return batched, trained_on


def _is_finish(fields: dict) -> bool:
    return fields.get("type") == TrajectoryFinished.TYPE.encode()


def figures_rows(report: PoisonReport) -> list[tuple[str, ...]]:
    """One row per stream: stream, consumer groups, tried, dead-lettered (must), other outcomes, archived."""
    rows = []
    for stream in STREAMS:
        f = report.streams[stream]
        dead = f"{f.dead_lettered}/{f.must_dead_letter}" if f.groups else "-"
        other = []
        if f.verdicts:
            other.append(f"{f.verdicts} GradingFailed")
        if f.untrainable_rows:
            other.append(f"{f.rows_left_out}/{f.untrainable_rows} untrainable rows left out")
        if f.forged:
            other.append(f"{f.forged} forged")
        if f.dead_lettered_other:
            other.append(f"{f.dead_lettered_other} other dead-lettered")
        rows.append((stream, ", ".join(f.groups) or "(none)", str(f.tried), f"{f.bytes_written / 1e6:.1f} MB",
                     dead, "; ".join(other) or "-", f"{f.archived}/{f.tried}"))
    return rows



def checks(report: PoisonReport) -> list[tuple[str, bool, str]]:
    """What a poisoned run must show: (check, passed, the figures behind it)."""
    streams = report.streams.values()
    verdicts, batches = report.streams["trajectories"], report.streams["batches"]
    owed = sum(i.poison.kind == "missing_file" and _is_finish(i.fields) for i in report.injected)
    archived, tried = sum(f.archived for f in streams), sum(f.tried for f in streams)
    exits = "; ".join(f"{e.process} code {e.exit_code} at {e.at_s:.0f}s" for e in report.unexpected_exits)
    return [
        dead_letter_check(report),
        ("every rollout with a missing diff artifact got its verdict (GradingFailed)",
         verdicts.verdicts == owed, f"{verdicts.verdicts}/{owed}"),
        ("every service healthy at the end (every /healthz 200, no process exited)",
         report.healthy, ", ".join(f"{name}: {state}" for name, state in sorted(report.health.items()))),
        ("no /healthz answered anything but 200 during the run", not report.unhealthy_moments,
         "; ".join(report.unhealthy_moments[:4]) or "none"),
        ("no process exited, not even one the supervisor restarted (the drain and the end included)",
         not report.unexpected_exits, exits or "none"),
        ("the trainer left out every row no model can train on",
         batches.rows_left_out == batches.untrainable_rows,
         f"{batches.rows_left_out}/{batches.untrainable_rows}"),
        ("the trainer reached the target version", report.version >= report.target_version,
         f"{report.version}/{report.target_version}"),
        admitted_check(report.run),
        batches_check(report.run),
        ("no forged sample in a batch of the run, none trained",
         not report.forged_batched and not report.forged_trained,
         f"{len(report.forged_batched)}/{len(report.forged_rollouts)} forged rollouts batched, "
         f"{len(report.forged_trained)} trained"),
        ("the dispatcher's policy version never ahead of the trainer's",
         report.dispatcher_version_seen <= report.version,
         f"dispatcher saw {report.dispatcher_version_seen}, trainer at {report.version}"),
        ("the recorder archived every poison entry", archived == tried, f"{archived}/{tried}"),
    ]


def dead_letter_check(report: PoisonReport) -> tuple[str, bool, str]:
    """Every entry no consumer can handle dead-lettered, with its error, by every group reading its stream."""
    streams = report.streams.values()
    must = sum(f.must_dead_letter for f in streams)
    dead = sum(f.dead_lettered for f in streams)
    missed = [m for f in streams for m in f.missed]
    figures = f"{dead}/{must}"
    if missed:
        figures += f"; missing: {', '.join(missed[:6])}" + (" ..." if len(missed) > 6 else "")
    return ("every undeliverable entry dead-lettered by every group reading its stream, with its error",
            not missed, figures)


def admitted_check(run: AuditReport) -> tuple[str, bool, str]:
    """Every admitted sample batched once, each of its segments in one row (the trainer may leave rows out):
    nothing in a poisoned run explains a sample lost, or dropped by the reward service."""
    in_a_batch = (run.trained + run.left_out_invalid
                  + sum(run.dropped.get(cause, 0) for cause in BATCHED_DROP_CAUSES))
    by_reward = {cause: n for cause, n in sorted(run.dropped.items()) if cause not in BATCHED_DROP_CAUSES}
    figures = f"{in_a_batch}/{run.admitted} in one batch, {len(run.lost)} lost"
    if by_reward:
        figures += (f", {sum(by_reward.values())} dropped by the reward service ("
                    + ", ".join(f"{cause} {n}" for cause, n in by_reward.items()) + ")")
    figures += f", {len(run.duplicated)} in several rows"
    if run.admitted_twice:
        figures += f", {len(run.admitted_twice)} admitted twice"
    return ("every admitted sample in exactly one batch, each of its segments in one row",
            not (run.lost or run.duplicated or run.admitted_twice or by_reward), figures)


def batches_check(run: AuditReport) -> tuple[str, bool, str]:
    """Every batch the reward service announced trained once: none left untrained or dead-lettered."""
    untrained = len(run.batches_not_trained) + len(run.batches_dead_lettered)
    figures = f"{run.batches_announced - untrained}/{run.batches_announced} trained"
    if run.batches_dead_lettered:
        figures += f", {len(run.batches_dead_lettered)} dead-lettered"
    if run.batches_trained_twice:
        figures += f", {len(run.batches_trained_twice)} more than once"
    return "every batch of the run trained once", not (untrained or run.batches_trained_twice), figures


def report_tables(report: PoisonReport):
    """The figures as two rich tables: per stream, then the checks."""
    from rich.table import Table
    from rich.text import Text

    per_stream = Table(title=f"poison fuzz: seed {report.seed}, {report.rate:g} entries/s, "
                             f"{len(report.injected)} entries, {report.seconds:.0f}s")
    left_aligned = ("stream", "consumer groups", "other outcomes")
    for column in ("stream", "consumer groups", "tried", "written", "dead-lettered", "other outcomes",
                   "archived"):
        per_stream.add_column(column, justify="left" if column in left_aligned else "right")
    for row in figures_rows(report):
        per_stream.add_row(*row)
    per_stream.caption = ("dead-lettered: entries every consumer group of the stream dead-lettered / entries "
                          "that cannot be handled (a stream no group reads keeps them); kinds per stream: "
                          + "; ".join(f"{s}: {', '.join(f'{k} {n}' for k, n in sorted(f.kinds.items()))}"
                                      for s, f in report.streams.items() if f.kinds))
    verdict = Table(title="what the run kept")
    verdict.add_column("check")
    verdict.add_column("", justify="center")
    verdict.add_column("figures")
    for name, passed, figures in checks(report):
        verdict.add_row(name, Text("ok", style="green") if passed else Text("FAILED", style="bold red"),
                        Text(figures))
    return per_stream, verdict
