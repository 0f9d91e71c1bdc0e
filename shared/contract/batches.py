"""Reward-complete training batches as Parquet: the reward service writes them, the trainer reads
them. One row per trainable segment. Beside each batch the trainer writes its own logprob of every token of
each segment it trained, before the batch's first update (<batch>.trainer-logprobs.parquet): set against the
rollout's, they show where the trainer and the inference engine disagree."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import pyarrow as pa

from rollstream.shared.contract.token_arrays import PackedArray
from rollstream.shared.runtime.storage import Storage

SCHEMA = pa.schema([
    ("sample_index", pa.int64()),
    ("trajectory_id", pa.string()),
    ("rollout_id", pa.string()),
    ("group_id", pa.string()),
    ("session_id", pa.string()),
    ("segment_index", pa.int32()),
    ("tokens", pa.list_(pa.int32())),
    ("response_length", pa.int32()),
    ("loss_mask", pa.list_(pa.int8())),
    ("rollout_logprobs", pa.list_(pa.float32())),
    ("turn_policy_versions", pa.list_(pa.int32())),
    ("status", pa.string()),
    ("reward", pa.float32()),
    ("advantage", pa.float32()),
    ("metadata", pa.string()),
    ("role", pa.string()),
])
SCHEMA_BEFORE_ROLES = SCHEMA.remove(SCHEMA.get_field_index("role"))
"""Batches written before rows carried their role: read with every row's role None (the default role)."""


@dataclass
class BatchRow:
    sample_index: int
    trajectory_id: str
    rollout_id: str
    group_id: str
    session_id: str
    segment_index: int
    tokens: Sequence[int]
    """A list when read back from Parquet, the segment's PackedArray as the reward service writes it; so are
    loss_mask and rollout_logprobs."""
    response_length: int
    loss_mask: Sequence[int]
    rollout_logprobs: Sequence[float]
    turn_policy_versions: list[int]
    status: str
    reward: float
    advantage: float
    metadata: dict[str, Any] = field(default_factory=dict)
    role: str | None = None
    """The role that sampled the segment and trains on it (TrajectorySegment.role); None: the run's
    default role. reward and advantage are that role's."""

    @property
    def min_policy_version(self) -> int:
        return min(self.turn_policy_versions) if self.turn_policy_versions else 0


def write_batch(storage: Storage, run_id: str, batch_id: str, rows: list[BatchRow]) -> str:
    table = pa.Table.from_pylist([_record(row) for row in rows], schema=SCHEMA)
    return storage.write_table(table, run_id, "batches", f"{batch_id}.parquet")


def _record(row: BatchRow) -> dict[str, Any]:
    record = {f.name: getattr(row, f.name) for f in fields(BatchRow)}
    for name, value in record.items():
        if isinstance(value, PackedArray):  # pyarrow copies a numpy array whole, a sequence item by item
            record[name] = value.numpy()
    record["metadata"] = json.dumps(row.metadata, sort_keys=True)
    return record


def read_batch(storage: Storage, path: str) -> list[BatchRow]:
    table = storage.read_table(path)
    if not table.schema.equals(SCHEMA) and not table.schema.equals(SCHEMA_BEFORE_ROLES):
        raise ValueError(f"{path}: batch schema differs from this code's: {table.schema}")
    return [BatchRow(**{**record, "metadata": json.loads(record["metadata"])})
            for record in table.to_pylist()]


TRAINER_LOGPROBS_SCHEMA = pa.schema([
    ("rollout_id", pa.string()),
    ("segment_index", pa.int32()),
    ("policy_version", pa.int32()),
    ("logprobs", pa.list_(pa.float32())),
])
TRAINER_LOGPROBS_SUFFIX = ".trainer-logprobs.parquet"


@dataclass
class TrainerLogprobs:
    rollout_id: str
    segment_index: int
    policy_version: int
    """The policy the trainer held: the batch was trained from it."""
    logprobs: list[float]
    """The trainer's logprob of each token of the segment given the tokens before it (0 at the first)."""


def trainer_logprobs_uri(batch_uri: str) -> str:
    """Where the trainer's logprobs of a batch's segments are, beside the batch."""
    return batch_uri.removesuffix(".parquet") + TRAINER_LOGPROBS_SUFFIX


def write_trainer_logprobs(storage: Storage, run_id: str, batch_id: str, rows: list[TrainerLogprobs]) -> str:
    table = pa.Table.from_pylist([asdict(row) for row in rows], schema=TRAINER_LOGPROBS_SCHEMA)
    return storage.write_table(table, run_id, "batches", f"{batch_id}{TRAINER_LOGPROBS_SUFFIX}")


def read_trainer_logprobs(storage: Storage, path: str) -> list[TrainerLogprobs]:
    table = storage.read_table(path)
    if not table.schema.equals(TRAINER_LOGPROBS_SCHEMA):
        raise ValueError(f"{path}: trainer logprobs schema differs from this code's: {table.schema}")
    return [TrainerLogprobs(**record) for record in table.to_pylist()]
