"""A SWE row's environment under the docker backend (shared/sandbox/docker_environments.py), on a real
engine: the src-layout row of tests/fixtures/tasks/swebench-broken, which the sandbox's own Python cannot
import, given `pip install -e .` as its install, is built into its image once (the module's fixture),
reused by the next prepare, and grades reference 1 and empty diff 0 in it, its tests importing the graded
tree. A published SWE-bench image the engine has is used; a published image that cannot be pulled (no
registry answers here) and a failed build are clear errors, and grading reports them as infrastructure
errors, never as scores. The order in which an image is chosen is also checked against a mocked engine.

    python -m pytest tests/unit/shared/sandbox/test_docker_environments.py -q   (skipped without an engine)
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path
from unittest import mock

import pytest
from docker.errors import ImageNotFound

from rollstream.shared.grading.swebench import grade_swebench
from rollstream.shared.grading.validation import validate_tasks
from rollstream.shared.sandbox.base import SandboxLimits
from rollstream.shared.sandbox.docker import STANDARD_PATH, DockerBackend
from rollstream.shared.sandbox.docker_environments import (
    ENV_VENV,
    LABEL_PREFIX,
    EnvironmentImageError,
    env_image_tag,
    image_workdir,
    prepare_image,
    row_image,
    swebench_image_name,
)
from rollstream.shared.tasks.environment_spec import environment_spec
from rollstream.shared.tasks.swebench import load_swebench_rows
from tests.support import FIXTURES

SRC_LAYOUT = "rollstream__srcstats-1"
LIMITS = SandboxLimits(wall_time_s=60, cpu_time_s=60, memory_mb=512, max_processes=64)
UNPULLABLE = "swesmith.x86_64.rollstream__nosuch.deadbeef"


def src_layout_row(**changes) -> dict:
    """The swebench-broken src-layout row (its package under src/, no pytest pythonpath), its snapshot
    named by an absolute repo_dir so that the row can be written anywhere."""
    lines = (FIXTURES / "swebench-broken" / "rows.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    [row] = [r for r in rows if r["instance_id"] == SRC_LAYOUT]
    row["repo_dir"] = str(FIXTURES / "swebench-broken" / "repos" / "src-layout")
    return {**row, **changes}


def load_row(directory: Path, **changes):
    path = directory / "rows.jsonl"
    path.write_text(json.dumps(src_layout_row(**changes)) + "\n")
    [task] = load_swebench_rows(path)
    return task


def remove_image(client, name: str) -> None:
    try:
        client.images.remove(name, force=True)
    except ImageNotFound:
        pass


@pytest.fixture(scope="module")
def engine(docker_engine):
    return docker_engine


@pytest.fixture(scope="module")
def built(engine, tmp_path_factory):
    """The src-layout row with `pip install -e .`, its image built here (any earlier one removed first, so
    that this is a real build) and removed at the end: (task, spec, the prepare's result, its progress)."""
    task = load_row(tmp_path_factory.mktemp("rows"), install="pip install -e .")
    spec = environment_spec(task)
    remove_image(engine, env_image_tag(spec.key))
    progress: list[str] = []
    prepared = prepare_image(spec, DockerBackend(), progress.append, task.instance_id)
    yield task, spec, prepared, progress
    remove_image(engine, env_image_tag(spec.key))


def test_the_swebench_image_name_follows_the_harness_naming():
    assert swebench_image_name("django__django-11099") == \
        "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert swebench_image_name("Pylint-Dev__Astroid-1196") == \
        "swebench/sweb.eval.x86_64.pylint-dev_1776_astroid-1196:latest"
    assert image_workdir(swebench_image_name("django__django-11099")) == "/testbed"
    assert image_workdir("rollstream-env/x:latest") == image_workdir(None) == "/workspace"


def test_a_row_environment_is_built_once_with_the_spec_in_its_labels(engine, built):
    task, spec, prepared, progress = built
    assert (prepared.action, prepared.image, prepared.key) == ("built", env_image_tag(spec.key), spec.key)
    assert prepared.image.startswith("rollstream-env/rollstream__srcstats-") and prepared.size_mb > 1
    assert any(line.startswith("building rollstream-env/") for line in progress), progress
    labels = engine.images.get(prepared.image).labels
    assert labels[f"{LABEL_PREFIX}key"] == spec.key
    assert json.loads(labels[f"{LABEL_PREFIX}install"]) == ["pip install -e ."]
    again = prepare_image(spec, DockerBackend(), instance_id=task.instance_id)
    assert (again.action, again.image) == ("reused", prepared.image) and again.seconds < 5


def test_the_tests_import_the_graded_tree_not_the_images_copy(built, tmp_path):
    """The editable install points at /workspace, where grading mounts the graded tree: a change to it is
    what `import srcstats` runs, and the image's PATH puts the environment's Python first."""
    _, _, prepared, _ = built
    backend = DockerBackend()
    snapshot = FIXTURES / "swebench-broken" / "repos" / "src-layout"
    unfixed, fixed = (shutil.copytree(snapshot, tmp_path / name) for name in ("unfixed", "fixed"))
    core = fixed / "src" / "srcstats" / "core.py"
    core.write_text(core.read_text().replace("max(values) - values[0]", "max(values) - min(values)"))
    probe = ("command -v python; "
             "python -c 'import srcstats; print(srcstats.__file__, srcstats.spread([3, 1, 2]))'")
    seen = backend.run(probe, fixed, limits=LIMITS, image=prepared.image)
    assert seen.exit_code == 0, seen
    assert seen.stdout.split() == [f"{ENV_VENV}/bin/python", "/workspace/src/srcstats/__init__.py", "2"]
    as_snapshot = backend.run(probe, unfixed, limits=LIMITS, image=prepared.image)
    assert as_snapshot.stdout.split()[-1] == "0", as_snapshot


def test_the_row_grades_reference_1_and_empty_0_in_its_image(built):
    """Without its environment the row's tests cannot import srcstats (test_validation.py: environment
    broken); in its image they can, and only the reference fix passes them."""
    task, _, prepared, _ = built
    backend = DockerBackend()
    assert row_image(backend, task) == prepared.image
    [result] = validate_tasks([task], backend)
    assert (result.reference_score, result.empty_score, result.ok) == (1, 0, True), result


def test_the_prepare_command_reuses_the_image_and_checks_it(built, tmp_path):
    """`rollstream environments prepare --backend docker` finds the row's image built, and pytest in it
    collects the row's FAIL_TO_PASS tests."""
    from typer.testing import CliRunner

    from rollstream.cli.main import app

    _, spec, _, _ = built
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(src_layout_row(install="pip install -e .")) + "\n")
    result = CliRunner().invoke(app, ["environments", "prepare", str(rows), "--backend", "docker"],
                                env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    [line] = [line for line in result.output.splitlines() if spec.key in line]
    assert "reused" in line and line.rstrip(" │|").endswith("ok"), result.output


def test_a_published_swebench_image_on_this_engine_is_used(engine, built, tmp_path):
    """A local image with SWE-bench's name of the instance (built FROM the base image, its repository at
    /testbed as SWE-bench's are) comes before the image built from the spec."""
    task, spec, _, _ = built
    name = swebench_image_name(task.instance_id)
    context = io.BytesIO()
    dockerfile = (f"FROM {DockerBackend().default_image}\n"
                  "RUN mkdir /testbed && echo published > /testbed/ORIGIN\n")
    with tarfile.open(fileobj=context, mode="w") as archive:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        archive.addfile(info, io.BytesIO(dockerfile.encode()))
    context.seek(0)
    engine.images.build(fileobj=context, custom_context=True, tag=name, rm=True, pull=False)
    try:
        prepared = prepare_image(spec, DockerBackend(), instance_id=task.instance_id)
        assert (prepared.image, prepared.action) == (name, "reused")
        assert row_image(DockerBackend(), task) == name
        origin = DockerBackend().run("cat /testbed/ORIGIN", tmp_path, limits=LIMITS, image=name)
        assert origin.stdout.strip() == "published", origin
    finally:
        remove_image(engine, name)


def test_a_published_image_that_cannot_be_pulled_is_an_infrastructure_error(engine, tmp_path):
    task = load_row(tmp_path, image_name=UNPULLABLE)
    with pytest.raises(EnvironmentImageError) as raised:
        row_image(DockerBackend(), task)
    message = str(raised.value)
    assert f"published image {UNPULLABLE} is not on this machine and could not be pulled" in message
    assert "install commands" in message and "rollstream environments prepare" in message
    outcome = grade_swebench(task, task.gold_patch, DockerBackend())
    assert outcome.infrastructure_error and UNPULLABLE in outcome.reason, outcome


def test_a_failed_build_is_an_infrastructure_error_with_the_build_logs_tail(engine, tmp_path):
    task = load_row(tmp_path, install=["echo the-install-ran", "echo no-such-package >&2; exit 3"])
    spec = environment_spec(task)
    try:
        with pytest.raises(EnvironmentImageError) as raised:
            prepare_image(spec, DockerBackend())
        message = str(raised.value)
        assert message.startswith(f"building {env_image_tag(spec.key)} failed:") and "code: 3" in message
        # the failing command's own output, from the build log's tail (the step before may come from the
        # engine's layer cache, without its output)
        tail = message.splitlines()
        assert "no-such-package" in tail and any("echo the-install-ran" in line for line in tail), message
        outcome = grade_swebench(task, task.gold_patch, DockerBackend())
        assert outcome.infrastructure_error and "no-such-package" in outcome.reason, outcome
    finally:
        remove_image(engine, env_image_tag(spec.key))


# the order of choice, against a mocked engine


def mocked_backend(images: set[str], pull_fails: bool) -> DockerBackend:
    client = mock.MagicMock(name="docker-client")

    def get(name):
        if name not in images:
            raise ImageNotFound(name)
        return mock.MagicMock(attrs={"Size": 12_345_678, "Config": {"Env": ["PATH=/venv/bin:/usr/bin"]}})

    def pull(repository, tag):
        if pull_fails:
            raise ImageNotFound(f"pull access denied for {repository}")
        images.add(f"{repository}:{tag}")

    def build(**options):
        images.add(options["tag"])
        return iter([{"stream": "Step 1/2 : FROM python:3.11-slim\n"}])

    client.images.get.side_effect = get
    client.images.pull.side_effect = pull
    client.api.build.side_effect = build
    return DockerBackend(client=client)


def spec_of(tmp_path, **changes):
    return dataclasses.replace(environment_spec(load_row(tmp_path, install="pip install -e .")), **changes)


def test_a_named_image_is_pulled_and_else_built_from_the_repository(tmp_path):
    spec = spec_of(tmp_path, image_name="owner/env:1")
    pulled = prepare_image(spec, mocked_backend(set(), pull_fails=False))
    assert (pulled.image, pulled.action, pulled.size_mb) == ("owner/env:1", "pulled", 12.3)
    backend = mocked_backend(set(), pull_fails=True)
    built = prepare_image(spec, backend)
    assert (built.image, built.action) == (env_image_tag(spec.key), "built")
    [note] = built.notes
    assert note.startswith("could not pull owner/env:1 (") and "built from the repository" in note
    assert backend.client.api.build.call_args.kwargs["pull"] is False
    with pytest.raises(EnvironmentImageError, match=r"owner/env:1 is not on this machine and could not be "
                                                    r"pulled \(.*pull access denied"):
        prepare_image(dataclasses.replace(spec, install=()), mocked_backend(set(), pull_fails=True))


def test_a_built_image_is_reused_before_pulling_and_the_swebench_name_is_never_pulled(tmp_path):
    spec = spec_of(tmp_path)
    backend = mocked_backend({env_image_tag(spec.key)}, pull_fails=True)
    reused = prepare_image(spec, backend, instance_id="owner__name-1")
    assert (reused.image, reused.action) == (env_image_tag(spec.key), "reused")
    backend.client.images.pull.assert_not_called()
    backend.client.api.build.assert_not_called()
    fresh = mocked_backend(set(), pull_fails=True)
    assert prepare_image(spec, fresh, instance_id="owner__name-1").action == "built"
    fresh.client.images.pull.assert_not_called()


def test_grading_remembers_a_rows_image_while_the_engine_keeps_it(tmp_path):
    task = load_row(tmp_path, install="pip install -e .")
    images: set[str] = set()
    backend = mocked_backend(images, pull_fails=True)
    tag = env_image_tag(environment_spec(task).key)
    assert row_image(backend, task) == row_image(backend, task) == tag
    assert backend.client.api.build.call_count == 1
    images.discard(tag)  # removed from the engine (docker image prune): built again, not a failed run
    assert row_image(backend, task) == tag and backend.client.api.build.call_count == 2


def test_a_run_takes_the_path_its_image_sets(tmp_path):
    backend = mocked_backend({"with-venv"}, pull_fails=False)
    container = backend.client.containers.create.return_value
    container.wait.return_value = {"StatusCode": 0}
    container.attach.return_value = iter([])
    backend.run("true", tmp_path, limits=LIMITS, image="with-venv")
    assert backend.client.containers.create.call_args.kwargs["environment"]["PATH"] == "/venv/bin:/usr/bin"
    backend.run("true", tmp_path, limits=LIMITS, image="not-here", env={"A": "1"})
    assert backend.client.containers.create.call_args.kwargs["environment"]["PATH"] == STANDARD_PATH


def test_a_row_without_an_environment_keeps_the_default_image(tmp_path):
    backend = mocked_backend(set(), pull_fails=True)
    assert row_image(backend, load_row(tmp_path)) is None
    backend.client.api.build.assert_not_called()


def test_the_tree_is_copied_into_the_image_without_its_git_history(tmp_path):
    """The copy leaves out .git: a clone's history is not part of the environment."""
    tree = shutil.copytree(FIXTURES / "swebench-broken" / "repos" / "src-layout", tmp_path / "tree")
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    spec = dataclasses.replace(spec_of(tmp_path), source=tree)
    backend = mocked_backend(set(), pull_fails=True)
    contexts = []
    backend.client.api.build.side_effect = lambda **options: (
        contexts.append(sorted(p.relative_to(options["path"]).as_posix()
                               for p in Path(options["path"]).rglob("*"))) or iter([{"error": "stop"}]))
    with pytest.raises(EnvironmentImageError, match="failed: stop"):
        prepare_image(spec, backend)
    assert "tree/src/srcstats/core.py" in contexts[0] and "Dockerfile" in contexts[0]
    assert not any(path.startswith("tree/.git") for path in contexts[0])
