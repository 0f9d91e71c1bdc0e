"""A SWE row's EnvironmentSpec: where it comes from (install_config, the row's own install and python,
environments.json beside the dataset, the default for a published row with a clone), its key, the tree it
installs from, rows without one, and the errors that name the row and the field. Nothing is built here.

    python -m pytest tests/unit/shared/tasks/test_environment_spec.py -q
"""

import json
import shutil
import subprocess

import pytest

from rollstream.shared.errors import TaskError
from rollstream.shared.tasks.environment_spec import DEFAULT_INSTALL, EnvironmentSpec, environment_spec
from rollstream.shared.tasks.swebench import load_swebench_rows
from tests.support import FIXTURES
from tests.unit.shared.tasks.test_swebench_real import (
    MORE_ITERTOOLS,
    REAL_ROWS,
    SEMVER,
    clone_bundles,
    published_rows,
    swesmith_row,
    write_rows,
)

ENV_ROWS = FIXTURES / "swebench-env" / "rows.jsonl"


@pytest.fixture(scope="module")
def clones(tmp_path_factory):
    return clone_bundles(tmp_path_factory.mktemp("clones") / "repos")


def semver_row() -> dict:
    [row] = [r for r in published_rows() if r["instance_id"] == SEMVER]
    return row


def spec_of(tmp_path, record, repos_dir, environments=None):
    if environments is not None:
        (tmp_path / "environments.json").write_text(json.dumps(environments))
    [task] = load_swebench_rows(write_rows(tmp_path / "rows.jsonl", [record]), repos_dir=repos_dir)
    return environment_spec(task)


def test_rows_that_bring_their_own_snapshot_and_name_no_install_have_no_environment():
    for rows in (FIXTURES / "swebench" / "rows.jsonl", FIXTURES / "swebench-broken" / "rows.jsonl"):
        tasks = load_swebench_rows(rows)
        assert tasks and all(task.environment_setup_commit for task in tasks)
        assert [environment_spec(task) for task in tasks] == [None] * len(tasks)


def test_a_published_row_with_a_clone_installs_its_repository_at_the_environment_commit(clones):
    semver, more = load_swebench_rows(REAL_ROWS, repos_dir=clones)
    spec = environment_spec(semver)
    assert spec == EnvironmentSpec(repo="python-semver/python-semver", commit=semver.environment_setup_commit,
                                   source=semver.repo_dir, install=DEFAULT_INSTALL)
    assert spec.key.startswith(f"python-semver__python-semver-{semver.environment_setup_commit[:12]}-")
    assert environment_spec(more).repo == "more-itertools/more-itertools"


def test_the_environment_commit_is_checked_out_of_the_clone_when_it_is_not_the_base_commit(tmp_path, clones):
    [more] = [r for r in published_rows() if r["instance_id"] == MORE_ITERTOOLS]
    repos = tmp_path / "repos"
    name = "more-itertools__more-itertools"
    clone = shutil.copytree(clones / name, repos / name)
    git = ["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(git + ["checkout", "-q", more["base_commit"]], check=True)
    (clone / "requirements-test.txt").write_text("hypothesis\n")
    subprocess.run(git + ["add", "requirements-test.txt"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "the environment's commit"], check=True)
    setup_commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                                  check=True).stdout.strip()
    spec = spec_of(tmp_path, {**more, "environment_setup_commit": setup_commit}, repos)
    assert spec.commit == setup_commit and spec.source == repos / ".snapshots" / clone.name / setup_commit
    assert (spec.source / "requirements-test.txt").read_text() == "hypothesis\n"
    [task] = load_swebench_rows(tmp_path / "rows.jsonl", repos_dir=repos)
    assert not (task.repo_dir / "requirements-test.txt").exists()  # the task still starts from base_commit


def test_install_config_comes_first_and_reads_swe_rebench_keys(tmp_path, clones):
    config = {"python": "3.11", "pre_install": ["apt-get install -y libfoo"],
              "pip_packages": ["pytest==8.3.4", "numpy<2"], "install": "pip install -e .",
              "test_cmd": "pytest -rA", "packages": "requirements.txt"}
    spec = spec_of(tmp_path, {**semver_row(), "install_config": config, "install": "ignored"}, clones,
                   environments={"python-semver/python-semver": {"install": "ignored too"}})
    assert spec.python == "3.11" and spec.pre_install == ("apt-get install -y libfoo",)
    assert spec.install == ("pip install pytest==8.3.4 'numpy<2'", "pip install -e .")


def test_the_rows_own_install_and_python_come_next(tmp_path, clones):
    spec = spec_of(tmp_path, {**semver_row(), "install": ["pip install -e .", "pip install hypothesis"],
                              "python": "3.11"}, clones, environments={"python-semver/python-semver": {}})
    assert spec.install == ("pip install -e .", "pip install hypothesis") and spec.python == "3.11"
    [task] = load_swebench_rows(ENV_ROWS)
    spec = environment_spec(task)
    assert spec.install == ("pip install -e .",) and spec.source == task.repo_dir  # no clone: its snapshot
    assert spec.key.startswith("rollstream__srcstats-9b2e4d7a1c3f-")


def test_environments_json_maps_a_repository_and_version_to_an_install(tmp_path, clones):
    environments = {"python-semver/python-semver": {"install": "pip install ."},
                    "python-semver/python-semver@3.0.1": {"install": "pip install -e .[test]",
                                                          "pip_packages": ["hypothesis"]}}
    spec = spec_of(tmp_path, semver_row(), clones, environments)
    assert spec.install == ("pip install hypothesis", "pip install -e .[test]")
    spec = spec_of(tmp_path, {**semver_row(), "version": "3.0.2"}, clones, environments)
    assert spec.install == ("pip install .",)


def test_the_key_is_stable_and_names_repository_commit_and_install(tmp_path, clones):
    plain = spec_of(tmp_path, semver_row(), clones)
    assert plain.key == spec_of(tmp_path, semver_row(), clones).key
    other = spec_of(tmp_path, {**semver_row(), "install": "pip install -e . pytest"}, clones)
    assert other.key != plain.key and other.key.rsplit("-", 1)[0] == plain.key.rsplit("-", 1)[0]
    assert len(plain.key) < 60 and "/" not in plain.key


def test_a_swesmith_row_names_its_published_image(tmp_path, clones):
    spec = spec_of(tmp_path, swesmith_row(clones), clones)
    record = swesmith_row(clones)
    assert spec.image_name == record["image_name"] and spec.install == ()
    assert spec.repo == "more-itertools/more-itertools" and record["repo"].endswith(spec.commit)


@pytest.mark.parametrize("change, message", [
    ({"install": 3}, r"row 0 \(python-semver__python-semver-426\): 'install' must be a command or a list"),
    ({"python": "three"}, r"row 0 \(.*\): 'python' must be a Python version string like \"3.11\", "
                          r"got 'three'"),
    ({"python": 3.1}, r"'python' must be a Python version string"),
])
def test_bad_row_fields_are_errors_naming_the_row_and_field(tmp_path, clones, change, message):
    with pytest.raises(TaskError, match=message):
        load_swebench_rows(write_rows(tmp_path / "rows.jsonl", [{**semver_row(), **change}]),
                           repos_dir=clones)


@pytest.mark.parametrize("config, message", [
    ({"pip_packages": "numpy"}, r"'install_config.pip_packages' must be a list of requirements"),
    ({"python": 3.9}, r"'install_config.python' must be a Python version string"),
    ({"pre_install": [1]}, r"'install_config.pre_install' must be a command or a list"),
])
def test_bad_install_config_values_are_errors_naming_the_row_and_field(tmp_path, clones, config, message):
    rows = write_rows(tmp_path / "rows.jsonl", [{**semver_row(), "install_config": config}])
    [task] = load_swebench_rows(rows, repos_dir=clones)
    with pytest.raises(TaskError, match=r"rows\.jsonl \(python-semver__python-semver-426\): " + message):
        environment_spec(task)


def test_a_bad_environments_json_names_the_file_and_key(tmp_path, clones):
    with pytest.raises(TaskError, match=r"environments\.json: 'python-semver/python-semver' must be an "
                                        r"object"):
        spec_of(tmp_path, semver_row(), clones, {"python-semver/python-semver": ["pip install ."]})
    (tmp_path / "environments.json").write_text("{not json")
    with pytest.raises(TaskError, match=r"environments\.json: cannot read it as JSON"):
        spec_of(tmp_path, semver_row(), clones)
