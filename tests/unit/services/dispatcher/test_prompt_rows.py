"""The rows the dispatcher issues (services/dispatcher/main.py prompt_rows): a row's role is checked against
the run's roles as the dataset is read, and a row naming a role the run does not have stops the dispatcher
with the row named.

    python -m pytest tests/unit/services/dispatcher/test_prompt_rows.py -q
"""

from __future__ import annotations

import json

import pytest

from rollstream.services.dispatcher.main import prompt_rows
from rollstream.shared.errors import DatasetError
from rollstream.shared.runtime.config import Settings

ROLES = {"roles": {"names": {"planner": {}, "solver": {}}}, "train": {"lora_rank": 8}}


def dataset(tmp_path, *roles: str | None):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"task {index}", **({"role": role} if role else {})}) + "\n"
                            for index, role in enumerate(roles)))
    return path


def test_rows_keep_the_roles_they_name_and_none_where_they_name_none(tmp_path):
    rows = prompt_rows(Settings(data={"path": dataset(tmp_path, "solver", None, "planner")}, **ROLES))
    assert [row.role for row in rows] == ["solver", None, "planner"]


def test_a_row_naming_a_role_the_run_does_not_have_is_refused_by_its_place(tmp_path):
    path = dataset(tmp_path, "solver", "coder")
    with pytest.raises(DatasetError, match=r"d\.jsonl row 1: role 'coder' is not one of this run's roles "
                                           r"\(planner, solver"):
        prompt_rows(Settings(data={"path": path}, **ROLES))
    with pytest.raises(DatasetError, match=r"row 0: role 'solver' is not one of this run's roles \(policy"):
        prompt_rows(Settings(data={"path": path}))
