"""The workspace of a coding episode: a copy of the task's repository the coding tools (coding.py) edit.

One `Workspace` per episode, shared by all coding tools through `episode.state["workspace"]`: the
first tool's `create()` makes it, the others find it there. It is the project's one hardened git
workspace (shared/sandbox/workspace.py: our git directory outside the model-written tree, a clean
git environment, snapshots that nothing in the tree can hide from), in a fresh `rs-ws-{pid}-*`
temporary directory, holding

    repo/   the task repository (a copy of metadata["repo"], with metadata["files"] written over
            it); the model's tools work here, and it is metadata["workdir"] (default /workspace)
            inside the sandbox
    git/    a git directory of our own, outside repo/ and never visible to the sandbox
    diff    the episode's diff, written at release

The source directory is only ever read. At release the diff against the baseline (text and binary
changes, new and deleted files, mode changes and symlinks, as a patch that `git apply` applies to a
fresh copy of the source; what the snapshot left out is counted and logged) is stored at
`{run_id}/artifacts/{episode_id}.diff` in `Storage(episode.storage_uri)` and its path set as
`episode.artifacts["diff"]` (with no storage_uri it is not stored), then the workspace is
deleted. Release is idempotent: the first tool to get there does it; the others, and any later
call, find it done.

Shell commands run in the task's sandbox backend (bubblewrap by default, shared/sandbox/) with repo/
bound at the workdir: no network, rlimits from metadata["limits"] over the defaults here (30 s
wall clock). Calls on one workspace are serialized by a thread lock (the sandbox chowns the tree
for a run), so a file tool never races a shell command, nor release a call still running after
its coroutine was cancelled.

    python -m pytest tests/unit/shared/agent/test_coding_env.py -q
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import threading
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

from rollstream.shared.agent.tools import Episode, ToolError
from rollstream.shared.errors import CodingTaskError, SandboxError
from rollstream.shared.runtime.storage import Storage
from rollstream.shared.sandbox.backends import get_backend
from rollstream.shared.sandbox.base import DEFAULT_WORKDIR, SandboxLimits, SandboxResult, sandbox_path
from rollstream.shared.sandbox.workspace import GitWorkspace

log = logging.getLogger(__name__)


DEFAULT_LIMITS = SandboxLimits(wall_time_s=30, cpu_time_s=30)
"""Sandbox limits for run_shell and run_tests; metadata["limits"] overrides fields of it."""
DEFAULT_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}
"""Sandbox environment (over sandbox.py's PATH, HOME, LANG); metadata["env"] adds to it."""
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_STATE_KEY = "workspace"
_LOCK_KEY = "workspace_lock"

# --- the workspace -------------------------------------------------------------------------------


class Workspace(GitWorkspace):
    """A task repository copy (shared.sandbox.workspace.GitWorkspace) with the episode's sandbox
    settings, a file for its diff, and host-side path confinement for the file tools.

    Blocking methods; the tools call them in a worker thread that holds `lock` (a thread lock, so
    a call whose coroutine was cancelled, e.g. by ToolSet's time limit, keeps the workspace until
    its thread is really done)."""

    def __init__(self, base: Path, limits: SandboxLimits = DEFAULT_LIMITS,
                 env: dict[str, str] | None = None, test_command: str | None = None,
                 backend: str = "bubblewrap", workdir: str = DEFAULT_WORKDIR) -> None:
        super().__init__(base)
        self.diff_file = base / "diff"
        self.limits = limits
        self.env = env or {}
        self.test_command = test_command
        self.backend = backend
        self.workdir = workdir
        """Where repo/ is inside the sandbox."""
        self.closed = False
        """Set (synchronously) by the first release; later calls find the workspace gone."""
        self.lock = threading.Lock()

    @classmethod
    def for_task(cls, metadata: dict[str, Any]) -> Workspace:
        """Copy the task's repository into a fresh temporary directory, write metadata["files"]
        over it, and snapshot it."""
        limits, env, test_command, workdir = _task_settings(metadata)
        repo, files = _task_source(metadata)

        def write_files(workspace: Workspace) -> None:
            for relative, content in files.items():
                target = workspace.resolve(relative)
                target.parent.mkdir(parents=True, exist_ok=True)
                if target.is_symlink() or (target.exists() and not target.is_file()):
                    raise CodingTaskError(f"metadata['files'][{relative!r}] would replace a "
                                          "directory or symlink of the repository")
                target.write_bytes(content.encode() if isinstance(content, str) else bytes(content))

        try:
            workspace = cls.create("ws", repo, write_files, limits=limits, env=env,
                                   test_command=test_command,
                                   backend=metadata.get("sandbox_backend") or "bubblewrap",
                                   workdir=workdir)
        except ToolError as exc:
            raise CodingTaskError(f"metadata['files']: {exc}") from None
        return workspace

    def capture_diff(self) -> Path:
        """Write the diff of repo/ against the baseline to `diff_file` (outside repo/)."""
        skipped = self.write_diff(self.diff_file)
        left_out = {name: count for name, count in skipped.items() if count}
        if left_out:
            log.info("workspace %s: diff leaves out %s (.git metadata, Python caches, special "
                     "files are never part of a snapshot)", self.base, left_out)
        return self.diff_file

    # confinement of host-side paths

    def resolve(self, path: Any) -> Path:
        """`path` (relative to repo/) on the host; ToolError if it is not inside repo/."""
        if not isinstance(path, str) or not path.strip():
            raise ToolError("path must be a non-empty path relative to the repository root")
        if "\0" in path:
            raise ToolError("path must not contain NUL characters")
        pure = PurePosixPath(path)
        if pure.is_absolute():
            raise ToolError(f"{path!r} is an absolute path: give a path relative to the "
                            "repository root (e.g. 'src/main.py')")
        if ".." in pure.parts:
            raise ToolError(f"{path!r} contains '..': paths must stay inside the repository")
        candidate = self.root.joinpath(*pure.parts)
        real = Path(os.path.realpath(candidate))
        if real != self.root and self.root not in real.parents:
            raise ToolError(f"{path!r} resolves outside the repository (through a symlink): refused")
        return real

    def display(self, real: Path) -> str:
        relative = real.relative_to(self.root).as_posix()
        return relative or "."

    # the sandbox

    def run(self, command: str) -> SandboxResult:
        """Run in the sandbox backend the task names (`sandbox_backend`, default bubblewrap): the same
        backends the grader uses, with repo/ at the same place (`workdir`)."""
        return get_backend(self.backend).run(command, self.root, limits=self.limits, env=self.env,
                                             workdir=self.workdir)


def _task_settings(metadata: dict[str, Any]) -> tuple[SandboxLimits, dict[str, str], str | None, str]:
    limits = DEFAULT_LIMITS
    overrides = metadata.get("limits") or {}
    if not isinstance(overrides, dict):
        raise CodingTaskError("metadata['limits'] must be a map of SandboxLimits fields")
    fields = {f.name for f in dataclasses.fields(SandboxLimits)}
    unknown = set(overrides) - fields
    if unknown:
        raise CodingTaskError(f"metadata['limits'] has unknown fields {sorted(unknown)}; "
                              f"known: {sorted(fields)}")
    limits = dataclasses.replace(limits, **overrides)
    extra_env = metadata.get("env") or {}
    if not isinstance(extra_env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in extra_env.items()):
        raise CodingTaskError("metadata['env'] must map names to string values")
    test_command = metadata.get("test_command") or None
    if test_command is not None and not isinstance(test_command, str):
        raise CodingTaskError("metadata['test_command'] must be a shell command string")
    try:
        workdir = sandbox_path(metadata.get("workdir") or DEFAULT_WORKDIR, "metadata['workdir']")
    except SandboxError as exc:
        raise CodingTaskError(str(exc)) from None
    return limits, {**DEFAULT_ENV, **extra_env}, test_command, workdir


def _task_source(metadata: dict[str, Any]) -> tuple[Path | None, dict[str, str | bytes]]:
    repo = metadata.get("repo")
    files = metadata.get("files") or {}
    if isinstance(files, str):
        files = json.loads(files)
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, (str, bytes))
                                              for k, v in files.items()):
        raise CodingTaskError("metadata['files'] must map relative paths to file contents")
    if repo is None and not files:
        raise CodingTaskError("a coding task needs metadata['repo'] (a directory to copy) or "
                              "metadata['files'] (a map of path -> content)")
    if repo is not None:
        repo = Path(repo)
        if not repo.is_dir():
            raise CodingTaskError(f"metadata['repo'] {str(repo)!r} is not a directory")
    return repo, files


# --- per-episode sharing -------------------------------------------------------------------------


async def get_workspace(episode: Episode) -> Workspace:
    """The episode's workspace, made on first use; ToolError once it has been released."""
    workspace = episode.state.get(_STATE_KEY)
    if workspace is None:
        lock = episode.state.setdefault(_LOCK_KEY, asyncio.Lock())
        async with lock:
            workspace = episode.state.get(_STATE_KEY)
            if workspace is None:
                workspace = await asyncio.to_thread(Workspace.for_task, episode.metadata)
                episode.state[_STATE_KEY] = workspace
    if workspace.closed:
        raise ToolError("the workspace has been released: the episode is over")
    return workspace


async def release_workspace(episode: Episode) -> None:
    """Capture and store the diff, then delete the workspace. Safe to call any number of times."""
    workspace = episode.state.get(_STATE_KEY)
    if workspace is None or workspace.closed:
        return
    workspace.closed = True  # before any await: a concurrent release returns at once
    stored = await asyncio.to_thread(_finish, workspace, episode.storage_uri, episode.run_id,
                                     episode.episode_id)
    if stored is not None:
        episode.artifacts["diff"] = stored


def _finish(workspace: Workspace, storage_uri: str | None, run_id: str, episode_id: str) -> str | None:
    """In one thread, after any call in flight: capture the diff, store it, delete the workspace
    (always, also when capturing or storing fails). Returns the stored path."""
    with workspace.lock:
        try:
            diff = workspace.capture_diff()
            if storage_uri is None:
                return None
            return store_artifact(storage_uri, diff, run_id, episode_id, ".diff")
        finally:
            workspace.cleanup()


def store_artifact(storage_uri: str, local: Path, run_id: str, episode_id: str, suffix: str) -> str:
    """Copy `local` to {run_id}/artifacts/{episode_id}{suffix} atomically; returns the stored path."""
    for what, value in (("run_id", run_id), ("episode_id", episode_id)):
        if not _SAFE_ID.match(value or ""):
            raise ValueError(f"{what} {value!r} cannot name a stored file")
    storage = Storage(storage_uri)
    final = storage.path(run_id, "artifacts", f"{episode_id}{suffix}")
    storage.fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
    temp = f"{final}.tmp-{uuid.uuid4().hex}"
    with open(local, "rb") as source, storage.fs.open_output_stream(temp) as out:
        while chunk := source.read(1024 * 1024):
            out.write(chunk)
    storage.fs.move(temp, final)
    return final
