"""What the trainer takes from a batch before it trains (services/trainer/training.py): the batch file the
event announces, and of its rows those the next policy may learn from.

read_announced_batch reads the batch file and checks that it is the batch the event announces
(BatchRejected otherwise: that entry's failure, retried and then dead-lettered, while the trainer goes on).
take_rows sorts the rows by role (BatchRow.role, None the default role): a row of a frozen role is left out
(`frozen`: never trained), one of a role the run does not have too (`unknown_role`, logged as an error that
names the run's roles). Of each trained role's rows, usable_rows leaves out those no model could train on
(row_problem: token ids outside the vocabulary, longer than the model's positions, misaligned, non-finite or
from a version of the role's policy not published yet: dropped as `invalid`, each logged), and select_fresh
the samples older than eta versions of their role's policy (is_stale, which the chaos audit applies too).

Tests: tests/unit/services/trainer/test_batch_checks.py, test_lora_trainer.py (the roles).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rollstream.shared.contract.batches import BatchRow, read_batch
from rollstream.shared.contract.events import BatchReady
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.errors import RollstreamError, UnknownRole
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


@dataclass
class Intake:
    """A batch's rows as the trainer takes them, by trained role (in the run's order of its roles, the same on
    every rank)."""

    fresh: dict[str, list[BatchRow]]
    """The rows each role's policy learns from."""
    usable: dict[str, list[BatchRow]]
    """The rows any model could train on, stale ones included (a probe's candidates)."""
    dropped: dict[str, int]
    """Rows left out, by reason: frozen, unknown_role, invalid, stale."""


def take_rows(rows: list[BatchRow], roles: RunRoles, role_versions: dict[str, int], vocab_size: int,
              max_positions: int | None, max_staleness: int) -> Intake:
    """The rows each trained role learns from: its own, usable (row_problem, against the role's version) and
    not stale by the role's version (is_stale); the others counted by reason."""
    by_role: dict[str, list[BatchRow]] = {role: [] for role in roles.trained}
    dropped: Counter[str] = Counter()
    unknown: dict[str | None, tuple[int, str]] = {}
    for row in rows:
        try:
            role = roles.resolve(row.role)
        except UnknownRole as exc:
            count, _ = unknown.get(row.role, (0, ""))
            unknown[row.role] = (count + 1, str(exc))
            continue
        if role in by_role:
            by_role[role].append(row)
        else:
            dropped["frozen"] += 1
    for role, (count, error) in unknown.items():
        log.error("batch rows of a role this run does not have left out", extra={"role": role, "rows": count,
                                                                                  "error": error})
        dropped["unknown_role"] += count
    intake = Intake(fresh={}, usable={}, dropped={})
    for role, role_rows in by_role.items():
        usable, invalid = usable_rows(role_rows, vocab_size, max_positions, role_versions[role])
        fresh, left_out = select_fresh(usable, role_versions[role], max_staleness)
        intake.usable[role], intake.fresh[role] = usable, fresh
        dropped["invalid"] += invalid
        dropped.update(left_out)
    intake.dropped = {reason: count for reason, count in dropped.items() if count}
    return intake
