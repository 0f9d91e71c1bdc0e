import pyarrow as pa

from rollstream.shared.contract.batches import BatchRow, read_batch, write_batch
from rollstream.shared.runtime.storage import Storage, replace_dir


def row(i: int) -> BatchRow:
    return BatchRow(sample_index=i, trajectory_id=f"t{i}", rollout_id=f"r{i}", group_id="g",
                    session_id=f"s{i}", segment_index=0, tokens=[1, 2, 3 + i], response_length=1,
                    loss_mask=[0, 0, 1], rollout_logprobs=[0.0, 0.0, -0.25], turn_policy_versions=[2],
                    status="completed", reward=1.0, advantage=0.5, metadata={"k": i})


def test_batch_round_trip_and_no_temporary_files_left(tmp_path):
    storage = Storage(str(tmp_path))
    path = write_batch(storage, "run", "b1", [row(0), row(1)])
    assert read_batch(storage, path) == [row(0), row(1)]
    assert sorted(p.name for p in (tmp_path / "run" / "batches").iterdir()) == ["b1.parquet"]


def test_reading_a_batch_of_another_schema_fails_with_the_path(tmp_path):
    storage = Storage(str(tmp_path))
    path = storage.write_table(pa.table({"x": [1]}), "run", "batches", "odd.parquet")
    try:
        read_batch(storage, path)
    except ValueError as exc:
        assert "odd.parquet" in str(exc)
    else:
        raise AssertionError("schema mismatch not detected")


def test_replace_dir_swaps_in_the_new_directory(tmp_path):
    final, temp = tmp_path / "ckpt", tmp_path / "ckpt.tmp"
    for directory, content in ((final, "old"), (temp, "new")):
        directory.mkdir()
        (directory / "w").write_text(content)
    replace_dir(temp, final)
    assert (final / "w").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
