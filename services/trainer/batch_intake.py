"""What the trainer takes from a batch before it trains (services/trainer/training.py): the batch file the
event announces, and of its rows those the next policy may learn from.

read_announced_batch reads the batch file and checks that it is the batch the event announces
(BatchRejected otherwise: that entry's failure, retried and then dead-lettered, while the trainer goes on).
usable_rows leaves out the rows no model could train on (row_problem: token ids outside the vocabulary,
longer than the model's positions, misaligned, non-finite or from a policy version not published yet:
dropped as `invalid`, each logged), and select_fresh the samples older than eta versions (is_stale, which
the chaos audit applies too).

Tests: tests/unit/services/trainer/test_batch_checks.py.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from rollstream.shared.contract.batches import BatchRow, read_batch
from rollstream.shared.contract.events import BatchReady
from rollstream.shared.errors import RollstreamError
from rollstream.shared.runtime.storage import Storage

log = logging.getLogger("trainer")


class BatchRejected(RollstreamError, ValueError):
    """A BatchReady the trainer cannot train on: its file cannot be read, or is not the batch the event
    announces. The entry's failure, never the trainer's: `retryable` ones (the file could not be read)
    are retried and then dead-lettered, the others are dead-lettered at once."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def read_announced_batch(storage: Storage, batch: BatchReady) -> list[BatchRow]:
    """The batch's rows; BatchRejected when its file cannot be read or is not the batch announced."""
    if Path(batch.uri).name != f"{batch.batch_id}.parquet":
        # The reward service names every batch file after its batch id: anything else is another
        # batch (trained under its own id) or no batch at all.
        raise BatchRejected(f"batch {batch.batch_id} announces {batch.uri}, which is not its file",
                            retryable=False)
    try:
        rows = read_batch(storage, batch.uri)
    except Exception as exc:  # missing, unreadable, not Parquet, another schema: whatever the file is
        raise BatchRejected(f"batch {batch.batch_id}: cannot read {batch.uri}: "
                            f"{type(exc).__name__}: {exc}", retryable=True) from exc
    groups = {row.group_id for row in rows}
    if len(rows) != batch.sample_count or groups != set(batch.group_ids):
        raise BatchRejected(f"batch {batch.batch_id}: {batch.uri} holds {len(rows)} rows of groups "
                            f"{sorted(groups)[:4]}, the event announces {batch.sample_count} of "
                            f"{sorted(batch.group_ids)[:4]}", retryable=False)
    return rows


def row_problem(row: BatchRow, vocab_size: int, max_positions: int | None, version: int) -> str | None:
    """Why no model could train on this row, or None. A row comes from a decoded, validated segment,
    so any of these means the file was not written by the reward service from such segments."""
    n = len(row.tokens)
    if not n or len(row.loss_mask) != n or len(row.rollout_logprobs) != n:
        return (f"tokens ({n}), loss_mask ({len(row.loss_mask)}) and rollout_logprobs "
                f"({len(row.rollout_logprobs)}) differ")
    if max_positions is not None and n > max_positions:
        return f"{n} tokens, the model has {max_positions} positions"
    if min(row.tokens) < 0 or max(row.tokens) >= vocab_size:
        return f"token ids {min(row.tokens)}..{max(row.tokens)} outside the vocabulary (0..{vocab_size - 1})"
    if not set(row.loss_mask) <= {0, 1}:
        return f"loss_mask holds {sorted(set(row.loss_mask) - {0, 1})}, not only 0 and 1"
    if not all(map(math.isfinite, (row.reward, row.advantage, *row.rollout_logprobs))):
        return "reward, advantage or a logprob is not finite"
    if any(v < 0 or v > version for v in row.turn_policy_versions):
        return f"turn policy versions {row.turn_policy_versions}: the latest published is {version}"
    return None


def usable_rows(rows: list[BatchRow], vocab_size: int, max_positions: int | None,
                version: int) -> tuple[list[BatchRow], int]:
    """The rows a model can train on, and how many were left out (each logged with its problem)."""
    usable = []
    for row in rows:
        problem = row_problem(row, vocab_size, max_positions, version)
        if problem is None:
            usable.append(row)
        else:
            log.warning("batch row left out", extra={"rollout_id": row.rollout_id,
                                                     "segment_index": row.segment_index,
                                                     "problem": problem})
    return usable, len(rows) - len(usable)


def is_stale(row: BatchRow, version: int, max_staleness: int) -> bool:
    """Whether the policy after `version` may not learn from `row`: a turn of it was produced more than eta
    (max_staleness) versions ago."""
    return row.min_policy_version < version - max_staleness


def select_fresh(rows: list[BatchRow], version: int,
                 max_staleness: int) -> tuple[list[BatchRow], dict[str, int]]:
    """The rows the policy after `version` may learn from (none is_stale). Returns them and the count left
    out per reason."""
    fresh = [r for r in rows if not is_stale(r, version, max_staleness)]
    return fresh, ({"stale": len(rows) - len(fresh)} if len(fresh) < len(rows) else {})
