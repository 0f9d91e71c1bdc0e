"""Grade an agent's final diff: apply it to a clean copy of the task's workspace and run the task's
tests in a sandbox. Everything the diff brings, and everything that runs, was written by a model
under training and is treated as hostile.

    from shared.grading import get_backend, grade_harbor, grade_swebench
    backend = get_backend("bubblewrap")              # or "docker"; "unsafe-local" needs allow_unsafe
    outcome = grade_harbor(task, diff, backend)      # GradeOutcome(score, passed, reason, tests, log, ...)

Backends (`get_backend(name, **options)`), all with `run(command, workspace, *, limits, ro_mounts,
rw_mounts, env, image) -> SandboxResult`; the workspace is /workspace (and the working directory):

* "bubblewrap" (`BubblewrapBackend`): shared/sandbox.py (no network, own namespaces, rlimits,
  wall clock); mounts are extra binds. `image` is ignored: the host's /usr is the environment.
* "docker" (`DockerBackend`): one container per run through the docker SDK: network "none",
  read-only root, all capabilities dropped, no-new-privileges, memory = memory+swap limit, CPU
  quota, pids limit, user 65534:65534, a noexec size-capped tmpfs at /tmp, capped logs, the
  workspace bind-mounted read-write at /workspace; waited on with the wall clock, killed after it,
  always removed. A Harbor task's environment/ directory is built into
  `rollstream-task:<content hash>` once (skipped when that tag exists). `BackendUnavailable` when
  no engine is reachable.
* "unsafe-local" (`UnsafeLocalBackend`): plain subprocess on the host, for debugging only;
  `get_backend` refuses it unless the name is exactly "unsafe-local" and `allow_unsafe=True`.
  It cannot provide mounts (no /tests, /logs), so it runs commands, not Harbor grading.

Workspaces (`prepare_workspace(source)`): a pid-tagged `rs-grade-{pid}-*` temp directory with
repo/ (the copy, /workspace in the sandbox), git/ (our git directory, OUTSIDE the work tree, so a
model-written .git/config or .gitattributes never runs anything through host git; hooks off, clean
environment, $GIT_DIR/info/attributes overriding the tree's) and scratch directories (logs/,
tests/) next to it. The baseline is a snapshot of every regular file and symlink below repo/
(`.git` entries, Python caches and special files left out), as in shared/agent/coding.py.

`apply_diff(workspace, diff)`: first a dry run into the index only (`git apply --cached`, then
`--cached --3way`); paths git would touch must be relative and inside the tree, and a symlink the
patch creates must point inside the workspace (relative, never above the root): checked on the
dry run's result BEFORE the work tree is touched. Then the real `git apply` (or `--3way`), and a
physical check (realpath) of every symlink the patch touched. An unappliable patch gives
(False, git's message).

Harbor (`grade_harbor`): fresh workspace from task.workspace, apply the diff ("patch did not
apply: ..." -> 0), then `bash /tests/test.sh` in the sandbox with a COPY of the task's tests/
mounted read-only at /tests (the diff cannot reach it: it is not in the workspace) and a fresh
host directory read-write at /logs (with verifier/ in it), env WORKSPACE=/workspace, wall clock =
task.verifier_timeout_s. A test.sh that did not finish (wall clock, a signal, exit >= 128)
scores 0 whatever reward file exists (model code could write one and then kill test.sh). The
reward is /logs/verifier/reward.txt (a number) or reward.json
({"reward": x}, or per-test outcomes {"tests": {id: "passed"|...|bool}} -> fraction passed); read
on the host without following symlinks (O_NOFOLLOW at every level, regular files only, size
capped); both files present is refused as ambiguous. Missing or garbled -> 0 with the reason;
clamped to 0..1. Known limit: model code run by test.sh can write /logs itself (e.g. a reward,
then make test.sh's own write fail); Harbor's layout gives the verifier no place it cannot reach.

SWE-bench (`grade_swebench`): fresh workspace from repo_dir, apply the model diff, then RESTORE
the test files: every file the test_patch touches (and pytest/site hooks a diff could use to fake
outcomes: conftest.py, pytest.ini, sitecustomize.py, usercustomize.py, *.pth, wherever the diff
touched them) is reset to the snapshot's version (removed if it had none), and the test_patch is
applied on top. Then `test_command` + FAIL_TO_PASS + PASS_TO_PASS ids; pytest -rA summary lines
(PASSED/FAILED/ERROR/SKIPPED/XFAIL/XPASS) fill `tests` (XFAIL/XPASS count as passed, as in the
SWE-bench harness; an id not in the output is "error"). Score: 1 when every F2P and P2P id passed,
else 0; with the task flag `partial_credit` (attribute, or metadata["partial_credit"]) the score is
the fraction of F2P passing provided all P2P pass (0 otherwise). Known limit: a diff can still
change non-test code the tests import to special-case them; that is what the tests are for.

Whether the sandbox ran at all: the command is wrapped to print a marker line before anything the
task or model controls runs; a failed run without the marker (or a backend exception) is an
`infrastructure_error` (callers retry those), never a test failure, and vice versa.

Also: `reference_diff(task, backend)` (Harbor: solution/solve.sh run in the sandbox on a fresh
workspace without the tests, then the workspace's diff; SWE: the gold patch),
`validate_tasks(tasks, backend)` (reference must grade 1, empty diff 0) and
`store_log(storage, run_id, name, text)` (atomic write of a log to {run_id}/logs/{name}.log).

    python -m pytest tests/unit/test_grading.py tests/unit/test_hostile_grading.py \\
        tests/unit/test_docker_backend.py -q
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol, runtime_checkable

from shared.sandbox import (SandboxError, SandboxLimits, SandboxResult, lent_to, run_in_sandbox,
                            workspace_prefix)

log = logging.getLogger(__name__)

MAX_LOG_CHARS = 64 * 1024
"""GradeOutcome.log keeps at most this much (head and tail)."""
MAX_REWARD_FILE_BYTES = 1024 * 1024
MAX_TEST_OUTPUT_BYTES = 512 * 1024
"""SWE test output: the last this many bytes are kept (pytest's -rA summary is at the end)."""
DEFAULT_GRADE_LIMITS = SandboxLimits(wall_time_s=600, cpu_time_s=600, memory_mb=4096,
                                     max_processes=256, max_file_size_mb=256, max_open_files=1024,
                                     max_output_bytes=MAX_TEST_OUTPUT_BYTES + 4096, tmp_size_mb=512)
"""Limits for test runs; the wall clock (and CPU time) is the task's verifier timeout when set."""
GIT_TIMEOUT_S = 300
STARTED_MARKER = "rs-grader: sandbox started"
"""Printed by our wrapper before any task or model code runs (see infrastructure_error)."""
PROTECTED_NAMES = ("conftest.py", "pytest.ini", "sitecustomize.py", "usercustomize.py")
"""SWE: files with these names (and *.pth) that a diff touches are reset to the snapshot."""
SNAPSHOT_EXCLUDED_NAMES = ("__pycache__", ".pytest_cache")
"""Directories never in a snapshot, at any depth (with .git and *.pyc, *.pyo files)."""
_EXCLUDED_SUFFIXES = (".pyc", ".pyo")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_GIT_CONFIG = {
    "user.name": "rollstream", "user.email": "rollstream@localhost",
    "core.hooksPath": "/dev/null", "core.fsmonitor": "false", "core.untrackedCache": "false",
    "core.autocrlf": "false", "core.safecrlf": "false", "core.symlinks": "true",
    "core.fileMode": "true", "core.quotePath": "true", "commit.gpgSign": "false", "gc.auto": "0",
    "diff.external": "", "diff.noprefix": "false", "diff.mnemonicPrefix": "false",
    "apply.whitespace": "nowarn",
}
_GIT_ATTRIBUTES = "* -text -filter -ident -working-tree-encoding !diff !eol\n"


def snapshot_paths(root: Path) -> tuple[list[bytes], dict[str, int]]:
    """Every regular file and symlink below `root` (relative, bytes, sorted), never following links,
    and how many entries were left out by kind (.git, caches, special files). Walked by hand rather
    than with `git add -A`, so that a model-written .gitignore cannot hide files."""
    paths: list[bytes] = []
    skipped = {".git": 0, "cache": 0, "special": 0}
    top = os.fsencode(root)
    stack = [b""]
    while stack:
        relative_dir = stack.pop()
        with os.scandir(os.path.join(top, relative_dir) if relative_dir else top) as entries:
            for entry in entries:
                relative = os.path.join(relative_dir, entry.name) if relative_dir else entry.name
                if entry.name.lower() == b".git":
                    skipped[".git"] += 1
                elif entry.is_symlink():
                    paths.append(relative)
                elif entry.is_dir(follow_symlinks=False):
                    if os.fsdecode(entry.name) in SNAPSHOT_EXCLUDED_NAMES:
                        skipped["cache"] += 1
                    else:
                        stack.append(relative)
                elif entry.is_file(follow_symlinks=False):
                    if os.fsdecode(entry.name).endswith(_EXCLUDED_SUFFIXES):
                        skipped["cache"] += 1
                    else:
                        paths.append(relative)
                else:
                    skipped["special"] += 1
    paths.sort()
    return paths, skipped


class GradingError(RuntimeError):
    """Grading could not be set up (not the diff's fault)."""


class BackendUnavailable(GradingError):
    """The sandbox backend cannot run anything here (no bwrap, no Docker engine, ...)."""


# --- backends ------------------------------------------------------------------------------------


@runtime_checkable
class SandboxBackend(Protocol):
    name: str

    def run(self, command: str, workspace: Path, *, limits: SandboxLimits,
            ro_mounts: dict[str, Path] | None = None, rw_mounts: dict[str, Path] | None = None,
            env: dict[str, str] | None = None, image: str | None = None) -> SandboxResult: ...


PYTHON_TOOLS_MOUNT = "/opt/rollstream"
PYTHON_TOOLS = ("pytest",)
"""Distributions (with their requirements) the bubblewrap backend makes importable in the
sandbox, for SWE test commands (`python -m pytest`): the host's /usr/bin/python3 has no pytest."""
_python_tools_dir: Path | None = None


def _stage_python_tools() -> Path | None:
    """A read-only tree with bin/python (-> /usr/bin/python3) and site/ holding copies of
    PYTHON_TOOLS and their requirements, taken from this interpreter's environment when
    /usr/bin/python3 has the same minor version (pure-Python packages only). None otherwise.

    Built once per machine and tools version under the temp dir (RQ work-horses are forked per job
    and exit without cleanup, so a per-process copy would be rebuilt and leaked on every job)."""
    global _python_tools_dir
    if _python_tools_dir is not None:
        return _python_tools_dir
    import importlib.metadata as metadata
    import sys

    from packaging.requirements import Requirement
    try:
        version = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    if version != str(tuple(sys.version_info[:2])):
        log.warning("/usr/bin/python3 is %s, not %s: pytest is not provided in the sandbox",
                    version, sys.version_info[:2])
        return None
    try:
        versions = ",".join(f"{name}={metadata.version(name)}" for name in PYTHON_TOOLS)
    except metadata.PackageNotFoundError as exc:
        log.warning("%s is not installed here: it is not provided in the sandbox", exc)
        return None
    key = hashlib.sha256(f"{sys.version}|{versions}".encode()).hexdigest()[:16]
    final = Path(tempfile.gettempdir()) / f"rs-pytools-{key}"
    if (final / "complete").exists():
        _python_tools_dir = final
        return final
    base = Path(tempfile.mkdtemp(prefix="rs-pytools-building-")).resolve()
    base.chmod(0o755)
    (base / "bin").mkdir(mode=0o755)
    os.symlink("/usr/bin/python3", base / "bin" / "python")
    site = base / "site"
    site.mkdir(mode=0o755)
    todo, done = list(PYTHON_TOOLS), set()
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in done:
            continue
        done.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for requirement in dist.requires or []:
            parsed = Requirement(requirement)
            if parsed.marker is None or parsed.marker.evaluate({"extra": ""}):
                todo.append(parsed.name)
        for file in dist.files or []:
            if file.parts[0] in ("..", "__pycache__") or "__pycache__" in file.parts \
                    or file.suffix in (".pyc", ".so"):
                continue
            source = Path(dist.locate_file(file))
            if source.is_file():
                target = site / file
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
    for path in [site, *site.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (base / "complete").write_text(versions)
    try:
        os.rename(base, final)
    except OSError:  # another process finished first: use its copy
        shutil.rmtree(base, ignore_errors=True)
    _python_tools_dir = final
    return final


class BubblewrapBackend:
    """shared/sandbox.py; mounts become bwrap binds; `image` is ignored. With python_tools (the
    default), pytest is importable in the sandbox and `python` runs /usr/bin/python3 (mounted
    read-only at /opt/rollstream; PATH and PYTHONPATH point there)."""

    name = "bubblewrap"

    def __init__(self, python_tools: bool = True) -> None:
        if shutil.which("bwrap") is None:
            raise BackendUnavailable("bubblewrap is not installed (`bwrap` not on PATH); "
                                     "on Debian: apt-get install bubblewrap")
        self.tools = _stage_python_tools() if python_tools else None

    def image_for(self, environment_dir: Path | None) -> str | None:
        return None

    def run(self, command: str, workspace: Path, *, limits: SandboxLimits,
            ro_mounts: dict[str, Path] | None = None, rw_mounts: dict[str, Path] | None = None,
            env: dict[str, str] | None = None, image: str | None = None) -> SandboxResult:
        binds = [(Path(host), target, True) for target, host in (ro_mounts or {}).items()]
        binds += [(Path(host), target, False) for target, host in (rw_mounts or {}).items()]
        full_env = dict(env or {})
        if self.tools is not None:
            binds.append((self.tools, PYTHON_TOOLS_MOUNT, True))
            full_env.setdefault("PATH", f"{PYTHON_TOOLS_MOUNT}/bin:/usr/local/bin:/usr/bin:/bin")
            full_env.setdefault("PYTHONPATH", f"{PYTHON_TOOLS_MOUNT}/site")
        return run_in_sandbox(command, workspace, limits, full_env, extra_binds=binds)


class DockerBackend:
    """One hardened container per run (docker SDK 7). `client`: a docker client (tests pass a
    mock); by default docker.from_env(), pinged, else BackendUnavailable."""

    name = "docker"
    SANDBOX_USER = "65534:65534"

    def __init__(self, client: Any = None, default_image: str = "python:3.12-slim",
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
        """content hash -> tag of images known to exist."""

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

    # runs

    def container_options(self, workspace: Path, limits: SandboxLimits,
                          ro_mounts: dict[str, Path], rw_mounts: dict[str, Path],
                          env: dict[str, str]) -> dict[str, Any]:
        from docker.types import LogConfig, Ulimit
        mib = 1024 * 1024
        volumes = {str(Path(workspace).resolve()): {"bind": "/workspace", "mode": "rw"}}
        for target, host in ro_mounts.items():
            volumes[str(Path(host).resolve())] = {"bind": target, "mode": "ro"}
        for target, host in rw_mounts.items():
            volumes[str(Path(host).resolve())] = {"bind": target, "mode": "rw"}
        full_env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "HOME": "/workspace", "LANG": "C.UTF-8", **env}
        return dict(
            detach=True, network_mode="none", read_only=True, cap_drop=["ALL"],
            security_opt=["no-new-privileges"], mem_limit=f"{limits.memory_mb}m",
            memswap_limit=f"{limits.memory_mb}m", nano_cpus=int(self.cpus * 1e9),
            pids_limit=limits.max_processes, user=self.SANDBOX_USER,
            tmpfs={"/tmp": f"size={limits.tmp_size_mb}m,noexec"},
            volumes=volumes, working_dir="/workspace", environment=full_env,
            ulimits=[Ulimit(name="fsize", soft=limits.max_file_size_mb * mib,
                            hard=limits.max_file_size_mb * mib),
                     Ulimit(name="nofile", soft=limits.max_open_files, hard=limits.max_open_files),
                     Ulimit(name="core", soft=0, hard=0)],
            log_config=LogConfig(type="json-file",
                                 config={"max-size": str(max(limits.max_output_bytes * 2, 65536)),
                                         "max-file": "1"}),
            stdin_open=False, tty=False, auto_remove=False, privileged=False, ipc_mode="none",
        )

    def run(self, command: str, workspace: Path, *, limits: SandboxLimits,
            ro_mounts: dict[str, Path] | None = None, rw_mounts: dict[str, Path] | None = None,
            env: dict[str, str] | None = None, image: str | None = None) -> SandboxResult:
        ro_mounts, rw_mounts = dict(ro_mounts or {}), dict(rw_mounts or {})
        options = self.container_options(workspace, limits, ro_mounts, rw_mounts, env or {})
        writable = [Path(workspace)] + [Path(host) for host in rw_mounts.values()]
        sandbox_uid = int(self.SANDBOX_USER.split(":")[0])
        # as root, the container's uid 65534 must be able to write the workspace
        with lent_to(sandbox_uid, writable if os.geteuid() == 0 else []):
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
                container = self.client.containers.run(
                    image or self.default_image, ["/bin/sh", "-c", command], **options)
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
            cap = limits.max_output_bytes
            out, out_cut = _capped_logs(container, cap, stdout=True)
            err, err_cut = _capped_logs(container, cap, stdout=False)
        finally:
            if container is not None:
                try:
                    container.remove(force=True)
                except Exception as exc:  # noqa: BLE001 - report, never mask the result
                    log.warning("could not remove container: %s", exc)
        duration = time.monotonic() - started
        if timed_out:
            reason = f"killed: wall-clock limit {limits.wall_time_s:g}s"
        elif exit_code == 137:
            reason = "killed by signal SIGKILL (memory/pids limit?)"
        else:
            reason = f"exit {exit_code}"
        return SandboxResult(exit_code=exit_code, stdout=out, stderr=err, timed_out=timed_out,
                             output_truncated=out_cut or err_cut, duration_s=duration,
                             reason=reason)


def _capped_logs(container: Any, cap: int, *, stdout: bool) -> tuple[str, bool]:
    """At most `cap` bytes of the container's stdout (or stderr), read as a stream."""
    kept = bytearray()
    truncated = False
    try:
        stream = container.logs(stdout=stdout, stderr=not stdout, stream=True, follow=False)
        if isinstance(stream, (bytes, bytearray)):
            stream = [bytes(stream)]
        for chunk in stream:
            room = cap - len(kept)
            if len(chunk) > room:
                kept += chunk[:max(room, 0)]
                truncated = True
                break
            kept += chunk
    except Exception as exc:  # noqa: BLE001 - logs are best effort
        log.warning("could not read container logs: %s", exc)
    return kept.decode("utf-8", errors="replace"), truncated


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


class UnsafeLocalBackend:
    """Runs the command with subprocess on the host, NO isolation (debugging only)."""

    name = "unsafe-local"

    def image_for(self, environment_dir: Path | None) -> str | None:
        return None

    def run(self, command: str, workspace: Path, *, limits: SandboxLimits,
            ro_mounts: dict[str, Path] | None = None, rw_mounts: dict[str, Path] | None = None,
            env: dict[str, str] | None = None, image: str | None = None) -> SandboxResult:
        if ro_mounts or rw_mounts:
            raise BackendUnavailable("unsafe-local cannot mount "
                                     f"{sorted({**(ro_mounts or {}), **(rw_mounts or {})})}: it "
                                     "runs on the host as is; grade with bubblewrap or docker")
        started = time.monotonic()
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workspace),
                    "LANG": "C.UTF-8", **(env or {})}
        try:
            proc = subprocess.run(["/bin/sh", "-c", command], cwd=workspace, env=full_env,
                                  stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=limits.wall_time_s, start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            return SandboxResult(None, _cap_bytes(exc.stdout, limits), _cap_bytes(exc.stderr, limits),
                                 True, False, time.monotonic() - started,
                                 f"killed: wall-clock limit {limits.wall_time_s:g}s")
        cap = limits.max_output_bytes
        return SandboxResult(proc.returncode, _cap_bytes(proc.stdout, limits),
                             _cap_bytes(proc.stderr, limits), False,
                             len(proc.stdout) > cap or len(proc.stderr) > cap,
                             time.monotonic() - started, f"exit {proc.returncode}")


def _cap_bytes(data: bytes | None, limits: SandboxLimits) -> str:
    return (data or b"")[:limits.max_output_bytes].decode("utf-8", errors="replace")


_BACKENDS = {"bubblewrap": BubblewrapBackend, "bwrap": BubblewrapBackend, "docker": DockerBackend}


def get_backend(name: str, *, allow_unsafe: bool = False, **options: Any) -> SandboxBackend:
    """A backend by name: "bubblewrap" (alias "bwrap"), "docker", or "unsafe-local" (only with
    allow_unsafe=True and that exact name)."""
    if name == "unsafe-local":
        if allow_unsafe is not True:
            raise ValueError("backend 'unsafe-local' runs model-written code on the host with no "
                             "isolation at all; pass allow_unsafe=True to use it (debugging only)")
        return UnsafeLocalBackend(**options)
    if "unsafe" in name.lower() or "local" in name.lower():
        raise ValueError(f"unknown backend {name!r}: the unsafe backend must be named exactly "
                         "'unsafe-local' and needs allow_unsafe=True")
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: bubblewrap, docker, unsafe-local")
    return _BACKENDS[name](**options)


# --- outcomes ------------------------------------------------------------------------------------


@dataclass
class GradeOutcome:
    score: float
    """0..1."""
    passed: bool
    """score == 1."""
    reason: str
    tests: dict[str, str] = field(default_factory=dict)
    """test id -> "passed" / "failed" / "error" / "skipped"."""
    log: str = ""
    """What the test run printed, capped to MAX_LOG_CHARS."""
    duration_s: float = 0.0
    infrastructure_error: bool = False
    """The sandbox could not run: retry the grading; it says nothing about the diff."""


def _outcome(score: float, reason: str, *, tests: dict[str, str] | None = None, log_text: str = "",
             started: float, infrastructure_error: bool = False) -> GradeOutcome:
    if not isinstance(score, (int, float)) or math.isnan(score):
        score = 0.0
    score = min(1.0, max(0.0, float(score)))
    return GradeOutcome(score=score, passed=score == 1.0 and not infrastructure_error,
                        reason=reason, tests=tests or {}, log=_cap_text(log_text),
                        duration_s=time.monotonic() - started,
                        infrastructure_error=infrastructure_error)


def _cap_text(text: str, limit: int = MAX_LOG_CHARS) -> str:
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - head - tail} characters omitted ...]\n{text[-tail:]}"


# --- workspaces ----------------------------------------------------------------------------------


class Workspace:
    """base/repo (the tree, /workspace), base/git (ours), scratch dirs beside them."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.root = base / "repo"
        self.git_dir = base / "git"
        self.baseline = ""

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()

    def cleanup(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)

    def scratch(self, name: str) -> Path:
        """A fresh directory next to the tree (never inside it), mode 0755."""
        path = self.base / name
        path.mkdir(mode=0o755)
        path.chmod(0o755)
        return path

    def git(self, *args: str, stdin: bytes | None = None, check: bool = True,
            stdout: Any = None) -> subprocess.CompletedProcess:
        command = ["git", "--git-dir", str(self.git_dir), "--work-tree", str(self.root)]
        for key, value in _GIT_CONFIG.items():
            command += ["-c", f"{key}={value}"]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.git_dir), "LC_ALL": "C",
               "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
               "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0",
               "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
               "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}
        proc = subprocess.run(command + list(args), cwd=self.root, env=env, input=stdin,
                              stdin=None if stdin is not None else subprocess.DEVNULL,
                              stdout=stdout if stdout is not None else subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=GIT_TIMEOUT_S, check=False)
        if check and proc.returncode != 0:
            raise GradingError(f"git {args[0]} failed in {self.base} (exit {proc.returncode}): "
                               f"{proc.stderr.decode(errors='replace').strip()[:2000]}")
        return proc

    def _init_git(self) -> None:
        self.git_dir.mkdir(mode=0o700)
        self.git("init", "--quiet")
        for key, value in _GIT_CONFIG.items():
            self.git("config", key, value)
        (self.git_dir / "info").mkdir(exist_ok=True)
        (self.git_dir / "info" / "attributes").write_text(_GIT_ATTRIBUTES)
        shutil.rmtree(self.git_dir / "hooks", ignore_errors=True)

    def _snapshot_paths(self) -> list[bytes]:
        return snapshot_paths(self.root)[0]

    def snapshot_index(self) -> None:
        """Make the index hold exactly the tree's files (with stat data)."""
        self.git("read-tree", "--empty")
        paths = self._snapshot_paths()
        if paths:
            self.git("update-index", "--add", "-z", "--stdin", stdin=b"\0".join(paths) + b"\0")

    def snapshot_commit(self, message: str = "snapshot") -> str:
        self.snapshot_index()
        tree = self.git("write-tree").stdout.decode().strip()
        return self.git("commit-tree", tree, "-m", message).stdout.decode().strip()

    def diff(self) -> str:
        """The tree's changes against the baseline: `git diff --binary --no-renames`."""
        self.snapshot_index()
        proc = self.git("diff", "--cached", "--binary", "--no-renames", "--no-ext-diff",
                        "--no-textconv", "--no-color", "--src-prefix=a/", "--dst-prefix=b/",
                        self.baseline, "--")
        return proc.stdout.decode("utf-8", errors="surrogateescape")

    def reset_index(self) -> None:
        """Index = baseline, with fresh stat data (the tree is assumed to be the baseline)."""
        self.git("read-tree", self.baseline)
        self.git("update-index", "-q", "--refresh", check=False)


def prepare_workspace(source: Path | None) -> Workspace:
    """A fresh copy of `source` (or an empty tree) under /tmp with a git baseline kept outside it."""
    base = Path(tempfile.mkdtemp(prefix=workspace_prefix("grade"))).resolve()
    try:
        base.chmod(0o711)  # the sandbox's host uid must be able to walk down to repo/
        workspace = Workspace(base)
        if source is not None:
            source = Path(source)
            if not source.is_dir():
                raise GradingError(f"task workspace {source} is not a directory")
            shutil.copytree(source, workspace.root, symlinks=True)
        else:
            workspace.root.mkdir()
        workspace.root.chmod(0o755)
        workspace._init_git()
        workspace.baseline = workspace.snapshot_commit("baseline")
        workspace.git("update-ref", "refs/heads/baseline", workspace.baseline)
        return workspace
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise


# --- applying diffs ------------------------------------------------------------------------------


def _git_message(*procs: subprocess.CompletedProcess) -> str:
    lines: list[str] = []
    for proc in procs:
        for line in proc.stderr.decode("utf-8", errors="replace").splitlines():
            if line.strip() and line not in lines:
                lines.append(line.strip())
    return "; ".join(lines)[:2000] or "git apply failed"


def _bad_path(path: str) -> str | None:
    pure = PurePosixPath(path)
    if not path or path.startswith("/") or ".." in pure.parts or "\0" in path:
        return f"patch touches a path outside the workspace: {path!r}"
    return None


def _symlink_escapes(path: str, target: str) -> bool:
    """Whether a symlink at `path` (relative to the root) with `target` leaves the root,
    resolving `..` lexically from the link's directory."""
    if not target or target.startswith("/"):
        return True
    parts = list(PurePosixPath(path).parent.parts)
    for component in target.split("/"):
        if component in ("", "."):
            continue
        if component == "..":
            if not parts:
                return True
            parts.pop()
        else:
            parts.append(component)
    return False


def _numstat_paths(workspace: Workspace, patch: Path) -> list[str] | None:
    """Paths the patch names, as git's own parser reads them; None when it cannot parse it."""
    proc = workspace.git("apply", "--numstat", "-z", str(patch), check=False)
    if proc.returncode != 0:
        return None
    paths: list[str] = []
    fields = proc.stdout.split(b"\0")
    i = 0
    while i < len(fields):
        record = fields[i]
        if not record:
            i += 1
            continue
        parts = record.split(b"\t", 2)
        if len(parts) == 3 and parts[2]:
            paths.append(os.fsdecode(parts[2]))
            i += 1
        else:  # rename/copy: "added\tdeleted\t" then old and new as their own fields
            paths += [os.fsdecode(fields[i + 1]), os.fsdecode(fields[i + 2])] \
                if i + 2 < len(fields) else []
            i += 3
    return paths


def _changed_entries(workspace: Workspace) -> list[tuple[str, str, str]]:
    """(new mode, new blob, path) of each index entry that differs from the baseline."""
    proc = workspace.git("diff-index", "--cached", "-z", "--no-renames", "--raw", workspace.baseline)
    fields = proc.stdout.split(b"\0")
    entries = []
    for i in range(0, len(fields) - 1, 2):
        meta = fields[i].decode().lstrip(":").split()
        if len(meta) < 5:
            continue
        entries.append((meta[1], meta[3], os.fsdecode(fields[i + 1])))
    return entries


def _check_result(workspace: Workspace, entries: list[tuple[str, str, str]]) -> str | None:
    """Refuse a dry-run result that writes through a symlink or creates one pointing out."""
    for mode, blob, path in entries:
        bad = _bad_path(path)
        if bad:
            return bad
        parent = workspace.root
        for component in PurePosixPath(path).parts[:-1]:
            parent = parent / component
            if parent.is_symlink():
                return f"patch writes {path!r} through the symlink {component!r}: refused"
        if mode == "120000":
            target = workspace.git("cat-file", "blob", blob).stdout.decode("utf-8", "surrogateescape")
            if _symlink_escapes(path, target):
                return (f"patch creates a symlink {path!r} -> {target!r} that points outside the "
                        "workspace: refused")
    return None


def apply_diff(workspace: Workspace, diff: str) -> tuple[bool, str]:
    """Apply `diff` to the workspace (git apply, then git apply --3way); (ok, reason)."""
    if not diff.strip():
        return True, "empty diff: nothing to apply"
    patch = workspace.base / f"patch-{uuid.uuid4().hex[:8]}.diff"
    patch.write_bytes(diff.encode("utf-8", errors="surrogateescape"))
    try:
        paths = _numstat_paths(workspace, patch)
        for path in paths or []:
            bad = _bad_path(path)
            if bad:
                return False, bad
        # dry run: into the index only; the work tree is untouched
        workspace.reset_index()
        first = workspace.git("apply", "--cached", str(patch), check=False)
        three_way = False
        if first.returncode != 0:
            workspace.reset_index()
            second = workspace.git("apply", "--cached", "--3way", str(patch), check=False)
            if second.returncode != 0:
                workspace.reset_index()
                return False, _git_message(first, second)
            three_way = True
        entries = _changed_entries(workspace)
        problem = _check_result(workspace, entries)
        workspace.reset_index()
        if problem:
            return False, problem
        # the real thing
        if three_way:
            proc = workspace.git("apply", "--3way", str(patch), check=False)
        else:
            proc = workspace.git("apply", str(patch), check=False)
        if proc.returncode != 0:
            return False, _git_message(proc)
        for _, _, path in entries:  # physical check of what it made
            real = workspace.root / path
            if real.is_symlink():
                resolved = Path(os.path.realpath(real))
                if resolved != workspace.root and workspace.root not in resolved.parents:
                    return False, f"patch made a symlink {path!r} that resolves outside the workspace"
        return True, "applied" + (" (3-way)" if three_way else "")
    finally:
        patch.unlink(missing_ok=True)


# --- sandbox runs --------------------------------------------------------------------------------


def _wrap(command: str) -> str:
    """Print the start marker (nothing the task controls runs before it), then the command."""
    return f"printf '%s\\n' {shlex.quote(STARTED_MARKER)}; {command}"


@dataclass
class _Run:
    result: SandboxResult | None
    error: str | None
    """Set when the sandbox could not run (an infrastructure error)."""
    stdout: str = ""


def _run(backend: SandboxBackend, command: str, workspace: Workspace, limits: SandboxLimits,
         ro_mounts: dict[str, Path], rw_mounts: dict[str, Path], env: dict[str, str],
         image: str | None) -> _Run:
    try:
        result = backend.run(_wrap(command), workspace.root, limits=limits, ro_mounts=ro_mounts,
                             rw_mounts=rw_mounts, env=env, image=image)
    except (SandboxError, GradingError, OSError) as exc:
        return _Run(None, f"sandbox failed: {type(exc).__name__}: {exc}")
    first, _, rest = result.stdout.partition("\n")
    if first != STARTED_MARKER:
        return _Run(result, f"sandbox did not start the command ({result.reason}): "
                            f"{result.stderr.strip()[:500]}")
    return _Run(result, None, rest)


def _run_log(run: _Run) -> str:
    result = run.result
    if result is None:
        return run.error or ""
    parts = [f"[{result.reason}; {result.duration_s:.1f}s"
             + ("; output truncated" if result.output_truncated else "") + "]",
             "--- stdout ---", run.stdout, "--- stderr ---", result.stderr]
    return "\n".join(parts)


def _task_limits(limits: SandboxLimits | None, timeout_s: float | None) -> SandboxLimits:
    limits = limits or DEFAULT_GRADE_LIMITS
    if timeout_s:
        limits = dataclasses.replace(limits, wall_time_s=float(timeout_s),
                                     cpu_time_s=max(limits.cpu_time_s, float(timeout_s)))
    return limits


def _stage_copy(source: Path, target: Path) -> Path:
    """Copy a trusted task directory next to the workspace, readable by the sandbox (0755/0644)."""
    shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
    for path in [target, *target.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        path.chmod(0o755 if path.is_dir() or mode & 0o111 else 0o644)
    return target


# --- reading results the sandbox wrote -----------------------------------------------------------


def read_untrusted_file(base: Path, relative: str, limit: int = MAX_REWARD_FILE_BYTES) -> bytes | None:
    """The bytes of base/relative, never following a symlink at any level and only from a
    regular file (no FIFO can block us), at most `limit` bytes; None when it is not there.
    Raises ValueError with a reason when it is something other than a regular file or too big."""
    parts = PurePosixPath(relative).parts
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                  dir_fd=fd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise ValueError(f"{part}/ is not a plain directory ({exc.strerror})") from None
            os.close(fd)
            fd = next_fd
        try:
            file_fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                              dir_fd=fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ValueError(f"{relative} is a symlink, not a regular file") from None
            raise ValueError(f"{relative}: cannot open ({exc.strerror})") from None
        with os.fdopen(file_fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise ValueError(f"{relative} is not a regular file")
            data = handle.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"{relative} is larger than {limit} bytes")
        return data
    finally:
        os.close(fd)


_OUTCOME_WORDS = {"passed": "passed", "pass": "passed", "ok": "passed", "success": "passed",
                  "failed": "failed", "fail": "failed", "failure": "failed",
                  "error": "error", "errored": "error", "skipped": "skipped", "skip": "skipped"}


def _parse_reward(logs: Path) -> tuple[float | None, str, dict[str, str]]:
    """(score or None, reason, tests) from logs/verifier/reward.txt or reward.json."""
    present = []
    for name in ("reward.txt", "reward.json"):
        try:
            if os.lstat(logs / "verifier" / name) is not None:
                present.append(name)
        except OSError:
            pass
    if len(present) == 2:
        return None, "both reward.txt and reward.json exist: ambiguous, not trusted", {}
    for name in ("reward.txt", "reward.json"):
        try:
            data = read_untrusted_file(logs, f"verifier/{name}")
        except ValueError as exc:
            return None, f"reward file refused: {exc}", {}
        if data is None:
            continue
        text = data.decode("utf-8", errors="replace").strip()
        if name == "reward.txt":
            try:
                value = float(text)
            except ValueError:
                return None, f"reward.txt is not a number: {text[:80]!r}", {}
            if not math.isfinite(value):
                return None, f"reward.txt is not a finite number: {text[:80]!r}", {}
            return value, f"reward {value:g} from reward.txt", {}
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as exc:
            return None, f"reward.json is not JSON: {exc}", {}
        return _reward_from_json(payload)
    return None, "no reward: /logs/verifier/reward.txt and reward.json are missing", {}


def _reward_from_json(payload: Any) -> tuple[float | None, str, dict[str, str]]:
    if isinstance(payload, (int, float)) and not isinstance(payload, bool):
        payload = {"reward": payload}
    if not isinstance(payload, dict):
        return None, "reward.json is not an object", {}
    tests: dict[str, str] = {}
    raw_tests = payload.get("tests")
    if isinstance(raw_tests, dict):
        for test_id, value in list(raw_tests.items())[:10000]:
            if isinstance(value, bool):
                tests[str(test_id)] = "passed" if value else "failed"
            elif isinstance(value, str) and value.lower() in _OUTCOME_WORDS:
                tests[str(test_id)] = _OUTCOME_WORDS[value.lower()]
            else:
                tests[str(test_id)] = "error"
    reward = payload.get("reward")
    if isinstance(reward, (int, float)) and not isinstance(reward, bool):
        if not math.isfinite(reward):
            return None, "reward.json's reward is not finite", tests
        return float(reward), f"reward {reward:g} from reward.json", tests
    if reward is not None:
        return None, f"reward.json's reward is not a number: {str(reward)[:80]!r}", tests
    if tests:
        counted = [outcome for outcome in tests.values() if outcome != "skipped"]
        if not counted:
            return None, "reward.json: every test was skipped", tests
        passed = sum(outcome == "passed" for outcome in counted)
        return passed / len(counted), f"{passed}/{len(counted)} tests passed (reward.json)", tests
    return None, "reward.json has neither 'reward' nor 'tests'", {}


# --- Harbor --------------------------------------------------------------------------------------


def _task_name(task: Any) -> str:
    return str(getattr(task, "name", None) or getattr(task, "instance_id", None) or "task")


def _environment_dir(task: Any) -> Path | None:
    dockerfile = getattr(task, "dockerfile", None)
    if dockerfile is not None and Path(dockerfile).is_file():
        return Path(dockerfile).parent
    return None


def _image(backend: SandboxBackend, task: Any) -> str | None:
    image_for = getattr(backend, "image_for", None)
    return image_for(_environment_dir(task)) if image_for is not None else None


def grade_harbor(task: Any, diff: str, backend: SandboxBackend,
                 limits: SandboxLimits | None = None) -> GradeOutcome:
    """Apply `diff` to a fresh copy of the task's workspace and run its tests/test.sh."""
    started = time.monotonic()
    try:
        image = _image(backend, task)
        workspace = prepare_workspace(getattr(task, "workspace", None))
    except (GradingError, OSError) as exc:
        return _outcome(0, f"grading setup failed: {exc}", started=started,
                        infrastructure_error=True)
    with workspace:
        ok, why = apply_diff(workspace, diff)
        if not ok:
            return _outcome(0, f"patch did not apply: {why}", started=started)
        tests_dir = _stage_copy(Path(task.tests_dir), workspace.base / "tests")
        logs = workspace.scratch("logs")
        (logs / "verifier").mkdir(mode=0o755)
        (logs / "agent").mkdir(mode=0o755)
        run = _run(backend, "bash /tests/test.sh", workspace,
                   _task_limits(limits, getattr(task, "verifier_timeout_s", None)),
                   {"/tests": tests_dir}, {"/logs": logs},
                   {"WORKSPACE": "/workspace", "TESTS_DIR": "/tests", "LOGS_DIR": "/logs"}, image)
        log_text = _run_log(run)
        if run.error:
            return _outcome(0, run.error, log_text=log_text, started=started,
                            infrastructure_error=True)
        status = run.result.reason
        exit_code = run.result.exit_code
        if run.result.timed_out or exit_code is None or exit_code >= 128 or exit_code < 0:
            # killed: whatever reward is there may have been written by the model's code before
            # it stopped test.sh from writing the real one
            return _outcome(0, f"test.sh did not finish ({status}); its reward is not trusted",
                            log_text=log_text, started=started)
        score, reason, tests = _parse_reward(logs)
        if score is None:
            return _outcome(0, f"{reason} (test.sh: {status})", tests=tests, log_text=log_text,
                            started=started)
        if not 0 <= score <= 1:
            reason += f", clamped to {min(1.0, max(0.0, score)):g}"
        return _outcome(score, f"{reason} (test.sh: {status})", tests=tests, log_text=log_text,
                        started=started)


# --- SWE-bench -----------------------------------------------------------------------------------

_PYTEST_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
                  "XFAIL": "passed", "XPASS": "passed"}


def parse_pytest_report(output: str) -> list[tuple[str, str]]:
    """(status word, rest of line) of each pytest -rA summary line."""
    found = []
    for line in output.splitlines():
        word, _, rest = line.partition(" ")
        if word in _PYTEST_STATUS and rest:
            found.append((word, rest.strip()))
    return found


def _test_outcomes(output: str, expected: list[str]) -> dict[str, str]:
    lines = parse_pytest_report(output)
    tests: dict[str, str] = {}
    for word, rest in lines:
        tests[rest.split(" - ", 1)[0]] = _PYTEST_STATUS[word]
    for test_id in expected:
        outcome = None
        for word, rest in lines:
            if rest == test_id or rest.startswith(test_id + " - "):
                outcome = _PYTEST_STATUS[word]
                if outcome != "passed":
                    break  # a failure (e.g. an ERROR at teardown) wins over a PASSED line
        tests[test_id] = outcome or "error"
    return tests


def _tree_entry(workspace: Workspace, path: str) -> tuple[str, str] | None:
    """(mode, blob) of `path` in the baseline, or None."""
    proc = workspace.git("ls-tree", "-z", workspace.baseline, "--", path)
    record = proc.stdout.split(b"\0")[0]
    if not record:
        return None
    meta, _, name = record.partition(b"\t")
    mode, kind, blob = meta.decode().split()
    if os.fsdecode(name) != path or kind != "blob":
        return None
    return mode, blob


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _restore(workspace: Workspace, path: str) -> None:
    """Make `path` in the tree exactly what the baseline had (or absent)."""
    if _bad_path(path):
        raise GradingError(f"cannot restore {path!r}")
    current = workspace.root
    for component in PurePosixPath(path).parts[:-1]:
        current = current / component
        if current.is_symlink() or (current.exists() and not current.is_dir()):
            current.unlink()
    target = workspace.root / path
    if target.is_symlink() or target.exists():
        _remove(target)
    entry = _tree_entry(workspace, path)
    if entry is None:
        return
    mode, blob = entry
    data = workspace.git("cat-file", "blob", blob).stdout
    target.parent.mkdir(parents=True, exist_ok=True)
    if mode == "120000":
        os.symlink(os.fsdecode(data), target)
    else:
        target.write_bytes(data)
        target.chmod(0o755 if mode == "100755" else 0o644)


def _protected_paths(workspace: Workspace) -> list[str]:
    """Files the model's diff changed whose names make them pytest/site hooks."""
    workspace.snapshot_index()
    proc = workspace.git("diff-index", "--cached", "-z", "--no-renames", "--name-only",
                         workspace.baseline)
    workspace.reset_index()
    names = [os.fsdecode(name) for name in proc.stdout.split(b"\0") if name]
    return [name for name in names
            if PurePosixPath(name).name in PROTECTED_NAMES or name.endswith(".pth")]


def _task_flag(task: Any, name: str) -> bool:
    value = getattr(task, name, None)
    if value is None:
        metadata = getattr(task, "metadata", None)
        if isinstance(metadata, dict):
            value = metadata.get(name)
    return bool(value)


def _id_list(value: Any) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = [value]
    return [str(item) for item in (value or [])]


def grade_swebench(task: Any, diff: str, backend: SandboxBackend,
                   limits: SandboxLimits | None = None) -> GradeOutcome:
    """Apply `diff`, restore and re-apply the test files, run FAIL_TO_PASS + PASS_TO_PASS."""
    started = time.monotonic()
    fail_to_pass = _id_list(task.fail_to_pass)
    pass_to_pass = _id_list(task.pass_to_pass)
    try:
        image = _image(backend, task)
        workspace = prepare_workspace(Path(task.repo_dir))
    except (GradingError, OSError) as exc:
        return _outcome(0, f"grading setup failed: {exc}", started=started,
                        infrastructure_error=True)
    with workspace:
        ok, why = apply_diff(workspace, diff)
        if not ok:
            return _outcome(0, f"patch did not apply: {why}", started=started)
        test_patch = task.test_patch or ""
        patch_file = workspace.base / "test.patch"
        patch_file.write_bytes(test_patch.encode("utf-8", errors="surrogateescape"))
        test_paths = _numstat_paths(workspace, patch_file) if test_patch.strip() else []
        if test_paths is None:
            return _outcome(0, "the task's test_patch cannot be parsed", started=started,
                            infrastructure_error=True)
        restored = sorted(set(test_paths) | set(_protected_paths(workspace)))
        for path in restored:
            _restore(workspace, path)
        if test_patch.strip():
            proc = workspace.git("apply", str(patch_file), check=False)
            if proc.returncode != 0:
                return _outcome(0, f"the task's test_patch did not apply after restoring the "
                                   f"test files: {_git_message(proc)}", started=started,
                                infrastructure_error=True)
        ids = " ".join(shlex.quote(test_id) for test_id in fail_to_pass + pass_to_pass)
        command = (f"set -o pipefail 2>/dev/null; ( {task.test_command} {ids} ) 2>&1 "
                   f"| tail -c {MAX_TEST_OUTPUT_BYTES}")
        run = _run(backend, f"bash -c {shlex.quote(command)}", workspace,
                   _task_limits(limits, getattr(task, "verifier_timeout_s", None)),
                   {}, {}, {"WORKSPACE": "/workspace", "PYTHONDONTWRITEBYTECODE": "1"}, image)
        log_text = _run_log(run)
        if run.error:
            return _outcome(0, run.error, log_text=log_text, started=started,
                            infrastructure_error=True)
        tests = _test_outcomes(run.stdout, fail_to_pass + pass_to_pass)
        f2p_ok = [test_id for test_id in fail_to_pass if tests[test_id] == "passed"]
        p2p_bad = [test_id for test_id in pass_to_pass if tests[test_id] != "passed"]
        f2p_bad = [test_id for test_id in fail_to_pass if tests[test_id] != "passed"]
        status = run.result.reason
        summary = (f"FAIL_TO_PASS {len(f2p_ok)}/{len(fail_to_pass)} passed, PASS_TO_PASS "
                   f"{len(pass_to_pass) - len(p2p_bad)}/{len(pass_to_pass)} passed ({status})")
        if restored:
            summary += f"; restored test files {restored[:5]}" + ("..." if len(restored) > 5 else "")
        if f2p_bad:
            summary += f"; not passing: {f2p_bad[:5]}"
        if p2p_bad:
            summary += f"; broken: {p2p_bad[:5]}"
        if p2p_bad:
            score = 0.0
        elif _task_flag(task, "partial_credit") and fail_to_pass:
            score = len(f2p_ok) / len(fail_to_pass)
        else:
            score = 1.0 if not f2p_bad else 0.0
        return _outcome(score, summary, tests=tests, log_text=log_text, started=started)


# --- references and validation -------------------------------------------------------------------


def _is_swe(task: Any) -> bool:
    return hasattr(task, "instance_id") and hasattr(task, "test_patch")


def grade(task: Any, diff: str, backend: SandboxBackend,
          limits: SandboxLimits | None = None) -> GradeOutcome:
    """grade_swebench or grade_harbor, by the task's kind."""
    if _is_swe(task):
        return grade_swebench(task, diff, backend, limits)
    return grade_harbor(task, diff, backend, limits)


def reference_diff(task: Any, backend: SandboxBackend,
                   limits: SandboxLimits | None = None) -> str:
    """The task's reference solution as a diff (Harbor: solve.sh run in the sandbox)."""
    if _is_swe(task):
        return task.gold_patch or ""
    solution = getattr(task, "solution", None)
    if solution is None or not Path(solution).is_file():
        raise GradingError(f"task {_task_name(task)} has no solution/solve.sh")
    image = _image(backend, task)
    with prepare_workspace(getattr(task, "workspace", None)) as workspace:
        staged = _stage_copy(Path(solution).parent, workspace.base / "solution")
        logs = workspace.scratch("logs")
        (logs / "agent").mkdir(mode=0o755)
        timeout = getattr(task, "agent_timeout_s", None) or getattr(task, "verifier_timeout_s", None)
        run = _run(backend, f"bash /solution/{shlex.quote(Path(solution).name)}", workspace,
                   _task_limits(limits, timeout), {"/solution": staged}, {"/logs": logs},
                   {"WORKSPACE": "/workspace", "LOGS_DIR": "/logs"}, image)
        if run.error:
            raise GradingError(f"reference solution of {_task_name(task)}: {run.error}")
        if run.result.exit_code != 0:
            raise GradingError(f"reference solution of {_task_name(task)} failed "
                               f"({run.result.reason}): {_cap_text(_run_log(run), 2000)}")
        return workspace.diff()


@dataclass
class ValidationResult:
    name: str
    reference_score: float | None
    empty_score: float | None
    ok: bool
    problem: str


def validate_tasks(tasks: list[Any], backend: SandboxBackend,
                   limits: SandboxLimits | None = None) -> list[ValidationResult]:
    """Each task's reference solution must grade 1 and an empty diff 0."""
    results = []
    for task in tasks:
        name = _task_name(task)
        try:
            reference = grade(task, reference_diff(task, backend, limits), backend, limits)
            empty = grade(task, "", backend, limits)
        except (GradingError, OSError) as exc:
            results.append(ValidationResult(name, None, None, False, f"could not grade: {exc}"))
            continue
        problems = []
        if reference.infrastructure_error or empty.infrastructure_error:
            problems.append(f"infrastructure error: {reference.reason if reference.infrastructure_error else empty.reason}")
        if reference.score != 1:
            problems.append(f"reference solution scores {reference.score:g}: {reference.reason}")
        if empty.score != 0:
            problems.append(f"empty diff scores {empty.score:g}: {empty.reason}")
        results.append(ValidationResult(name, reference.score, empty.score, not problems,
                                        "; ".join(problems)))
    return results


# --- logs ----------------------------------------------------------------------------------------


def store_log(storage: Any, run_id: str, name: str, text: str) -> str:
    """Write `text` to {run_id}/logs/{name}.log in a shared.storage.Storage, atomically (temp
    name, then rename); returns its path."""
    for what, value in (("run_id", run_id), ("name", name)):
        if not _SAFE_NAME.match(value or ""):
            raise ValueError(f"{what} {value!r} cannot name a stored file")
    final = storage.path(run_id, "logs", f"{name}.log")
    storage.fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
    temp = f"{final}.tmp-{uuid.uuid4().hex}"
    with storage.fs.open_output_stream(temp) as out:
        out.write(text.encode("utf-8", errors="replace"))
    storage.fs.move(temp, final)
    return final
