"""Reward: scores finished rollouts, computes group advantages, writes reward-complete batches.

Consumes `trajectories` (segments and finished rollouts), `grades` (sandbox results) and `dead` (a
dead-lettered event of a rollout means the rollout can never complete: it is dropped from its group). When
every rollout of a prompt group has finished, with all its segments and, where the task asks for one, its
sandbox grade, it assigns rewards (the grade, or a built-in rule), computes advantages
(train.advantage_estimator) over the group's rollouts (not its segments) and publishes RewardAssigned.
Whole groups are then packed into Parquet batches of train.batch_size rollouts, written atomically,
announced with BatchReady.

Every segment belongs to a role (roles.*; TrajectorySegment.role, none named: roles.default), and so does
its batch row, which is trained with its role's reward and advantage. A role with a reward function of its
own (roles.names.<role>.reward_function) is rewarded in each rollout with that function of the text of its
last segment in the rollout and the prompt's label; the other roles take the rollout's reward. Each role's
advantages are computed over the rollouts of the group that have a segment of it; RewardAssigned carries
them (role_advantages) beside the rollout's own reward and advantage. A segment of a role the run does not
have keeps it as written: the trainer refuses it.

Which groups share a batch is set by reward.batch_order. finished (the default): a group is sealed,
given the next sequence number, when the last of its rollouts' TrajectoryFinished is recorded, and
complete groups are released to the batches strictly in seal order, so a replay of the same
trajectories builds the same batches however its grades interleave; a group waiting for a grade holds
back the groups sealed after it (their RewardAssigned events are published all the same). completed:
a group is batched as soon as it is complete.

reward.function, when set, scores every rollout that did not fail with that function instead of the
one its prompt names, without waiting for sandbox grades (to re-score a recorded run).

With train.filter_zero_variance, a group in which no role's rewards differ between its rollouts
(advantage 0 everywhere: no learning signal) still gets its RewardAssigned events but is never batched;
its samples are added to the run's filtered counter, and the dispatcher admits as many again.

A rollout whose grading failed (GradingFailed: the sandbox could not run, not the rollout's fault or
merit), one with a dead-lettered event, and one whose grade has not come reward.grade_timeout_s after
its group's last rollout finished (a lost job) are never given a reward: each is left out of its
group's advantages and batch, announced with RolloutDropped (the reason) on `rewards`, counted in
/healthz `rollouts_dropped` by cause, and its sample slot is given back to the dispatcher the same way.
A group whose every rollout was dropped is batched not at all. One lost grade never holds back the
groups behind it for longer than the timeout. A batch holds whole groups, so after a drop it can hold
more than B rollouts; the surplus is given back too, since the dispatcher counts B per version.

Group state lives in Redis, so a restarted or duplicate delivery changes nothing: event ids are
deterministic, a group completes once, a batch's id is derived from its groups. A completed group is
remembered for reward.done_ttl_s (one expiring marker key each), long enough to ignore any late
redelivery of its events without keeping a set that grows with the run. The book
(services/reward/book.py) keeps all of this; this module feeds it the deliveries.

    rollstream-reward            # configured by RS_* variables or RS_CONFIG_FILE
"""

from __future__ import annotations

import time

from rollstream.services.reward.book import RewardBook
from rollstream.services.reward.roles import role_reward_functions
from rollstream.shared.contract.bus import Bus, Delivery, consumer_name, run_consumer
from rollstream.shared.contract.consumers import consumer_group
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.service import ServiceRuntime
from rollstream.shared.runtime.storage import Storage

GROUP = consumer_group("reward")
OVERDUE_CHECK_S = 5.0


def main() -> None:
    settings = Settings()
    runtime = ServiceRuntime("reward", settings)
    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    storage = Storage(settings.storage_uri)
    book = RewardBook(bus, storage, settings.train.batch_size, settings.train.advantage_estimator,
                      settings.train.filter_zero_variance, batch_order=settings.reward.batch_order,
                      reward_function=settings.reward.function, done_ttl_s=settings.reward.done_ttl_s,
                      group_size=settings.data.samples_per_prompt,
                      grade_timeout_s=settings.reward.grade_timeout_s, roles=RunRoles.of(settings),
                      role_reward_functions=role_reward_functions(settings.roles))
    consumer = consumer_name(GROUP.name)
    counts = {"groups_completed": 0, "batches": 0, **book.status()}

    def flush() -> None:
        for event in book.flush_batches(settings.run_id):
            counts["batches"] += 1
            runtime.log.info("batch ready", extra={"batch_id": event.batch_id, "samples": event.sample_count,
                                                   "mean_reward": round(event.mean_reward, 4)})

    def completed(groups: int) -> None:
        counts["groups_completed"] += groups
        counts.update(book.status())
        # on every delivery, not only after a completion: a batch whose writing failed is written again
        flush()
        runtime.status.update(counts)

    def handle(delivery: Delivery) -> None:
        group_id = book.record(delivery)
        completed(1 if group_id and book.complete_if_ready(group_id) else 0)

    next_overdue_check = 0.0

    def resolve_overdue() -> None:
        nonlocal next_overdue_check
        if time.monotonic() >= next_overdue_check:
            next_overdue_check = time.monotonic() + OVERDUE_CHECK_S
            completed(len(book.expire_overdue()))

    # what a crashed predecessor completed but had not released or batched yet
    book.release()
    flush()

    run_consumer(bus, GROUP, consumer, handle, runtime.should_stop, between_reads=resolve_overdue)
    runtime.close()


if __name__ == "__main__":
    main()
