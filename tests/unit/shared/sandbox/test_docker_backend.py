"""rollstream.shared.grading.DockerBackend against a mocked docker SDK client (no engine runs here), plus one
real-container test that is skipped when no Docker engine is reachable.

    python -m pytest tests/unit/shared/sandbox/test_docker_backend.py -q
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

import docker
import pytest
import requests
from docker.errors import DockerException, ImageNotFound
from docker.types import LogConfig, Ulimit

from rollstream.shared.errors import BackendUnavailable, SandboxError
from rollstream.shared.sandbox.backends import get_backend
from rollstream.shared.sandbox.base import SandboxLimits
from rollstream.shared.sandbox.docker import (
    OWNER_LABEL,
    DockerBackend,
    directory_hash,
    owner_is_gone,
    process_owner,
)

LIMITS = SandboxLimits(wall_time_s=7, cpu_time_s=7, memory_mb=256, max_processes=32,
                       max_file_size_mb=16, max_open_files=128, max_output_bytes=1000,
                       tmp_size_mb=16)


@pytest.fixture
def dirs():
    base = Path(tempfile.mkdtemp(prefix="rs-docker-test-"))
    base.chmod(0o711)
    for name in ("workspace", "tests", "logs"):
        (base / name).mkdir()
    (base / "workspace" / "a.txt").write_text("a\n")
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _client(wait=None, stdout=b"out\n", stderr=b"err\n"):
    client = mock.MagicMock(name="docker-client")
    container = client.containers.create.return_value
    if isinstance(wait, BaseException) or (isinstance(wait, type) and issubclass(wait, BaseException)):
        container.wait.side_effect = wait
    else:
        container.wait.return_value = wait or {"StatusCode": 0}
    # the attached stream, demultiplexed: (stdout chunk, stderr chunk) pairs
    container.attach.return_value = iter([(stdout, None), (None, stderr)])
    return client, container


def test_hardened_container_parameters(dirs):
    client, container = _client()
    backend = DockerBackend(client=client)
    result = backend.run("echo hi", dirs / "workspace", limits=LIMITS,
                         ro_mounts={"/tests": dirs / "tests"}, rw_mounts={"/logs": dirs / "logs"},
                         env={"WORKSPACE": "/workspace"}, image="rollstream-task:abc")
    assert (result.exit_code, result.stdout, result.stderr, result.timed_out) == (0, "out\n", "err\n", False)
    client.containers.create.assert_called_once()
    args, kwargs = client.containers.create.call_args
    assert args == ("rollstream-task:abc", ["/bin/sh", "-c", "echo hi"])
    assert kwargs == {
        "network_mode": "none",
        "read_only": True,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "mem_limit": "256m",
        "memswap_limit": "256m",
        "nano_cpus": 1_000_000_000,
        "pids_limit": 32,
        "user": "65534:65534",
        "tmpfs": {"/tmp": "size=16m,noexec"},
        "volumes": {
            str((dirs / "workspace").resolve()): {"bind": "/workspace", "mode": "rw"},
            str((dirs / "tests").resolve()): {"bind": "/tests", "mode": "ro"},
            str((dirs / "logs").resolve()): {"bind": "/logs", "mode": "rw"},
        },
        "working_dir": "/workspace",
        "environment": {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                        "HOME": "/workspace", "LANG": "C.UTF-8", "WORKSPACE": "/workspace"},
        "ulimits": [Ulimit(name="fsize", soft=16 * 1024 * 1024, hard=16 * 1024 * 1024),
                    Ulimit(name="nofile", soft=128, hard=128), Ulimit(name="core", soft=0, hard=0)],
        "log_config": LogConfig(type="none", config={}),
        "stdin_open": False, "tty": False, "auto_remove": False, "privileged": False,
        "ipc_mode": "none", "labels": {OWNER_LABEL: process_owner()},
    }
    # attached before the start: the output is read from its first byte, whatever follows
    assert [c[0] for c in container.method_calls[:2]] == ["attach", "start"]
    assert container.attach.call_args.kwargs == {"stdout": True, "stderr": True, "stream": True,
                                                 "logs": False, "demux": True}
    container.wait.assert_called_once_with(timeout=7)
    container.kill.assert_not_called()
    container.remove.assert_called_once_with(force=True)
    # the workspace is the caller's again afterwards (it was handed to uid 65534 for the run)
    assert (dirs / "workspace" / "a.txt").stat().st_uid == os.getuid()


def test_workspace_bind_and_working_dir_follow_the_workdir(dirs):
    client, container = _client()
    result = DockerBackend(client=client).run(
        "pytest /tests", dirs / "workspace", limits=LIMITS, ro_mounts={"/tests": dirs / "tests"},
        rw_mounts={"/logs": dirs / "logs"}, env={"WORKSPACE": "/app"}, image="rollstream-task:abc",
        workdir="/app/")
    assert result.exit_code == 0
    kwargs = client.containers.create.call_args.kwargs
    assert kwargs["volumes"] == {
        str((dirs / "workspace").resolve()): {"bind": "/app", "mode": "rw"},
        str((dirs / "tests").resolve()): {"bind": "/tests", "mode": "ro"},
        str((dirs / "logs").resolve()): {"bind": "/logs", "mode": "rw"},
    }
    assert kwargs["working_dir"] == "/app"
    assert kwargs["environment"]["HOME"] == "/app" and kwargs["environment"]["WORKSPACE"] == "/app"
    container.remove.assert_called_once_with(force=True)


@pytest.mark.parametrize("workdir, mounts, message", [
    ("app", {}, "workdir 'app' must be an absolute path"),
    ("/app/../etc", {}, "must be an absolute path without . or .."),
    ("/usr/src/app", {}, "workdir '/usr/src/app' is \\(under\\) the sandbox's /usr"),
    ("/proc", {}, "is \\(under\\) the sandbox's /proc"),
    ("/tmp/app", {}, "is \\(under\\) the sandbox's /tmp"),
    ("/app", {"/app/tests": "tests"}, "bind target '/app/tests' overlaps the workspace at /app"),
    ("/app", {"/etc/x": "tests"}, "bind target '/etc/x' is \\(under\\) the sandbox's /etc"),
])
def test_a_bad_workdir_or_mount_is_refused_before_any_container(dirs, workdir, mounts, message):
    client, _ = _client()
    with pytest.raises(SandboxError, match=message):
        DockerBackend(client=client).run("true", dirs / "workspace", limits=LIMITS, workdir=workdir,
                                         ro_mounts={t: dirs / h for t, h in mounts.items()})
    client.containers.create.assert_not_called()


def test_timeout_kills_and_removes(dirs):
    client, container = _client(wait=requests.exceptions.ReadTimeout("read timed out"))
    result = DockerBackend(client=client).run("sleep 100", dirs / "workspace", limits=LIMITS)
    assert result.timed_out and result.exit_code is None
    assert result.reason == "killed: wall-clock limit 7s"
    container.kill.assert_called_once()
    container.remove.assert_called_once_with(force=True)


def test_removed_even_when_waiting_fails(dirs):
    client, container = _client(wait=RuntimeError("engine went away"))
    with pytest.raises(RuntimeError):
        DockerBackend(client=client).run("true", dirs / "workspace", limits=LIMITS)
    container.remove.assert_called_once_with(force=True)


def test_output_is_capped(dirs):
    client, _ = _client(stdout=b"x" * 5000, wait={"StatusCode": 137})
    result = DockerBackend(client=client).run("yes", dirs / "workspace", limits=LIMITS)
    assert len(result.stdout) == 1000 and result.output_truncated
    assert result.exit_code == 137 and "SIGKILL" in result.reason


def test_image_build_is_cached_by_content_hash(tmp_path):
    env_dir = tmp_path / "environment"
    env_dir.mkdir()
    (env_dir / "Dockerfile").write_text("FROM debian:bookworm-slim\n")
    client = mock.MagicMock()
    client.images.get.side_effect = ImageNotFound("no such image")
    backend = DockerBackend(client=client)
    tag = backend.image_for(env_dir)
    assert tag == f"rollstream-task:{directory_hash(env_dir)[:32]}"
    client.images.build.assert_called_once()
    assert client.images.build.call_args.kwargs["path"] == str(env_dir)
    assert client.images.build.call_args.kwargs["tag"] == tag
    assert backend.image_for(env_dir) == tag  # second call: no build
    assert client.images.build.call_count == 1
    # another backend finds the tag on the engine: no build either
    other = mock.MagicMock()
    assert DockerBackend(client=other).image_for(env_dir) == tag
    other.images.get.assert_called_once_with(tag)
    other.images.build.assert_not_called()
    # a changed environment is a new image
    (env_dir / "Dockerfile").write_text("FROM debian:trixie-slim\n")
    assert backend.image_for(env_dir) != tag
    assert client.images.build.call_count == 2
    assert backend.image_for(None) is None


def test_no_engine_is_a_clear_error():
    with mock.patch.object(docker, "from_env", side_effect=DockerException("socket missing")):
        with pytest.raises(BackendUnavailable, match="no Docker engine reachable: socket missing"):
            get_backend("docker")


def test_start_failure_is_an_infrastructure_error(dirs):
    client, _ = _client()
    client.containers.create.side_effect = DockerException("boom")
    with pytest.raises(BackendUnavailable, match="could not start"):
        DockerBackend(client=client).run("true", dirs / "workspace", limits=LIMITS)


def a_dead_process_owner() -> str:
    """This process's owner label with the pid of a process that has exited."""
    child = subprocess.Popen(["true"])
    child.wait()
    host, namespace, _, _ = process_owner().split("/")
    return f"{host}/{namespace}/{child.pid}/123"


def test_only_the_containers_of_this_hosts_dead_processes_are_orphans():
    host, namespace, pid, started = process_owner().split("/")
    assert pid == str(os.getpid()) and started.isdigit()
    assert not owner_is_gone(process_owner())
    assert owner_is_gone(a_dead_process_owner())
    assert owner_is_gone(f"{host}/{namespace}/{pid}/{int(started) + 1}")  # the pid, reused by a later process
    assert not owner_is_gone(f"another-host/{namespace}/999999999/1")
    assert not owner_is_gone(f"{host}/1/999999999/1")  # another pid namespace: cannot be told from here
    assert not owner_is_gone("not an owner")


def test_orphaned_containers_are_removed_and_the_others_kept():
    client = mock.MagicMock(name="docker-client")
    containers = [mock.MagicMock(id=name, labels={OWNER_LABEL: owner})
                  for name, owner in (("ours", process_owner()), ("orphan", a_dead_process_owner()),
                                      ("elsewhere", "another-host/1/2/3"))]
    client.containers.list.return_value = containers
    assert DockerBackend(client=client).remove_orphaned_containers() == ["orphan"]
    client.containers.list.assert_called_once_with(all=True, filters={"label": OWNER_LABEL})
    assert [c.id for c in containers if c.remove.called] == ["orphan"]
    containers[1].remove.assert_called_once_with(force=True)


def test_the_containers_of_given_processes_are_found_whether_they_run_or_not():
    client = mock.MagicMock(name="docker-client")
    dead = a_dead_process_owner()
    host, namespace, _, _ = process_owner().split("/")
    client.containers.list.return_value = [
        mock.MagicMock(id=name, labels={OWNER_LABEL: owner})
        for name, owner in (("ours", process_owner()), ("dead", dead),
                            ("elsewhere", f"another-host/{namespace}/1/2"),
                            ("other-namespace", f"{host}/1/{os.getpid()}/2"), ("unlabelled", "not an owner"))]
    dead_pid = int(dead.split("/")[2])
    assert DockerBackend(client=client).containers_of({os.getpid(), dead_pid}) == ["ours", "dead"]
    client.containers.list.assert_called_once_with(all=True, filters={"label": OWNER_LABEL})


def test_real_container(dirs, docker_engine):
    backend = DockerBackend()
    result = backend.run("id -u; echo hi > out.txt; touch /etc/x 2>&1 || echo ro", dirs / "workspace",
                         limits=LIMITS, ro_mounts={"/tests": dirs / "tests"})
    assert result.exit_code == 0, result
    assert result.stdout.split()[0] == "65534" and "ro" in result.stdout
    assert (dirs / "workspace" / "out.txt").read_text() == "hi\n"
    moved = backend.run("pwd; cat /app/out.txt", dirs / "workspace", limits=LIMITS, workdir="/app")
    assert (moved.exit_code, moved.stdout) == (0, "/app\nhi\n"), moved
