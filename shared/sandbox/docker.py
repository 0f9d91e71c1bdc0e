"""The docker sandbox backend: one hardened container per run, through the docker SDK.

Each run: network "none", read-only root, all capabilities dropped, no-new-privileges, memory =
memory+swap limit, CPU quota, pids limit, user 65534:65534, a noexec size-capped tmpfs at /tmp,
output read through a stream attached before the start (its head kept up to the cap, the rest
dropped, nothing logged to disk: a flood can neither fill the disk nor push out the start marker
the grader looks for), the workspace bind-mounted read-write at `workdir` (/workspace unless the
caller names another place, e.g. a Harbor task's WORKDIR /app, where the mount hides what the image
has there), the caller's read-write mounts lent to the container's user like the workspace and its
kept mounts left with their owner (the container's user can do there only what their modes let any
user do), and the command run in it with the image's own PATH (a virtual environment the image puts first
is the one its commands find); waited on with the wall clock, killed after it, always
removed. The workdir and the mounts' targets are checked as bubblewrap checks them
(base.place_mounts). A
Harbor task's environment/ directory is built into `rollstream-task:<content hash>` once (skipped
when that tag exists); a SWE row's environment (a published image, or one built from its repository) is
docker_environments.py's, through `image_for_task`. `BackendUnavailable` when no engine is reachable.

Every container is labelled with the process that made it (OWNER_LABEL: host name, pid namespace,
pid and the process's start time). A process killed while its container runs never removes it, and
nothing in the engine would stop it: `remove_orphaned_containers` (the agent-runner calls it when it
starts) removes the containers of this host's and pid namespace's processes that are gone.

    python -m pytest tests/unit/shared/sandbox/test_docker_backend.py -q
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

from rollstream.shared.errors import BackendUnavailable
from rollstream.shared.sandbox.base import (
    DEFAULT_WORKDIR,
    SandboxLimits,
    SandboxResult,
    place_mounts,
)
from rollstream.shared.sandbox.docker_environments import row_image
from rollstream.shared.sandbox.host_uids import lent_to

log = logging.getLogger(__name__)

STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""PATH in a run whose image sets none."""
DEFAULT_IMAGE = "python:3.11-slim"
"""Image of runs whose task brings no environment/Dockerfile (the compose file's Python base)."""
OUTPUT_DRAIN_S = 10.0
"""How long the rest of a finished container's output may take to arrive."""
OWNER_LABEL = "rollstream.sandbox.owner"
"""Label of every container the backend makes: `process_owner()` of the process that made it."""


class DockerBackend:
    """One hardened container per run (docker SDK 7). `client`: a docker client (tests pass a
    mock); by default docker.from_env(), pinged, else BackendUnavailable."""

    name = "docker"
    SANDBOX_USER = "65534:65534"

    def __init__(self, client: Any = None, default_image: str = DEFAULT_IMAGE,
                 cpus: float = 1.0, image_cache: dict[str, str] | None = None) -> None:
        if client is None:
            try:
                import docker
                client = docker.from_env()
                client.ping()
            except Exception as exc:  # docker.errors.DockerException, requests errors, ...
                raise BackendUnavailable(f"no Docker engine reachable: {exc}") from exc
        self.client = client
        self.default_image = default_image
        self.cpus = cpus
        self.image_cache = image_cache if image_cache is not None else {}
        """content hash (or `env:` and a row environment's key) -> tag of images known to exist."""
        self.image_paths: dict[str, str] = {}
        """image -> the PATH its configuration sets (see image_path)."""

    # images

    def image_for(self, environment_dir: Path | None) -> str | None:
        """The task image built from `environment_dir` (its Dockerfile), cached by content hash."""
        if environment_dir is None or not (Path(environment_dir) / "Dockerfile").is_file():
            return None
        digest = directory_hash(Path(environment_dir))
        if digest in self.image_cache:
            return self.image_cache[digest]
        tag = f"rollstream-task:{digest[:32]}"
        from docker.errors import ImageNotFound
        try:
            self.client.images.get(tag)
        except ImageNotFound:
            log.info("building %s from %s", tag, environment_dir)
            self.client.images.build(path=str(environment_dir), tag=tag, rm=True, forcerm=True,
                                     pull=False)
        self.image_cache[digest] = tag
        return tag

    def image_for_task(self, task: Any) -> str | None:
        """The image a task's tests run in: its dockerfile's, else its row's environment (a published image
        or one built from the row's repository: docker_environments.row_image); None: the default image.
        EnvironmentImageError (a SandboxError) when that image cannot be had."""
        return row_image(self, task)

    def image_path(self, image: str) -> str:
        """The PATH `image` sets in its configuration (a virtual environment's bin first, say), else the
        standard one: a run's commands find the image's programs as `docker run` would."""
        if image not in self.image_paths:
            import requests
            from docker.errors import DockerException
            try:
                config_env = self.client.images.get(image).attrs.get("Config", {}).get("Env")
            except (DockerException, requests.exceptions.RequestException):
                return STANDARD_PATH  # a missing image fails at create, with the engine's words
            paths = [item[len("PATH="):] for item in config_env if isinstance(item, str)
                     and item.startswith("PATH=")] if isinstance(config_env, list) else []
            self.image_paths[image] = paths[-1] if paths else STANDARD_PATH
        return self.image_paths[image]

    # runs

    def container_options(self, workspace: Path, limits: SandboxLimits,
                          ro_mounts: dict[str, Path], rw_mounts: dict[str, Path],
                          env: dict[str, str], workdir: str = DEFAULT_WORKDIR,
                          kept_mounts: dict[str, Path] | None = None) -> dict[str, Any]:
        """The containers.run keyword arguments of one run; SandboxError for a workdir or mount
        target that place_mounts refuses."""
        from docker.types import LogConfig, Ulimit
        mib = 1024 * 1024
        kept_mounts = kept_mounts or {}
        mounts = [(host, "ro") for host in ro_mounts.values()] + \
            [(host, "rw") for host in [*rw_mounts.values(), *kept_mounts.values()]]
        workdir, targets = place_mounts(workdir, [*ro_mounts, *rw_mounts, *kept_mounts])
        volumes = {str(Path(workspace).resolve()): {"bind": workdir, "mode": "rw"}}
        for (host, mode), target in zip(mounts, targets):
            volumes[str(Path(host).resolve())] = {"bind": target, "mode": mode}
        full_env = {"PATH": STANDARD_PATH, "HOME": workdir, "LANG": "C.UTF-8", **env}
        return dict(
            network_mode="none", read_only=True, cap_drop=["ALL"],
            security_opt=["no-new-privileges"], mem_limit=f"{limits.memory_mb}m",
            memswap_limit=f"{limits.memory_mb}m", nano_cpus=int(self.cpus * 1e9),
            pids_limit=limits.max_processes, user=self.SANDBOX_USER,
            tmpfs={"/tmp": f"size={limits.tmp_size_mb}m,noexec"},
            volumes=volumes, working_dir=workdir, environment=full_env,
            ulimits=[Ulimit(name="fsize", soft=limits.max_file_size_mb * mib,
                            hard=limits.max_file_size_mb * mib),
                     Ulimit(name="nofile", soft=limits.max_open_files, hard=limits.max_open_files),
                     Ulimit(name="core", soft=0, hard=0)],
            log_config=LogConfig(type="none", config={}),
            stdin_open=False, tty=False, auto_remove=False, privileged=False, ipc_mode="none",
            labels={OWNER_LABEL: process_owner()},
        )

    def remove_orphaned_containers(self) -> list[str]:
        """Remove (killing them first) the containers made by processes of this host and pid namespace that
        are gone; returns their ids. Containers of other hosts, other pid namespaces or live processes are
        left alone: whether their maker lives cannot be told from here."""
        removed = []
        for container in self.client.containers.list(all=True, filters={"label": OWNER_LABEL}):
            if owner_is_gone(container.labels.get(OWNER_LABEL, "")):
                container.remove(force=True)
                removed.append(container.id)
        return removed

    def containers_of(self, pids: set[int]) -> list[str]:
        """Ids of the containers, running or not, that the processes `pids` of this host and pid namespace
        made (dead ones included: an audit's question is what they left)."""
        found = []
        for container in self.client.containers.list(all=True, filters={"label": OWNER_LABEL}):
            owner = _local_owner(container.labels.get(OWNER_LABEL, ""))
            if owner is not None and owner[0] in pids:
                found.append(container.id)
        return found

    def run(self, command: str, workspace: Path, *, limits: SandboxLimits,
            ro_mounts: dict[str, Path] | None = None, rw_mounts: dict[str, Path] | None = None,
            env: dict[str, str] | None = None, image: str | None = None,
            workdir: str = DEFAULT_WORKDIR,
            kept_mounts: dict[str, Path] | None = None) -> SandboxResult:
        ro_mounts, rw_mounts = dict(ro_mounts or {}), dict(rw_mounts or {})
        kept_mounts = dict(kept_mounts or {})
        env = {"PATH": self.image_path(image or self.default_image), **(env or {})}
        options = self.container_options(workspace, limits, ro_mounts, rw_mounts, env, workdir,
                                         kept_mounts)
        writable = [Path(workspace)] + [Path(host) for host in rw_mounts.values()]
        kept = [Path(host) for host in kept_mounts.values()]
        sandbox_uid = int(self.SANDBOX_USER.split(":")[0])
        # as root, the container's uid 65534 must be able to write the workspace
        as_root = os.geteuid() == 0
        with lent_to(sandbox_uid, writable if as_root else [], kept if as_root else []):
            return self._run_container(command, image, options, limits)

    def _run_container(self, command: str, image: str | None, options: dict,
                       limits: SandboxLimits) -> SandboxResult:
        import requests
        from docker.errors import DockerException

        container = None
        started = time.monotonic()
        timed_out = False
        try:
            try:
                container = self.client.containers.create(
                    image or self.default_image, ["/bin/sh", "-c", command], **options)
                # Attached before the start, so the output is read from its first byte, and kept only
                # up to the cap: a flood can neither fill the disk nor push out the start marker.
                stream = container.attach(stdout=True, stderr=True, stream=True, logs=False, demux=True)
                output = _CappedOutput(limits.max_output_bytes)
                reader = threading.Thread(target=output.drain, args=(stream,), name="container-output",
                                          daemon=True)
                reader.start()
                container.start()
            except (DockerException, requests.exceptions.RequestException) as exc:
                raise BackendUnavailable(f"docker could not start the container: {exc}") from exc
            try:
                status = container.wait(timeout=limits.wall_time_s)
                exit_code = int(status.get("StatusCode", -1))
            except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
                timed_out = True
                exit_code = None
                try:
                    container.kill()
                except DockerException:
                    pass
            reader.join(timeout=OUTPUT_DRAIN_S)
        finally:
            if container is not None:
                try:
                    container.remove(force=True)
                except Exception as exc:  # report, never mask the result
                    log.warning("could not remove container: %s", exc)
        duration = time.monotonic() - started
        if timed_out:
            reason = f"killed: wall-clock limit {limits.wall_time_s:g}s"
        elif exit_code == 137:
            reason = "killed by signal SIGKILL (memory/pids limit?)"
        else:
            reason = f"exit {exit_code}"
        out, err = output.text()
        return SandboxResult(exit_code=exit_code, stdout=out, stderr=err, timed_out=timed_out,
                             output_truncated=output.truncated, duration_s=duration, reason=reason)


class _CappedOutput:
    """The head of a container's stdout and stderr, at most `cap` bytes each; the rest is read and
    dropped, so the container never blocks on a full pipe."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = (bytearray(), bytearray())
        self.truncated = False

    def drain(self, stream: Any) -> None:
        try:
            for chunks in stream:
                for kept, chunk in zip(self.kept, chunks):
                    if not chunk:
                        continue
                    room = self.cap - len(kept)
                    if len(chunk) > room:
                        self.truncated = True
                    kept += chunk[:max(room, 0)]
        except Exception as exc:  # the engine closing the stream early is reported, not raised
            log.warning("container output stream ended early: %s", exc)

    def text(self) -> tuple[str, str]:
        return tuple(kept.decode("utf-8", errors="replace") for kept in self.kept)


def process_owner() -> str:
    """`host/pid namespace/pid/start time` of this process: the pid alone is reused, by the next process on
    this host or by the same service restarted in its container (the same host name and pid namespace,
    another start time)."""
    return f"{socket.gethostname()}/{_pid_namespace()}/{os.getpid()}/{_start_time(os.getpid())}"


def owner_is_gone(owner: str) -> bool:
    """Whether `owner` (process_owner's form) names a process of this host and pid namespace that no
    longer runs; False for any other host or namespace, and for a label not in that form."""
    local = _local_owner(owner)
    return local is not None and _start_time(local[0]) != local[1]


def _local_owner(owner: str) -> tuple[int, str] | None:
    """(pid, start time) of an owner label (process_owner's form) that names a process of this host and pid
    namespace; None for any other, and for a label not in that form."""
    parts = owner.split("/")
    if len(parts) != 4 or not parts[2].isdigit():
        return None
    host, namespace, pid, started = parts
    if host != socket.gethostname() or namespace != str(_pid_namespace()):
        return None
    return int(pid), started


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); "" when it does not
    run."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def directory_hash(path: Path) -> str:
    """sha256 over a directory's relative paths, file modes and contents (symlinks as targets)."""
    digest = hashlib.sha256()
    root = Path(path)
    for entry in sorted(p for p in root.rglob("*")):
        relative = entry.relative_to(root).as_posix()
        st = entry.lstat()
        digest.update(relative.encode() + b"\0" + str(stat.S_IMODE(st.st_mode) & 0o111).encode())
        if entry.is_symlink():
            digest.update(b"L" + os.readlink(entry).encode())
        elif entry.is_file():
            digest.update(b"F" + hashlib.sha256(entry.read_bytes()).digest())
        else:
            digest.update(b"D")
    return digest.hexdigest()

