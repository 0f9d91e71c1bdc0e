"""The one hardened git workspace: a copy of a task's tree, with a baseline snapshot to diff against.

The agent's coding tools (shared/agent/environments/coding.py) let the model edit one and store its
diff; the grader (shared/grading/) applies that diff to a fresh one and runs the tests in it. Both use
this class, so a hardening made here holds for both.

A workspace is a pid-tagged temporary directory (`rs-{kind}-{pid}-*`, see `workspace_prefix`) holding

    repo/   the tree: /workspace (or the task's WORKDIR) inside the sandbox, model-written
    git/    our git directory, OUTSIDE the tree and never visible to the sandbox
    ...     scratch directories beside them (`scratch`): tests, logs, patches

The tree is model-written, so a `.git/config` or `.gitattributes` in it could name commands for git
to run on the host (core.fsmonitor, filters, diff drivers). Our git directory's configuration is
ours (`GIT_CONFIG`, also passed with -c to every command); git runs on the host with hooks off, a
clean environment (no system or global config), no external diff or textconv, and
`$GIT_DIR/info/attributes` overriding the tree's .gitattributes (no filters, no end-of-line
conversion). A `.git` the task's tree had is copied along, so the model can read its history inside
the sandbox, but plays no part in any snapshot.

Snapshots (the baseline, and the state a diff is taken of) are a walk of repo/ that never follows
symlinks (`snapshot_paths`), recorded with `git update-index`: .gitignore rules, nested
repositories and ignored files cannot hide anything. Left out, always: `.git` entries at any depth,
Python caches, special files (FIFOs, sockets), names git refuses to record (a symlink named
.gitmodules) and empty directories; what was left out is counted, never dropped without a word.

    with GitWorkspace.create("grade", Path("task/environment/workspace")) as workspace:
        ...  # edit workspace.root, or apply a diff (shared/grading/diffs.py)
        print(workspace.diff())

    python -m pytest tests/unit/shared/sandbox tests/unit/shared/grading -q
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from rollstream.shared.errors import WorkspaceError

log = logging.getLogger(__name__)

GIT_TIMEOUT_S = 300
SNAPSHOT_EXCLUDED_NAMES = ("__pycache__", ".pytest_cache")
"""Directories never in a snapshot, at any depth (with .git and *.pyc, *.pyo files)."""
_EXCLUDED_SUFFIXES = (".pyc", ".pyo")

GIT_CONFIG = {
    "user.name": "rollstream", "user.email": "rollstream@localhost",
    "core.hooksPath": "/dev/null", "core.fsmonitor": "false", "core.untrackedCache": "false",
    "core.autocrlf": "false", "core.safecrlf": "false", "core.symlinks": "true",
    "core.fileMode": "true", "core.quotePath": "true", "commit.gpgSign": "false", "gc.auto": "0",
    "diff.external": "", "diff.noprefix": "false", "diff.mnemonicPrefix": "false",
    # The tree is never checked out on NTFS or HFS+, and our git directory lies outside it, so a
    # name that would alias .git there (git~1, .g\u200cit) is an ordinary file here: the coding
    # tools record it and the grader applies it alike (with git's defaults the grader refused
    # patches the coding tools had produced).
    "core.protectNTFS": "false", "core.protectHFS": "false",
    "apply.whitespace": "nowarn",
}
"""Written into our git directory's config, and passed with -c to every git command too."""
GIT_ATTRIBUTES = "* -text -filter -ident -working-tree-encoding !diff !eol\n"
"""$GIT_DIR/info/attributes, which outranks any .gitattributes in the work tree."""
_GIT_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C", "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0",
            "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}


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


class GitWorkspace:
    """base/repo (the tree), base/git (ours), scratch directories beside them; see the module."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.root = base / "repo"
        self.git_dir = base / "git"
        self.baseline = ""

    @classmethod
    def create(cls, kind: str, source: Path | None,
               fill: Callable[[GitWorkspace], None] | None = None, **options: Any) -> GitWorkspace:
        """A fresh copy of `source` (or an empty tree) in a new `rs-{kind}-{pid}-*` directory under
        the temp dir, then `fill(workspace)` (more files, before the baseline), then the baseline
        snapshot. `options` go to the constructor. Nothing is left behind when any step fails."""
        base = Path(tempfile.mkdtemp(prefix=workspace_prefix(kind))).resolve()
        try:
            base.chmod(0o711)  # the sandbox's host uid must be able to walk down to repo/
            workspace = cls(base, **options)
            if source is not None:
                source = Path(source)
                if not source.is_dir():
                    raise WorkspaceError(f"task workspace {source} is not a directory")
                shutil.copytree(source, workspace.root, symlinks=True)
            else:
                workspace.root.mkdir()
            workspace.root.chmod(0o755)
            if fill is not None:
                fill(workspace)
            workspace._init_git()
            workspace.baseline = workspace.snapshot_commit("baseline")
            workspace.git("update-ref", "refs/heads/baseline", workspace.baseline)
            return workspace
        except BaseException:
            shutil.rmtree(base, ignore_errors=True)
            raise

    def __enter__(self) -> GitWorkspace:
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

    # git, on the host

    def git(self, *args: str, stdin: bytes | None = None, check: bool = True,
            stdout: IO[bytes] | None = None) -> subprocess.CompletedProcess:
        """Run git on our git directory and the tree with a clean environment; WorkspaceError when
        it fails and `check` is set."""
        command = ["git", "--git-dir", str(self.git_dir), "--work-tree", str(self.root)]
        for key, value in GIT_CONFIG.items():
            command += ["-c", f"{key}={value}"]
        proc = subprocess.run(command + list(args), cwd=self.root,
                              env={**_GIT_ENV, "HOME": str(self.git_dir)}, input=stdin,
                              stdin=None if stdin is not None else subprocess.DEVNULL,
                              stdout=stdout if stdout is not None else subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=GIT_TIMEOUT_S, check=False)
        if check and proc.returncode != 0:
            raise WorkspaceError(f"git {args[0]} failed in {self.base} (exit {proc.returncode}): "
                                 f"{proc.stderr.decode(errors='replace').strip()[:2000]}")
        return proc

    def _init_git(self) -> None:
        self.git_dir.mkdir(mode=0o700)
        self.git("init", "--quiet")
        for key, value in GIT_CONFIG.items():
            self.git("config", key, value)
        (self.git_dir / "info").mkdir(exist_ok=True)
        (self.git_dir / "info" / "attributes").write_text(GIT_ATTRIBUTES)
        shutil.rmtree(self.git_dir / "hooks", ignore_errors=True)

    # snapshots and diffs

    def snapshot_index(self) -> dict[str, int]:
        """Make the index hold exactly the tree's files (with stat data); returns how many entries
        were left out, by kind."""
        paths, skipped = snapshot_paths(self.root)
        skipped["refused by git"] = 0
        self.git("read-tree", "--empty")
        if paths:
            proc = self.git("update-index", "--add", "-z", "--stdin", stdin=b"\0".join(paths) + b"\0")
            refused = [line for line in proc.stderr.decode(errors="replace").splitlines()
                       if line.startswith("Ignoring path ")]
            if refused:
                skipped["refused by git"] = len(refused)
                log.warning("workspace %s: git refused %d paths: %s", self.base, len(refused),
                            "; ".join(refused[:10]))
        return skipped

    def snapshot_commit(self, message: str = "snapshot") -> str:
        self.snapshot_index()
        tree = self.git("write-tree").stdout.decode().strip()
        return self.git("commit-tree", tree, "-m", message).stdout.decode().strip()

    def diff(self) -> str:
        """The tree's changes against the baseline (`git diff --binary --no-renames`: text and
        binary changes, new and deleted files, modes, symlinks)."""
        self.snapshot_index()
        return self._diff(None).stdout.decode("utf-8", errors="surrogateescape")

    def write_diff(self, path: Path) -> dict[str, int]:
        """The same diff written to `path`; returns what the snapshot left out, by kind."""
        skipped = self.snapshot_index()
        with open(path, "wb") as out:
            self._diff(out)
        return skipped

    def _diff(self, out: IO[bytes] | None) -> subprocess.CompletedProcess:
        return self.git("diff", "--cached", "--binary", "--no-renames", "--no-ext-diff",
                        "--no-textconv", "--no-color", "--src-prefix=a/", "--dst-prefix=b/",
                        self.baseline, "--", stdout=out)

    def reset_index(self) -> None:
        """Index = baseline, with fresh stat data (the tree is assumed to be the baseline)."""
        self.git("read-tree", self.baseline)
        self.git("update-index", "-q", "--refresh", check=False)


def prepare_workspace(source: Path | None) -> GitWorkspace:
    """A grading workspace: a fresh copy of `source` (or an empty tree) with its baseline."""
    return GitWorkspace.create("grade", source)


def workspace_prefix(kind: str) -> str:
    """Temp-dir prefix of a sandbox workspace, tagged with the creating process's pid, so that the
    workspaces of a process that died (a killed RQ work-horse) can be found and removed."""
    return f"rs-{kind}-{os.getpid()}-"


def remove_orphaned_workspaces(kind: str, tmp: Path | None = None) -> list[Path]:
    """Delete `kind` workspaces whose creating process no longer exists; returns what was removed."""
    removed = []
    for path in Path(tmp or tempfile.gettempdir()).glob(f"rs-{kind}-*-*"):
        pid_text = path.name[len(f"rs-{kind}-"):].split("-", 1)[0]
        if not pid_text.isdigit() or not path.is_dir():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # still alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
