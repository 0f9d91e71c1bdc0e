import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollstream.shared.errors import DatasetError
from rollstream.shared.tasks.datasets import arithmetic_dataset, load_dataset


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_rows_become_chat_prompts(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "What is 2 + 2?", "label": 4},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
         "answer": "hello", "sandbox_check": "true", "metadata": {"k": 1}},
    ])
    rows = load_dataset(path)
    assert rows[0].messages == [{"role": "user", "content": "What is 2 + 2?"}]
    assert rows[0].label == "4" and rows[0].sandbox_check is None
    assert rows[1].messages[0]["role"] == "system" and rows[1].label == "hello"
    assert rows[1].sandbox_check == "true" and rows[1].metadata == {"k": 1}


def test_parquet_rows_load(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "label": "1"}, {"prompt": "b", "label": "2"}]), path)
    assert [r.label for r in load_dataset(path)] == ["1", "2"]


def test_row_missing_its_prompt_is_named(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl",
                       [{"prompt": "ok"}, {"prompt": "ok"}, {"question": "where?", "label": 1}])
    with pytest.raises(DatasetError,
                       match=r"d\.jsonl row 2: missing 'prompt' \(columns present: label, question\)"):
        load_dataset(path)


def test_parquet_row_with_empty_prompt_is_named(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}, {"prompt": None}]), path)
    with pytest.raises(DatasetError, match=r"d\.parquet row 1: missing 'prompt'"):
        load_dataset(path)


def test_a_rows_role_is_read_from_its_role_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "plan", "role": "planner"},
                                              {"prompt": "x", "role": ""}])
    assert [row.role for row in load_dataset(path)] == ["planner", None]


@pytest.mark.parametrize("content, message", [
    ("{not json\n", r"line 1: not JSON"),
    ('{"prompt": "a", "role": ["planner"]}\n', r"row 0: 'role' must be the name of one of the run's roles"),
    ('{"prompt": 5}\n', r"row 0: 'prompt' must be a string or a list"),
    ('[1, 2]\n', r"row 0: expected an object"),
])
def test_bad_rows_get_clear_errors(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_dataset(path)


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset file"):
        load_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("prompt\nx\n")
    with pytest.raises(DatasetError, match="unknown dataset format"):
        load_dataset(tmp_path / "d.csv")


def test_arithmetic_dataset_is_deterministic_and_labels_are_right():
    rows = arithmetic_dataset(20, seed=3, sandbox_every=4)
    assert rows == arithmetic_dataset(20, seed=3, sandbox_every=4)
    for row in rows:
        assert int(row.label) == row.metadata["a"] + row.metadata["b"]
    assert [i for i, r in enumerate(rows) if r.sandbox_check] == [3, 7, 11, 15, 19]
