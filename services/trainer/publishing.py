"""A trained version as the trainer publishes it (services/trainer/training.py), and found again when it
starts.

TrainedStep is a batch trained on, not yet served by the fleet (nor, with a collective sync, checkpointed).
Once the fleet serves it, publish_update sends PolicyUpdated with the batch marked trained and each server's
version recorded (FLEET_VERSIONS: the trainer's version under the server's URL and, in a LoRA run, each
adapter's version under its field), in one transaction, and record_published sets the version's Prometheus
series.
last_own_update finds the newest PolicyUpdated this run's trainer published (its batch is in the trained
set), on the `policy` stream or in the run's archive: the version a restarted trainer resumes; resume_point
finds how: from that version's checkpoint, or from the newest one before it and the batches to train again
(train.checkpoint_every).

Tests: tests/unit/services/trainer/test_batch_checks.py (last_own_update).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from rollstream.services.trainer.role_versions import ROLE_VERSIONS_FILE, AdapterStates
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import BatchReady, PolicyUpdated, decode
from rollstream.shared.contract.roles import served_versions
from rollstream.shared.contract.run_facts import FLEET_VERSIONS

if TYPE_CHECKING:
    from rollstream.shared.inference.weight_transport import Weights

POLICY_VERSION = Gauge("rollstream_trainer_policy_version", "The policy version this trainer last published.")
PHASE_SECONDS = Histogram("rollstream_trainer_phase_seconds",
                          "Time of each phase of a version: train (the optimizer steps over a batch), "
                          "checkpoint (its training state written: before a disk sync, or once published "
                          "every train.checkpoint_every versions), sync (every fleet server serving it).",
                          ["phase"],
                          buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900))
STEP_STATS = Gauge("rollstream_trainer_step_stat",
                   "The last version's training statistics, averaged over its optimizer steps: loss, "
                   "pg_loss, kl, ratio_mean, clip_fraction, importance_weight_mean, importance_weight_max, "
                   "capped_fraction, grad_norm, tokens, micro_batches, logprob_gap_abs_mean (the trainer's "
                   "logprobs against the rollout's).", ["stat"])
SAMPLES = Counter("rollstream_trainer_samples_total",
                  "Batch samples by what the trainer did with them: trained, or dropped as stale or invalid.",
                  ["outcome"])
STALENESS = Histogram("rollstream_trainer_sample_staleness_versions",
                      "Versions between the policy a trained sample was generated with and the one it "
                      "trains.",
                      buckets=(0, 1, 2, 3, 4, 6, 8, 16))
SYNC_STATS = Gauge("rollstream_trainer_sync_stat",
                   "The last version's weight sync: bytes (what the trainer sent: the whole model, or a "
                   "delta's indices and values; a disk sync sends none), changed_fraction (of the model's "
                   "elements at the serving dtype, since the version before), delta (1 when it went as a "
                   "delta), paused_seconds (the longest a server was paused for it).", ["stat"])
PARITY = Gauge("rollstream_trainer_sync_parity_max_abs_diff",
               "Largest gap between a fleet server's and the trainer's logprobs of the probe after the last "
               "sync.")

POLICY_PAGE = 64
"""Entries of `policy` read at a time while looking for the trainer's own last update."""


@dataclass
class TrainedStep:
    """A batch trained on, not yet served by the fleet."""

    version: int
    probe: list[int]
    trained: int
    dropped: dict[str, int]
    expected: list[float]
    """The trainer's own logprobs of the probe, which every server must serve after the sync."""
    weights: Weights | None = None
    """The version's tensors, for a collective sync (on the leading rank)."""
    servers: list[str] = field(default_factory=list)
    """The fleet's servers that serve it, once synced."""
    metrics: dict[str, float] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)
    """Of each trained sample: versions between the policy that generated it and the one it trained."""
    role_versions: dict[str, int] = field(default_factory=dict)
    """Every trained role's version after the step."""
    probes: dict[str, list[int]] = field(default_factory=dict)
    """A LoRA run's: each adapter's probe."""
    role_expected: dict[str, list[float]] = field(default_factory=dict)
    """A LoRA run's: the trainer's logprobs of each adapter's probe with that adapter."""
    adapter_states: AdapterStates = field(default_factory=dict)
    """A LoRA run's: the adapters of the roles the step trained (on the leading rank), to be written for the
    servers."""


def publish_update(bus: Bus, update: PolicyUpdated, trained_key: str, adapters: tuple[str, ...] = ()) -> None:
    """PolicyUpdated on `policy`, its batch added to the trained set and each of its servers recorded as
    serving its version (and each of `adapters`, a LoRA run's roles, at the role's version): all or nothing,
    so a restart never finds a version half published."""
    pipe = bus.redis.pipeline(transaction=True)
    bus.publish("policy", update, pipe=pipe, event_id=f"policy:v{update.version}")
    pipe.sadd(trained_key, update.batch_id)
    record_fleet_versions(pipe, bus, update.servers, update.version, update.role_versions, adapters)
    pipe.execute()


def record_fleet_versions(client, bus: Bus, servers: list[str], version: int, role_versions: dict[str, int],
                          adapters: tuple[str, ...]) -> None:
    """Record in FLEET_VERSIONS (with `client`: Redis or a pipeline) that `servers` serve the trainer's
    `version` and each adapter at its role's version."""
    served = {role: role_versions[role] for role in adapters}
    for url in servers:
        client.hset(FLEET_VERSIONS.key(bus.keys), mapping=served_versions(url, version, served))


def record_checkpoint(seconds: float) -> None:
    PHASE_SECONDS.labels("checkpoint").observe(seconds)


def record_published(step: TrainedStep) -> None:
    """The published version's figures, as Prometheus series."""
    metrics = step.metrics
    POLICY_VERSION.set(step.version)
    for phase, key in (("train", "train/step_seconds"), ("checkpoint", "train/checkpoint_seconds"),
                       ("sync", "sync/seconds")):
        if key in metrics:
            PHASE_SECONDS.labels(phase).observe(metrics[key])
    for key, value in metrics.items():
        # one series per statistic: a role's own (train/<role>/loss) go to the trackers only
        if key.startswith("train/") and not key.endswith("_seconds") and key.count("/") == 1:
            STEP_STATS.labels(key.removeprefix("train/")).set(value)
        if key in ("sync/bytes", "sync/changed_fraction", "sync/delta", "sync/paused_seconds"):
            SYNC_STATS.labels(key.removeprefix("sync/")).set(value)
    SAMPLES.labels("trained").inc(step.trained)
    for reason, count in step.dropped.items():
        SAMPLES.labels(f"dropped_{reason}").inc(count)
    for staleness in step.staleness:
        STALENESS.observe(staleness)
    PARITY.set(metrics.get("sync/parity_max_abs_diff", 0.0))


def last_own_update(bus: Bus, trained_key: str, storage_uri: str | None = None) -> PolicyUpdated | None:
    """The newest PolicyUpdated this run's trainer published: its batch is in the trained set, which the
    trainer adds to in the same transaction. A PolicyUpdated anyone else wrote on `policy` (its batch
    never trained here) is passed over, as are entries that do not decode. The recorder trims `policy`
    down to its newest entry: what is not on the stream any more is looked for in the run's archive."""

    def own(fields: dict) -> PolicyUpdated | None:
        try:
            event = decode(fields).payload
        except ValueError:
            return None
        if isinstance(event, PolicyUpdated) and bus.redis.sismember(trained_key, event.batch_id):
            return event
        return None

    key, end = bus.keys.stream("policy"), "+"
    while True:
        page = bus.redis.xrevrange(key, max=end, count=POLICY_PAGE)
        for _, fields in page:
            if (found := own(fields)) is not None:
                return found
        if len(page) < POLICY_PAGE:
            break
        end = f"({page[-1][0].decode()}"
    if storage_uri is None:
        return None
    from rollstream.shared.contract.archive import ArchiveReader

    found = None
    for entry in ArchiveReader(storage_uri, bus.keys.run_id).entries("policy"):
        found = own(entry.fields) or found
    return found


@dataclass
class ResumePoint:
    """Where a starting trainer takes up its run: the newest published version with a checkpoint on disk
    (None: the starting model), then the batches of the versions published after it, in order, to train
    again (train.checkpoint_every > 1, or a stop before a checkpoint was written)."""

    checkpointed: PolicyUpdated | None
    replay: list[BatchReady]

    @property
    def version(self) -> int:
        return self.checkpointed.version + len(self.replay) if self.checkpointed else len(self.replay)


def newest_checkpointed(bus: Bus, trained_key: str, storage_uri: str | None
                        ) -> tuple[PolicyUpdated | None, PolicyUpdated | None, dict[int, PolicyUpdated]]:
    """This run's trainer's newest PolicyUpdated, the newest one whose checkpoint is on disk (None: none is),
    and, when those differ, every own PolicyUpdated by version (else empty)."""
    from rollstream.shared.contract.archive import read_history

    newest = last_own_update(bus, trained_key, storage_uri)
    if newest is None or has_checkpoint(newest):
        return newest, newest, {}
    own: dict[int, PolicyUpdated] = {}
    for delivery in read_history(bus, "policy", storage_uri):
        event = delivery.event
        if isinstance(event, PolicyUpdated) and bus.redis.sismember(trained_key, event.batch_id):
            own[event.version] = event
    by_newest = (own[version] for version in sorted(own, reverse=True))
    checkpointed = next((update for update in by_newest if has_checkpoint(update)), None)
    return newest, checkpointed, own


def has_checkpoint(update: PolicyUpdated) -> bool:
    """Whether the version's checkpoint is on disk (written whole: under a temporary name, then renamed): the
    model's (config.json) or a LoRA run's adapters (with their roles' versions)."""
    directory = Path(update.checkpoint_uri)
    return (directory / "config.json").is_file() or (directory / ROLE_VERSIONS_FILE).is_file()


def resume_point(bus: Bus, trained_key: str, storage_uri: str | None) -> ResumePoint:
    """The ResumePoint of this run's trainer, from its own PolicyUpdated events (last_own_update's) on
    `policy` and in the run's archive, and the BatchReady of each version to train again."""
    from rollstream.shared.contract.archive import read_history

    newest, checkpointed, own = newest_checkpointed(bus, trained_key, storage_uri)
    if newest is None or checkpointed is newest:
        return ResumePoint(newest, [])
    since = checkpointed.version if checkpointed else 0
    wanted = {own[version].batch_id: version for version in own if since < version <= newest.version}
    batches = {delivery.event.batch_id: delivery.event
               for delivery in read_history(bus, "batches", storage_uri)
               if isinstance(delivery.event, BatchReady) and delivery.event.batch_id in wanted}
    missing = sorted(set(wanted) - set(batches))
    if missing or len(wanted) != newest.version - since:
        raise RuntimeError(f"the trainer cannot resume v{newest.version}: its newest checkpoint is of "
                           f"v{since}, and the batches of the versions after it are not all recorded "
                           f"(missing: {missing[:4]})")
    return ResumePoint(checkpointed, sorted(batches.values(), key=lambda batch: wanted[batch.batch_id]))
