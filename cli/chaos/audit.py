"""What a run kept, checked from its streams (archive and live) and its batch files alone.

The promise audited: every admitted sample ends in exactly one trained batch, or is accounted for as
dropped with its reason; no batch is trained twice; no policy version is published twice; nothing is
left pending in a consumer group or the sandbox queue; the archive holds what Redis held.

    audit_run(bus, storage_uri, max_staleness)   # an AuditReport; report.problems() lists what is wrong

`rollstream chaos run` (cli/chaos/harness.py) prints it after a run under fault injection.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from rollstream.shared.contract.archive import ArchiveReader, archived_id, parse_id, read_history
from rollstream.shared.contract.batches import read_batch
from rollstream.shared.contract.bus import STREAMS, Bus, StreamName
from rollstream.shared.contract.events import (
    BatchReady,
    DeadLettered,
    PolicyUpdated,
    PromptIssued,
    RolloutDropped,
    TrajectoryFinished,
)
from rollstream.shared.runtime.storage import Storage

CONSUMER_GROUPS: tuple[tuple[StreamName, str], ...] = (
    ("prompts", "agent-runner"), ("trajectories", "sandbox-grader"), ("trajectories", "reward"),
    ("grades", "reward"), ("dead", "reward"), ("batches", "trainer"))
"""Every (stream, consumer group) the services read: all must end with nothing undelivered or pending."""


@dataclass
class AuditReport:
    events: dict[str, int]
    """Entries ever added, per stream."""
    admitted: int
    trained: int
    """Samples (rollouts) in a batch a PolicyUpdated trained, not left out as stale."""
    dropped: dict[str, int]
    """Samples accounted for as left out, by cause."""
    lost: list[str] = field(default_factory=list)
    """Admitted rollouts in no trained batch and not dropped."""
    duplicated: list[str] = field(default_factory=list)
    """Rollouts in more than one batch, or in a batch and dropped as well."""
    admitted_twice: list[str] = field(default_factory=list)
    batches_trained_twice: list[str] = field(default_factory=list)
    versions_published_twice: list[int] = field(default_factory=list)
    versions_missing: list[int] = field(default_factory=list)
    batches_not_trained: list[str] = field(default_factory=list)
    """Announced batches no PolicyUpdated trained and that were not dead-lettered."""
    pending: dict[str, int] = field(default_factory=dict)
    """Work left: '<stream>/<group>' -> entries undelivered or unacknowledged; 'sandbox jobs' -> queued jobs."""
    archive_mismatches: dict[str, str] = field(default_factory=dict)
    longest_stall_s: float = 0.0
    """Longest time without a new policy version (from the first admitted sample to the last version)."""
    repeated_attempts: int = 0
    """Trajectories finished for a rollout that had finished already (work done again after a crash)."""

    def problems(self) -> list[str]:
        out = []
        for name in ("lost", "duplicated", "admitted_twice", "batches_trained_twice", "versions_published_twice",
                     "versions_missing", "batches_not_trained"):
            values = getattr(self, name)
            if values:
                out.append(f"{name.replace('_', ' ')}: {len(values)} ({', '.join(map(str, values[:5]))})")
        if self.pending:
            out.append(f"left pending: {self.pending}")
        out.extend(f"archive of {stream}: {why}" for stream, why in self.archive_mismatches.items())
        return out


def audit_run(bus: Bus, storage_uri: str, max_staleness: int, sandbox_queue: str = "sandbox") -> AuditReport:
    history = {stream: read_history(bus, stream, storage_uri) for stream in STREAMS}
    admitted = Counter(d.envelope.rollout_id for d in history["prompts"] if isinstance(d.event, PromptIssued))
    report = AuditReport(events=_entries_added(bus), admitted=len(admitted), trained=0, dropped={})
    report.admitted_twice = sorted(r for r, n in admitted.items() if n > 1)

    updates = [d.event for d in history["policy"] if isinstance(d.event, PolicyUpdated)]
    versions = Counter(u.version for u in updates)
    report.versions_published_twice = sorted(v for v, n in versions.items() if n > 1)
    report.versions_missing = sorted(set(range(1, max(versions, default=0) + 1)) - set(versions))
    trained_batches = Counter(u.batch_id for u in updates)
    report.batches_trained_twice = sorted(b for b, n in trained_batches.items() if n > 1)
    version_of = {u.batch_id: u.version for u in updates}

    batch_entries = {d.entry_id: d.event for d in history["batches"] if isinstance(d.event, BatchReady)}
    dead_batches = {d.event.entry_id for d in history["dead"]
                    if isinstance(d.event, DeadLettered) and d.event.stream == "batches"}
    outcomes: dict[str, list[str]] = defaultdict(list)
    """rollout -> everything that became of it: 'trained' or 'dropped:<cause>'."""
    storage = Storage(storage_uri)
    for entry_id, batch in batch_entries.items():
        if batch.batch_id not in version_of:
            if entry_id in dead_batches:
                for rollout in {row.rollout_id for row in read_batch(storage, batch.uri)}:
                    outcomes[rollout].append("dropped:batch_dead_lettered")
            else:
                report.batches_not_trained.append(batch.batch_id)
            continue
        # the trainer's rule (train.max_staleness): rows generated before version - 1 - eta are left out
        oldest_allowed = version_of[batch.batch_id] - 1 - max_staleness
        stale: dict[str, bool] = {}
        for row in read_batch(storage, batch.uri):
            stale[row.rollout_id] = stale.get(row.rollout_id, False) or row.min_policy_version < oldest_allowed
        for rollout, is_stale in stale.items():
            outcomes[rollout].append("dropped:stale" if is_stale else "trained")
    for delivery in history["rewards"]:
        if isinstance(delivery.event, RolloutDropped):
            outcomes[delivery.envelope.rollout_id].append(f"dropped:{delivery.event.cause}")

    dropped: Counter[str] = Counter()
    for rollout in admitted:
        fates = outcomes.get(rollout, [])
        if not fates:
            report.lost.append(rollout)
        elif len(fates) > 1:
            report.duplicated.append(rollout)
        elif fates[0] == "trained":
            report.trained += 1
        else:
            dropped[fates[0].removeprefix("dropped:")] += 1
    report.dropped = dict(dropped)
    finished = Counter(d.envelope.rollout_id for d in history["trajectories"] if isinstance(d.event, TrajectoryFinished))
    report.repeated_attempts = sum(n - 1 for n in finished.values())
    report.longest_stall_s = _longest_stall(history)
    report.pending = _pending(bus, sandbox_queue)
    report.archive_mismatches = _archive_mismatches(bus, storage_uri, report.events)
    return report


def _entries_added(bus: Bus) -> dict[str, int]:
    out = {}
    for stream in STREAMS:
        try:
            out[stream] = int(bus.redis.xinfo_stream(bus.keys.stream(stream))["entries-added"])
        except Exception:  # no such stream: nothing was ever added
            out[stream] = 0
    return out


def _longest_stall(history: dict) -> float:
    times = sorted(d.envelope.time for d in history["policy"] if isinstance(d.event, PolicyUpdated))
    first = min((d.envelope.time for d in history["prompts"]), default=None)
    marks = ([first] if first is not None else []) + times
    return max((b - a for a, b in zip(marks, marks[1:])), default=0.0)


def _pending(bus: Bus, sandbox_queue: str) -> dict[str, int]:
    from rq import Queue

    out = {}
    for stream, group in CONSUMER_GROUPS:
        undelivered, pending = bus.group_lag(stream, group)
        if undelivered + pending:
            out[f"{stream}/{group}"] = undelivered + pending
    queue = Queue(f"{bus.keys.prefix}:{sandbox_queue}", connection=bus.redis)
    jobs = queue.count + queue.started_job_registry.count + queue.scheduled_job_registry.count
    if jobs:
        out["sandbox jobs"] = jobs
    return out


def _archive_mismatches(bus: Bus, storage_uri: str, added: dict[str, int]) -> dict[str, str]:
    """Per stream: the archive must hold every entry up to the recorder's archived position, with the fields
    Redis has for the entries both still hold, and nothing Redis never had."""
    reader = ArchiveReader(storage_uri, bus.keys.run_id)
    out = {}
    for stream in STREAMS:
        archived = {entry.entry_id: entry.fields for entry in reader.entries(stream)}
        position = archived_id(bus, stream)
        live = {(k.decode() if isinstance(k, bytes) else k): fields
                for k, fields in bus.redis.xrange(bus.keys.stream(stream))}
        newer_than_archive = [i for i in live if position is None or parse_id(i) > parse_id(position)]
        if len(archived) + len(newer_than_archive) != added[stream]:
            out[stream] = (f"{len(archived)} archived + {len(newer_than_archive)} live after the archived position, "
                           f"but {added[stream]} entries were added")
            continue
        differing = [i for i in archived.keys() & live.keys() if _normalized(archived[i]) != _normalized(live[i])]
        if differing:
            out[stream] = f"{len(differing)} entries differ from Redis (first {sorted(differing)[0]})"
    return out


def _normalized(fields: dict) -> dict[bytes, bytes]:
    def as_bytes(value) -> bytes:
        return value if isinstance(value, bytes) else str(value).encode()

    return {as_bytes(k): as_bytes(v) for k, v in fields.items()}
