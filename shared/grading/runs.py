"""Running a task's command in the sandbox for the grader, and telling the sandbox's failures apart
from the command's.

The command is wrapped to print a marker line before anything the task or model controls runs; a
failed run without the marker (or a backend exception) is an infrastructure error (callers retry
those), never a test failure, and vice versa. With `flag_leftovers`, the wrapper then looks for
processes the command left running in the sandbox (any of them could still change what the command
wrote) and says so through its exit status, PROCESSES_LEFT_EXIT (SandboxRun.processes_left): the
status, unlike output, is the wrapper's alone to set. Also: the grading limits (the task's verifier
timeout as the wall clock), staging trusted task files next to the workspace, the task image for
backends that build one, a SWE row's test environment (`task_environment`: the backend's virtual
environment or image of the row's EnvironmentSpec), and `store_log` (an atomic write of a grading log to
storage).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.shared.errors import GradingError, SandboxError, TaskError
from rollstream.shared.sandbox.base import (
    DEFAULT_WORKDIR,
    SandboxBackend,
    SandboxEnvironment,
    SandboxLimits,
    SandboxResult,
)
from rollstream.shared.sandbox.workspace import GitWorkspace
from rollstream.shared.tasks.environment_spec import environment_spec

MAX_TEST_OUTPUT_BYTES = 512 * 1024
"""SWE test output: the last this many bytes are kept (pytest's -rA summary is at the end)."""

DEFAULT_GRADE_LIMITS = SandboxLimits(wall_time_s=600, cpu_time_s=600, memory_mb=4096,
                                     max_processes=256, max_file_size_mb=256, max_open_files=1024,
                                     max_output_bytes=MAX_TEST_OUTPUT_BYTES + 4096, tmp_size_mb=512)
"""Limits for test runs; the wall clock (and CPU time) is the task's verifier timeout when set."""

STARTED_MARKER = "rs-grader: sandbox started"
"""Printed by our wrapper before any task or model code runs (see infrastructure_error)."""

PROCESSES_LEFT_EXIT = 254
"""The wrapper's exit status when the command ended (status < 128) but left processes running; a
command's own exit 254 is passed on as 255, so this status is never the command's."""

_SCAN_ROUNDS = 50

_LEFTOVER_SCAN = f"""status=$?
if [ "$status" -lt 128 ]; then
  left= rounds=0
  while :; do
    vanished=
    for proc in /proc/[0-9]*; do
      pid=${{proc#/proc/}}
      case $pid in 1|$$) continue ;; esac
      if read -r stat 2>/dev/null < "$proc/stat"; then
        state=${{stat##*)}}; state=${{state# }}; state=${{state%% *}}
        case $state in Z|X) ;; *) left="$left $pid" ;; esac
      else
        vanished=1
      fi
    done
    [ -n "$left" ] || [ -z "$vanished" ] && break
    rounds=$((rounds + 1))
    if [ "$rounds" -ge {_SCAN_ROUNDS} ]; then left=" (new ones kept appearing)"; break; fi
  done
  if [ -n "$left" ]; then
    echo "rs-grader: still running after the command:$left" >&2
    exit {PROCESSES_LEFT_EXIT}
  fi
fi
[ "$status" -eq {PROCESSES_LEFT_EXIT} ] && status=255
exit "$status"
"""
"""Run by the wrapper (never forking, so it sees only what the command left) right after the command:
each process in the sandbox but pid 1 and the wrapper, zombies aside, is one the command left
running. A pid that vanishes between listing and reading forces another look, so a process that
keeps forking and exiting cannot slip between them. Signals (status >= 128) are passed on as they
are: such a run is not trusted anyway."""

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _wrap(command: str, flag_leftovers: bool = False) -> str:
    """Print the start marker (nothing the task controls runs before it), then the command, then
    (flag_leftovers) look for processes it left running."""
    wrapped = f"printf '%s\\n' {shlex.quote(STARTED_MARKER)}; {command}"
    return f"{wrapped}\n{_LEFTOVER_SCAN}" if flag_leftovers else wrapped


@dataclass
class SandboxRun:
    result: SandboxResult | None
    error: str | None
    """Set when the sandbox could not run (an infrastructure error)."""
    stdout: str = ""
    processes_left: bool = False
    """The command ended but left processes running (only looked for with flag_leftovers)."""


def run_wrapped(backend: SandboxBackend, command: str, workspace: GitWorkspace | Path, limits: SandboxLimits,
                ro_mounts: dict[str, Path], rw_mounts: dict[str, Path], env: dict[str, str],
                image: str | None, workdir: str = DEFAULT_WORKDIR, *,
                kept_mounts: dict[str, Path] | None = None,
                flag_leftovers: bool = False) -> SandboxRun:
    """Run `command` behind the start marker with the workspace (a GitWorkspace, or a plain
    directory such as the shell check's) at `workdir` in the sandbox; a backend exception or a
    missing marker is an infrastructure error (SandboxRun.error).
    kept_mounts: read-write mounts left with their owner (SandboxBackend.run); flag_leftovers: tell
    whether the command left processes running (SandboxRun.processes_left)."""
    root = workspace.root if isinstance(workspace, GitWorkspace) else Path(workspace)
    try:
        result = backend.run(_wrap(command, flag_leftovers), root, limits=limits,
                             ro_mounts=ro_mounts, rw_mounts=rw_mounts, env=env, image=image,
                             workdir=workdir, kept_mounts=kept_mounts)
    except (SandboxError, GradingError, OSError) as exc:
        return SandboxRun(None, f"sandbox failed: {type(exc).__name__}: {exc}")
    first, _, rest = result.stdout.partition("\n")
    if first != STARTED_MARKER:
        return SandboxRun(result, f"sandbox did not start the command ({result.reason}): "
                          f"{result.stderr.strip()[:500]}")
    return SandboxRun(result, None, rest,
                      processes_left=flag_leftovers and result.exit_code == PROCESSES_LEFT_EXIT)


def run_log(run: SandboxRun) -> str:
    result = run.result
    if result is None:
        return run.error or ""
    parts = [f"[{result.reason}; {result.duration_s:.1f}s"
             + ("; output truncated" if result.output_truncated else "") + "]",
             "--- stdout ---", run.stdout, "--- stderr ---", result.stderr]
    return "\n".join(parts)


def task_limits(limits: SandboxLimits | None, timeout_s: float | None) -> SandboxLimits:
    limits = limits or DEFAULT_GRADE_LIMITS
    if timeout_s:
        limits = dataclasses.replace(limits, wall_time_s=float(timeout_s),
                                     cpu_time_s=max(limits.cpu_time_s, float(timeout_s)))
    return limits


def stage_copy(source: Path, target: Path) -> Path:
    """Copy a trusted task directory next to the workspace, readable by the sandbox (0755/0644)."""
    shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
    for path in [target, *target.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        path.chmod(0o755 if path.is_dir() or mode & 0o111 else 0o644)
    return target


def task_name(task: Any) -> str:
    return str(getattr(task, "name", None) or getattr(task, "instance_id", None) or "task")


def environment_dir(task: Any) -> Path | None:
    dockerfile = getattr(task, "dockerfile", None)
    if dockerfile is not None and Path(dockerfile).is_file():
        return Path(dockerfile).parent
    return None


def task_image(backend: SandboxBackend, task: Any) -> str | None:
    image_for = getattr(backend, "image_for", None)
    return image_for(environment_dir(task)) if image_for is not None else None


def task_environment(backend: SandboxBackend, task: Any) -> SandboxEnvironment:
    """What a SWE row's tests run with: the docker backend's image of the row (image_for_task: its dockerfile,
    a published image, or one built from its EnvironmentSpec); the bubblewrap backend's virtual environment
    of the row's EnvironmentSpec (environment_for: built on first use); else the task's image, as before
    rows had environments. A bad spec is a GradingError; a build that fails raises the backend's SandboxError
    (both infrastructure errors for the grader)."""
    image_for_task = getattr(backend, "image_for_task", None)
    environment_for = getattr(backend, "environment_for", None)
    try:
        if image_for_task is not None:
            return SandboxEnvironment(image=image_for_task(task))
        spec = environment_spec(task) if environment_for is not None else None
    except TaskError as exc:
        raise GradingError(f"the row's environment: {exc}") from exc
    environment = environment_for(spec) if spec is not None else None
    return environment if environment is not None else SandboxEnvironment(image=task_image(backend, task))


def store_log(storage: Any, run_id: str, name: str, text: str) -> str:
    """Write `text` to {run_id}/logs/{name}.log in a rollstream.shared.runtime.storage.Storage, atomically
    (temp name, then rename); returns its path."""
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

