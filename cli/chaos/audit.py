"""What a run kept, checked from its streams (archive and live) and its batch files alone.

The promise audited: every admitted sample ends in exactly one trained batch, or is accounted for as
dropped with its reason; no batch is trained twice; no policy version is published twice; nothing is
left pending in a consumer group or the sandbox queue; the archive holds what Redis held.

A batch holds one row per segment of a rollout (a rollout with fan-out has several): rows are keyed by
(rollout, segment index), so a segment in two rows, of one batch or of two, is a duplicate, and a
rollout missing one of its segments is lost. A row the trainer left out as invalid (row_problem, counted
in PolicyUpdated.dropped["invalid"]) is never trained: its rollout is counted apart (`left_out_invalid`),
and each batch's rows trained, stale and invalid must be the trainer's own counts.

The drops a run under fault injection may have are bounded by what its faults can explain
(`drop_bound`, checked by `check_drops`), and any process exit the harness did not bring about fails it
(`unexpected_exits`, from the local run's supervisor).

A run of black-box agents (agent "command") must also leave none of them behind (`audit_blackbox`): once the
run has drained, no process runs as a sandbox uid of any agent-runner process it ever started and no
container those processes made is left, and no gateway session is open past its end (its deadline plus
gateway.finish_grace_s: its keys must expire by then, finished or not).

    report = audit_run(bus, storage_uri, max_staleness, limits=RowLimits.of_model(path))
    report.check_drops(drop_bound(faults, settings, replicas)); report.problems()   # what is wrong

`rollstream chaos run` (cli/chaos/harness.py) prints it after a run under fault injection;
`rollstream chaos poison` (cli/chaos/poison_report.py) reads a poisoned run's own rollouts with it, leaving
out the entries it wrote.

    python -m pytest tests/unit/cli/test_chaos_audit.py -q
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rollstream.cli.local_run import ProcessExit
from rollstream.cli.run_progress import unfinished_work
from rollstream.services.gateway.sessions import expires_at, open_sessions
from rollstream.services.trainer.training import is_stale, row_problem
from rollstream.shared.contract.archive import ArchiveReader, archived_id, parse_id, read_history
from rollstream.shared.contract.batches import BatchRow, read_batch
from rollstream.shared.contract.bus import STREAMS, Bus, Delivery, StreamName
from rollstream.shared.contract.consumers import stream_groups
from rollstream.shared.contract.events import (
    BatchReady,
    DeadLettered,
    PolicyUpdated,
    PromptIssued,
    RolloutDropped,
    TrajectoryFinished,
)
from rollstream.shared.contract.roles import ONE_POLICY, RunRoles
from rollstream.shared.errors import UnknownRole
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage
from rollstream.shared.sandbox.docker import DockerBackend
from rollstream.shared.sandbox.host_uids import process_uids, processes_of_uids

CONSUMER_GROUPS: tuple[tuple[StreamName, str], ...] = stream_groups()
"""Every (stream, consumer group) the services read: all must end with nothing undelivered or pending."""
EXPIRY_ROUNDING_S = 0.001
"""Keys expire at whole milliseconds."""
DROP_CAUSES: tuple[tuple[str, ...], ...] = (
    ("grading_failed", "grade_timeout"), ("stale",), ("dead_lettered",), ("batch_dead_lettered",),
    ("filtered",), ("frozen",))
"""Drop causes bounded together (a lost grade ends as one or the other of the first two)."""
BATCHED_DROP_CAUSES = ("stale", "batch_dead_lettered", "frozen")
"""Drop causes of rollouts whose rows are in a batch: the trainer left them out as too old, or dead-lettered
the batch. The others are the reward service's (RolloutDropped): never batched."""
DROP_REASONS_KEPT = 5
"""Reasons kept per cause of the reward service's drops (AuditReport.drop_reasons)."""


@dataclass(frozen=True)
class RowLimits:
    """What the trainer's model takes (row_problem): rows outside it are left out as invalid."""

    vocab_size: int
    max_positions: int | None

    @classmethod
    def of_model(cls, path: str | Path) -> RowLimits:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path))
        return cls(config.vocab_size, getattr(config, "max_position_embeddings", None))


def drop_bound(faults: Iterable[tuple[str, str]], settings: Settings,
               replicas: dict[str, int]) -> dict[str, int | None]:
    """The most drops, per cause (DROP_CAUSES, joined by ' + '), that the faults injected can explain;
    None: no bound. faults: (kind, service) of each fault done: ('crash', service), ('horse', ...),
    ('redis', ...), ('vllm', ...), ('pause', 'agent-runner').

    Grades (grading_failed + grade_timeout): a grade is lost, or its job fails for good, only when the
    job's run is cut short, and a sandbox-grader runs one job at a time (one RQ worker, one work-horse):
    a work-horse kill cuts short 1 job, a sandbox-grader crash 1 (its work-horse dies with it), a Redis
    restart at most 1 per grader replica. Its queue, retries and pending trajectories are in Redis;
    nothing else loses a grade.

    stale: a row is older than train.max_staleness only when its rollout was held back while the policy
    moved on, and the whole group waits for it: a crashed or paused agent-runner holds at most
    rollout.concurrency rollouts (reclaimed after bus.reclaim_idle_ms, or finished when resumed), each
    holding back its group: concurrency x group size; a vLLM or Redis restart holds every replica's
    in flight, and so does a gateway crash (black-box episodes: each agent-runner's episodes wait for
    the gateway, or run again when their finish went unanswered); a trainer crash at most the batch it
    was training (B + G - 1 rollouts: a batch fills with whole groups), should its restart train it
    later than planned.

    dead_lettered, batch_dead_lettered: an entry is dead-lettered after bus.max_deliveries failed
    deliveries, and one fault (crash or pause of a consumer) fails at most one delivery of each entry
    its process holds (an agent-runner rollout.concurrency, any other bus.read_count): a group whose
    processes suffered fewer faults than max_deliveries cannot have lost an entry to them; otherwise
    faults x held / max_deliveries entries. A gateway crash counts as a fault of every agent-runner: a
    black-box episode it cut off may be refused at its finish (an agent that gave up before any turn got
    through leaves nothing to train on). A prompts, trajectories or grades entry drops 1 rollout, a
    batches entry a batch (B + G - 1).

    filtered: the run's own rule (train.filter_zero_variance), no fault's doing: unbounded when it is
    on, none otherwise. frozen: a rollout whose every segment is of a frozen role (roles.names), never
    trained by the run's own settings: unbounded.
    """
    faults = list(faults)
    largest_batch = settings.train.batch_size + settings.data.samples_per_prompt - 1
    consumer_faults = _consumer_faults(faults, replicas.get("agent-runner", 1))

    def lost_entries(service: str) -> int:
        faults_there = consumer_faults[service]
        if faults_there < settings.bus.max_deliveries:
            return 0
        held = settings.rollout.concurrency if service == "agent-runner" else settings.bus.read_count
        return faults_there * held // settings.bus.max_deliveries

    return {
        "grading_failed + grade_timeout": _grades_cut_short(faults, replicas.get("sandbox-grader", 1)),
        "stale": _rollouts_held_back(faults, settings, replicas.get("agent-runner", 1), largest_batch),
        "dead_lettered": sum(lost_entries(s) for s in ("agent-runner", "sandbox-grader", "reward")),
        "batch_dead_lettered": lost_entries("trainer") * largest_batch,
        "filtered": None if settings.train.filter_zero_variance else 0,
        "frozen": None,
    }


def _grades_cut_short(faults: list[tuple[str, str]], graders: int) -> int:
    """Grading jobs the faults can cut short (drop_bound)."""
    cut = 0
    for kind, service in faults:
        if kind == "horse" or (kind == "crash" and service == "sandbox-grader"):
            cut += 1
        if kind == "redis":
            cut += graders
    return cut


def _rollouts_held_back(faults: list[tuple[str, str]], settings: Settings, runners: int,
                        largest_batch: int) -> int:
    """Rollouts the faults can hold back past train.max_staleness (drop_bound)."""
    group, concurrency = settings.data.samples_per_prompt, settings.rollout.concurrency
    held = 0
    for kind, service in faults:
        if kind == "pause" or (kind == "crash" and service == "agent-runner"):
            held += concurrency * group
        if kind in ("vllm", "redis") or (kind == "crash" and service == "gateway"):
            held += runners * concurrency * group
        if kind == "crash" and service == "trainer":
            held += largest_batch
    return held


def _consumer_faults(faults: list[tuple[str, str]], runners: int) -> Counter[str]:
    """Faults per consuming service, each failing a delivery of what its processes hold (drop_bound)."""
    counted: Counter[str] = Counter()
    for kind, service in faults:
        if kind in ("crash", "pause") and service in ("agent-runner", "sandbox-grader", "reward", "trainer"):
            counted[service] += 1
        if kind == "crash" and service == "gateway":
            counted["agent-runner"] += runners
    return counted


@dataclass
class BlackBoxAudit:
    """What the black-box agents of a drained run left behind; audit_blackbox."""

    agents_left: list[str] = field(default_factory=list)
    """Processes running as a sandbox uid of the run's agent-runners ('pid N'), and containers they made
    ('container ID')."""
    sessions_past_end: list[str] = field(default_factory=list)
    """Open gateway sessions that outlive their end (deadline plus gateway.finish_grace_s), or have none."""
    sessions_open: int = 0
    """Sessions open now (an agent-runner killed mid-episode never finishes its own): each ends at its end."""


@dataclass
class AuditReport:
    events: dict[str, int]
    """Entries ever added, per stream."""
    admitted: int
    trained: int
    """Admitted rollouts every segment of which is in a batch a PolicyUpdated trained, as a trained row."""
    dropped: dict[str, int]
    """Admitted rollouts accounted for as left out, by cause (`stale`: a row of it was too old to train)."""
    drop_reasons: dict[str, list[str]] = field(default_factory=dict)
    """The reward service's reasons for the drops it announced, by cause: '<rollout>: <reason>', the first
    few."""
    left_out_invalid: int = 0
    """Admitted rollouts with a row the trainer left out as invalid (row_problem): never trained."""
    rows: dict[str, int] = field(default_factory=dict)
    """Rows of trained batches by what the trainer did with them: trained, stale, invalid, frozen (a frozen
    role's), unknown_role (a role the run does not have)."""
    rows_by_role: dict[str, dict[str, int]] = field(default_factory=dict)
    """The same, per role (as the row names it; None: the run's default role)."""
    lost: list[str] = field(default_factory=list)
    """Admitted rollouts in no batch and not dropped, or batched without all the segments of an attempt."""
    duplicated: list[str] = field(default_factory=list)
    """A segment in more than one row ('<rollout> segment <i>'), of one batch or of several, or a rollout in a
    batch and dropped as well, or dropped twice."""
    admitted_twice: list[str] = field(default_factory=list)
    never_admitted: list[str] = field(default_factory=list)
    """Rollouts with rows in a batch that no PromptIssued admitted."""
    batches_trained_twice: list[str] = field(default_factory=list)
    versions_published_twice: list[int] = field(default_factory=list)
    versions_missing: list[int] = field(default_factory=list)
    batches_announced: int = 0
    """BatchReady events of the run."""
    batches_not_trained: list[str] = field(default_factory=list)
    """Announced batches no PolicyUpdated trained and that were not dead-lettered."""
    batches_dead_lettered: list[str] = field(default_factory=list)
    """Announced batches the trainer dead-lettered untrained: their rows are dropped (batch_dead_lettered)."""
    trainer_disagrees: list[str] = field(default_factory=list)
    """Batches whose rows trained, stale and invalid differ from the trainer's PolicyUpdated counts."""
    pending: dict[str, int] = field(default_factory=dict)
    """Work left: '<stream>/<group>' -> entries undelivered or unacknowledged; 'sandbox jobs' -> queued
    jobs."""
    archive_mismatches: dict[str, str] = field(default_factory=dict)
    longest_stall_s: float = 0.0
    """Longest time without a new policy version (from the first admitted sample to the last version)."""
    repeated_attempts: int = 0
    """Trajectories finished for a rollout that had finished already (work done again after a crash)."""
    drop_bound: dict[str, int | None] = field(default_factory=dict)
    """Drops the run's faults can explain, per cause (drop_bound); empty: not checked."""
    drops_over_bound: list[str] = field(default_factory=list)
    unexpected_exits: list[ProcessExit] = field(default_factory=list)
    """Process exits the harness did not bring about (the supervisor restarted them, or saw them at the
    end)."""
    blackbox: BlackBoxAudit | None = None
    """What black-box agents left behind; None: the run had none (its agent is no command)."""

    def drops_of(self, causes: str) -> int:
        return sum(self.dropped.get(cause, 0) for cause in causes.split(" + "))

    def check_drops(self, bound: dict[str, int | None]) -> None:
        """Keep the bound, and note every cause whose drops exceed it, or that it does not allow at all."""
        self.drop_bound = dict(bound)
        bounded = {cause for causes in bound for cause in causes.split(" + ")}
        over = [(causes, f"{self.drops_of(causes)} dropped, the faults explain at most {most}")
                for causes, most in bound.items() if most is not None and self.drops_of(causes) > most]
        over += [(cause, f"{n} dropped, a cause no fault explains")
                 for cause, n in sorted(self.dropped.items()) if cause not in bounded and n]
        self.drops_over_bound = [f"{causes}: {why}{self._reasons_shown(causes)}" for causes, why in over]

    def _reasons_shown(self, causes: str) -> str:
        reasons = [reason for cause in causes.split(" + ") for reason in self.drop_reasons.get(cause, [])]
        return f" ({'; '.join(reasons)})" if reasons else ""

    def problems(self) -> list[str]:
        out = []
        for name in ("lost", "duplicated", "admitted_twice", "never_admitted", "batches_trained_twice",
                     "versions_published_twice", "versions_missing", "batches_not_trained",
                     "trainer_disagrees"):
            values = getattr(self, name)
            if values:
                out.append(f"{name.replace('_', ' ')}: {len(values)} ({', '.join(map(str, values[:5]))})")
        if self.pending:
            out.append(f"left pending: {self.pending}")
        out.extend(f"archive of {stream}: {why}" for stream, why in self.archive_mismatches.items())
        out.extend(f"more drops than the faults explain: {why}" for why in self.drops_over_bound)
        out.extend(f"a process exited that the harness did not stop: {e.describe()}"
                   for e in self.unexpected_exits)
        if self.blackbox is not None:
            left, past_end = self.blackbox.agents_left, self.blackbox.sessions_past_end
            if left:
                out.append(f"black-box agents left running: {len(left)} ({', '.join(left[:5])})")
            if past_end:
                out.append(f"gateway sessions open past their end: {len(past_end)} "
                           f"({'; '.join(past_end[:5])})")
        return out


def audit_run(bus: Bus, storage_uri: str, max_staleness: int, sandbox_queue: str = "sandbox", *,
              limits: RowLimits, leave_out: Collection[tuple[str, str]] = frozenset(),
              roles: RunRoles | None = None) -> AuditReport:
    """What the run kept (see the module docstring). leave_out: (stream, entry id) of entries written into
    the run from outside (poison): what became of the run's own rollouts is read as if they had never been
    written, though they count among the entries added and in the archive's check. roles: the run's
    (RunRoles.of(settings)); None: one trained role, the whole policy."""
    history = {stream: run_events(bus, stream, storage_uri, leave_out) for stream in STREAMS}
    admitted = Counter(d.envelope.rollout_id for d in history["prompts"] if isinstance(d.event, PromptIssued))
    report = AuditReport(events=_entries_added(bus), admitted=len(admitted), trained=0, dropped={})
    report.admitted_twice = sorted(r for r, n in admitted.items() if n > 1)
    updates = [d.event for d in history["policy"] if isinstance(d.event, PolicyUpdated)]
    _check_versions(report, updates)
    row_fates = _batch_row_fates(report, history, updates, Storage(storage_uri), max_staleness, limits,
                                 roles or ONE_POLICY)
    segment_counts, finished = _finished_attempts(history)
    _account_admitted(report, admitted, row_fates, _drop_causes(history), segment_counts)
    report.never_admitted = sorted(set(row_fates) - set(admitted))
    report.repeated_attempts = sum(n - 1 for n in finished.values())
    report.longest_stall_s = _longest_stall(history)
    report.pending = unfinished_work(bus, CONSUMER_GROUPS, sandbox_queue)
    report.archive_mismatches = _archive_mismatches(bus, storage_uri, report.events)
    return report


def run_events(bus: Bus, stream: StreamName, storage_uri: str,
               leave_out: Collection[tuple[str, str]] = frozenset()) -> list[Delivery]:
    """Every event the stream has had (archive, then live; what does not decode left out), but the entries
    in leave_out: (stream, entry id)."""
    return [d for d in read_history(bus, stream, storage_uri) if (stream, d.entry_id) not in leave_out]


RowFates = dict[str, dict[int, list[str]]]
"""rollout -> segment index -> what became of each row of it: 'trained', 'stale', 'invalid' or
'batch_dead_lettered'."""


def _check_versions(report: AuditReport, updates: list[PolicyUpdated]) -> None:
    versions = Counter(u.version for u in updates)
    report.versions_published_twice = sorted(v for v, n in versions.items() if n > 1)
    report.versions_missing = sorted(set(range(1, max(versions, default=0) + 1)) - set(versions))
    trained_batches = Counter(u.batch_id for u in updates)
    report.batches_trained_twice = sorted(b for b, n in trained_batches.items() if n > 1)


def _batch_row_fates(report: AuditReport, history: dict[StreamName, list[Delivery]],
                     updates: list[PolicyUpdated], storage: Storage, max_staleness: int,
                     limits: RowLimits, roles: RunRoles) -> RowFates:
    """The fate of every row of every announced batch; notes the batches no PolicyUpdated trained, those the
    trainer counted otherwise, and the trained batches' rows by fate, and by role and fate."""
    update_of = {u.batch_id: u for u in updates}
    trained_from = _role_versions_before(updates, roles)
    by_role: dict[str, Counter[str]] = defaultdict(Counter)
    batch_entries = {d.entry_id: d.event for d in history["batches"] if isinstance(d.event, BatchReady)}
    dead_batches = {d.event.entry_id for d in history["dead"]
                    if isinstance(d.event, DeadLettered) and d.event.stream == "batches"}
    report.batches_announced = len(batch_entries)
    row_fates: RowFates = defaultdict(lambda: defaultdict(list))
    rows: Counter[str] = Counter()
    for entry_id, batch in batch_entries.items():
        update = update_of.get(batch.batch_id)
        if update is None:
            if entry_id in dead_batches:
                report.batches_dead_lettered.append(batch.batch_id)
                for row in read_batch(storage, batch.uri):
                    row_fates[row.rollout_id][row.segment_index].append("batch_dead_lettered")
            else:
                report.batches_not_trained.append(batch.batch_id)
            continue
        fates = _trained_row_fates(read_batch(storage, batch.uri), trained_from[batch.batch_id],
                                   max_staleness, limits, roles, row_fates, by_role)
        rows.update(fates)
        said = {"trained": update.trained_samples,
                **{fate: update.dropped.get(fate, 0) for fate in ROW_FATES[1:]
                   if fate in ROW_FATES[:3] or fate in update.dropped or fates[fate]}}
        if said != {fate: fates[fate] for fate in said}:
            report.trainer_disagrees.append(f"{batch.batch_id} (rows: {dict(fates)}, PolicyUpdated: {said})")
    # a run's roles' fates (frozen, unknown_role) only where it has such rows
    report.rows = {fate: rows[fate] for fate in ROW_FATES if fate in rows or fate in ROW_FATES[:3]}
    report.rows_by_role = {role: dict(fates) for role, fates in sorted(by_role.items())}
    return row_fates


ROW_FATES = ("trained", "stale", "invalid", "frozen", "unknown_role")
"""What the trainer does with a row of a batch it trains (PolicyUpdated.dropped counts all but trained)."""


def _role_versions_before(updates: list[PolicyUpdated], roles: RunRoles) -> dict[str, dict[str, int]]:
    """Each trained batch -> each trained role's version the trainer trained it from (the version before the
    update that trained it; a full fine-tune's one role is the trainer's step)."""
    before: dict[str, dict[str, int]] = {}
    current = dict.fromkeys(roles.trained, 0)
    for update in sorted(updates, key=lambda u: u.version):
        before[update.batch_id] = dict(current) if roles.lora else {roles.default: update.version - 1}
        current.update(update.role_versions or {roles.default: update.version})
    return before


def _trained_row_fates(rows: list[BatchRow], trained_from: dict[str, int], max_staleness: int,
                       limits: RowLimits, roles: RunRoles, row_fates: RowFates,
                       by_role: dict[str, Counter[str]]) -> Counter[str]:
    """Adds the fate of each row of a trained batch to row_fates (and by_role); the rows by fate.
    trained_from: each trained role's version the batch was trained from."""
    # the trainer's rules, in its order: a row of a role the run does not have, or of a frozen role, is left
    # out as such; of a trained role's rows, those no model can train on as invalid, then, of the others,
    # those generated more than max_staleness versions of their role before the role's version as stale
    fates: Counter[str] = Counter()
    for row in rows:
        try:
            role = roles.resolve(row.role)
        except UnknownRole:
            role = None
        if role is None:
            fate = "unknown_role"
        elif role not in trained_from:
            fate = "frozen"
        elif row_problem(row, limits.vocab_size, limits.max_positions, trained_from[role]) is not None:
            fate = "invalid"
        elif is_stale(row, trained_from[role], max_staleness):
            fate = "stale"
        else:
            fate = "trained"
        row_fates[row.rollout_id][row.segment_index].append(fate)
        fates[fate] += 1
        by_role[row.role or roles.default][fate] += 1
    return fates


def _drop_causes(history: dict[StreamName, list[Delivery]]) -> dict[str, list[RolloutDropped]]:
    """rollout -> each RolloutDropped of it."""
    drops: dict[str, list[RolloutDropped]] = defaultdict(list)
    for delivery in history["rewards"]:
        if isinstance(delivery.event, RolloutDropped):
            drops[delivery.envelope.rollout_id].append(delivery.event)
    return drops


def _finished_attempts(history: dict[StreamName, list[Delivery]]) -> tuple[dict[str, set[int]], Counter[str]]:
    """rollout -> segment_count of each of its finished attempts (the reward service batches one of them);
    and rollout -> attempts finished."""
    segment_counts: dict[str, set[int]] = defaultdict(set)
    finished: Counter[str] = Counter()
    for delivery in history["trajectories"]:
        if isinstance(delivery.event, TrajectoryFinished):
            segment_counts[delivery.envelope.rollout_id].add(delivery.event.segment_count)
            finished[delivery.envelope.rollout_id] += 1
    return segment_counts, finished


def _account_admitted(report: AuditReport, admitted: Iterable[str], row_fates: RowFates,
                      drops: dict[str, list[RolloutDropped]], segment_counts: dict[str, set[int]]) -> None:
    """Each admitted rollout, once: duplicated, dropped (with its cause), lost, left out as invalid or
    trained."""
    dropped: Counter[str] = Counter()
    for rollout in admitted:
        segments, causes = row_fates.get(rollout, {}), drops.get(rollout, [])
        twice = [f"{rollout} segment {i}" for i, fates in sorted(segments.items()) if len(fates) > 1]
        if twice or len(causes) > 1 or (segments and causes):
            report.duplicated.extend(twice or [rollout])
            continue
        if causes:
            dropped[causes[0].cause] += 1
            reasons = report.drop_reasons.setdefault(causes[0].cause, [])
            if len(reasons) < DROP_REASONS_KEPT:
                reasons.append(f"{rollout}: {causes[0].reason}")
            continue
        if not segments:
            report.lost.append(rollout)
            continue
        counts = segment_counts.get(rollout, set())
        if counts and not any(set(segments) == set(range(n)) for n in counts):
            report.lost.append(f"{rollout} (segments {sorted(segments)} batched, "
                               f"its attempts had {sorted(counts)})")
            continue
        fates = {fate for fates in segments.values() for fate in fates}
        if fates & {"invalid", "unknown_role"}:
            report.left_out_invalid += 1
        elif fates - {"trained", "frozen"}:
            dropped[min(fates - {"trained", "frozen"})] += 1
        elif "trained" not in fates:  # every segment of it a frozen role's
            dropped["frozen"] += 1
        else:  # its trained roles' segments trained (a frozen role's never are)
            report.trained += 1
    report.dropped = dict(dropped)


def audit_blackbox(bus: Bus, settings: Settings, agent_runner_pids: set[int]) -> BlackBoxAudit:
    """What the black-box agents of a drained run left (see the module docstring). agent_runner_pids: every
    agent-runner process the run started, killed ones included. A sandbox uid is one of its agent-runner's
    (host_uids.process_uids) when the agent-runners run as root; as another user bwrap runs as that user,
    and its --die-with-parent is what ends the agent with a killed agent-runner. Containers are looked for
    when the agents' sandbox is docker."""
    report = BlackBoxAudit()
    for pid in sorted(agent_runner_pids):
        report.agents_left += [f"pid {leftover} (a sandbox uid of agent-runner pid {pid})"
                               for leftover in processes_of_uids(process_uids(pid))]
    if (settings.agent.command_sandbox or settings.grader.backend) == "docker":
        report.agents_left += [f"container {cid}" for cid in DockerBackend().containers_of(agent_runner_pids)]
    sessions = open_sessions(bus)
    report.sessions_open = len(sessions)
    for session in sessions:
        name = f"{session.spec.session_id} (rollout {session.spec.rollout_id})"
        expires = expires_at(bus, session.spec.session_id)
        if session.ends_at is None:
            report.sessions_past_end.append(f"{name}: it has no end "
                                            f"(time budget: {session.spec.time_budget_s})")
        elif expires is None:
            report.sessions_past_end.append(f"{name}: its keys never expire "
                                            f"(its end is {session.ends_at:.3f})")
        elif expires > session.ends_at + EXPIRY_ROUNDING_S:
            report.sessions_past_end.append(f"{name}: its keys expire at {expires:.3f}, "
                                            f"{expires - session.ends_at:.3f} s after its end")
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
            out[stream] = (f"{len(archived)} archived + {len(newer_than_archive)} live after the archived "
                           f"position, but {added[stream]} entries were added")
            continue
        differing = [i for i in archived.keys() & live.keys()
                     if _normalized(archived[i]) != _normalized(live[i])]
        if differing:
            out[stream] = f"{len(differing)} entries differ from Redis (first {sorted(differing)[0]})"
    return out


def _normalized(fields: dict) -> dict[bytes, bytes]:
    def as_bytes(value) -> bytes:
        return value if isinstance(value, bytes) else str(value).encode()

    return {as_bytes(k): as_bytes(v) for k, v in fields.items()}
