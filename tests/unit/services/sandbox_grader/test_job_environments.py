"""A SWE grading job in its row's environment: the grader's environments directory travels in the request,
the job builds the row's environment there on its first grading, and the tests run in it (real bubblewrap,
real pip from PyPI).

    python -m pytest tests/unit/services/sandbox_grader/test_job_environments.py -q   (needs bwrap and PyPI)
"""

from pathlib import Path

from rollstream.services.sandbox_grader.jobs import GradeRequest, backend_options, grade
from rollstream.shared.runtime.storage import Storage
from rollstream.shared.tasks.environment_spec import environment_spec
from rollstream.shared.tasks.swebench import load_swebench_rows
from tests.support import FIXTURES
from tests.unit.shared.sandbox.test_venv_environments import environments_root, pytestmark  # noqa: F401

ENV_ROWS = FIXTURES / "swebench-env" / "rows.jsonl"


def swe_request(tmp_path, **overrides) -> GradeRequest:
    [task] = load_swebench_rows(ENV_ROWS)
    fields = dict(run_id="r", storage_uri=str(tmp_path), backend="bubblewrap", ids={"rollout_id": "x"},
                  wall_time_s=60, memory_mb=1024,
                  grader={"kind": "swebench", "dataset": str(ENV_ROWS), "instance_id": task.instance_id})
    return GradeRequest(**{**fields, **overrides})


def test_the_environments_directory_reaches_only_the_bubblewrap_backend(tmp_path):
    assert backend_options(swe_request(tmp_path)) == {}
    assert backend_options(swe_request(tmp_path, backend="docker", environments_dir="/srv/envs")) == {}
    assert backend_options(swe_request(tmp_path, environments_dir="/srv/envs")) == {
        "environments_dir": Path("/srv/envs")}


def test_a_swe_job_builds_its_rows_environment_in_the_graders_directory_and_grades_in_it(tmp_path):
    [task] = load_swebench_rows(ENV_ROWS)
    with environments_root() as root:
        outcome = grade(swe_request(tmp_path, environments_dir=str(root)), Storage(str(tmp_path)))
        assert (root / environment_spec(task).key / "rollstream-environment.json").is_file()
    # the empty diff: srcstats imports (PASS_TO_PASS passes) and the failing test still fails
    assert (outcome.score, outcome.infrastructure_error) == (0.0, False), outcome.reason
    assert outcome.reason.startswith("FAIL_TO_PASS 0/1 passed, PASS_TO_PASS 2/2 passed"), outcome.reason
