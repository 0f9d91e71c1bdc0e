"""The trainer's logprobs of a batch's segments (services/trainer/training.py): kept, by (rollout id,
segment index), as the optimizer steps compute them before the batch's first update, then written beside
the batch for the console, and compared with the rollout's (the logprob gap, a step statistic).

Tests: tests/integration/test_local_run.py reads them back from a real run.
"""

from __future__ import annotations

from rollstream.shared.contract.batches import BatchRow, TrainerLogprobs, write_trainer_logprobs
from rollstream.shared.runtime.storage import Storage

SegmentLogprobs = dict[tuple[str, int], list[float]]
"""(rollout id, segment index) -> the trainer's logprob of each of the segment's tokens."""


def keep_logprobs(kept: SegmentLogprobs, rows: list[BatchRow], micro, logprobs) -> None:
    """Each sample's values of a micro-batch's [R, T] logprobs, by (rollout id, segment index)."""
    for index, values in micro.per_sample(logprobs).items():
        kept[(rows[index].rollout_id, rows[index].segment_index)] = values


def record_logprobs(storage: Storage, run_id: str, batch_id: str, version: int, rows: list[BatchRow],
                    before: SegmentLogprobs) -> float:
    """Write the trainer's logprobs of the batch's segments beside the batch (for the console); returns
    the mean gap between them and the rollout's over the sampled tokens."""
    records = [TrainerLogprobs(rollout_id=rollout, segment_index=segment, policy_version=version,
                               logprobs=values) for (rollout, segment), values in sorted(before.items())]
    write_trainer_logprobs(storage, run_id, batch_id, records)
    gaps = []
    for row in rows:
        mine = before.get((row.rollout_id, row.segment_index))
        if mine is not None:
            # a sample's first token has no trainer logprob (nothing to condition on)
            pairs = list(zip(mine, row.rollout_logprobs, row.loss_mask))[1:]
            gaps += [abs(a - b) for a, b, sampled in pairs if sampled]
    return sum(gaps) / len(gaps) if gaps else 0.0
