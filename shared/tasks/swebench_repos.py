"""The repository snapshot of a SWE-bench row, found from the row's own columns.

A published row names its repository (`repo`, "owner/name") and the commit the task starts from
(`base_commit`), not a directory. The rows' repositories are git clones in a `repos_dir`, named as
SWE-bench names them: "owner/name" -> `owner__name`. A row's snapshot is that clone's tree at the
commit, written once into `<repos_dir>/.snapshots/<clone>/<commit>` and reused (no `.git` inside: the
grader and the sandboxes take a plain tree).

SWE-smith rows have no base_commit: their `repo` is the SWE-smith mirror "swesmith/owner__name.<commit>"
and their `patch` is the bug, applied to the clean repository. Their snapshot is the clone's tree at
that commit with the bug applied (cached under `<commit>+bug-<digest of the patch>`), and the reference
fix is the reverse of the bug patch, computed here with git. The clone may be named after the mirror
(`owner__name.<commit>`) or after the upstream repository (`owner__name`).

Every failure is a TaskError that says what to do ("clone https://github.com/owner/name into ...",
"commit abc is not in ...: fetch it"). Run its tests with:

    python -m pytest tests/unit/shared/tasks -q
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rollstream.shared.errors import TaskError

SNAPSHOTS = ".snapshots"
SWESMITH_PREFIX = "swesmith/"


@dataclass(frozen=True)
class Snapshot:
    repo_dir: Path               # the tree the task starts from
    gold_patch: str | None       # set when the snapshot derives it (SWE-smith: the bug patch reversed)


def clone_name(repo: str) -> str:
    """SWE-bench's directory name of a repository: "owner/name" -> "owner__name"."""
    return repo.replace("/", "__")


def swesmith_parts(repo: str) -> tuple[str, str] | None:
    """(upstream "owner/name", commit) of a SWE-smith mirror name "swesmith/owner__name.<commit>"."""
    if not repo.startswith(SWESMITH_PREFIX):
        return None
    mirror = repo[len(SWESMITH_PREFIX):]
    upstream, _, commit = mirror.rpartition(".")
    if not upstream or not commit or "__" not in upstream:
        return None
    return upstream.replace("__", "/", 1), commit


def _git(clone: Path, *args: str, stdin: bytes | None = None, env: dict | None = None,
         ) -> subprocess.CompletedProcess:
    if shutil.which("git") is None:
        raise TaskError("git is not installed: a row without 'repo_dir' is checked out from a clone with git")
    return subprocess.run(["git", "-C", str(clone), *args], input=stdin, capture_output=True,
                          env={**os.environ, **(env or {})}, check=False)


def _find_clone(repos_dir: Path, names: list[str], repo: str, where: str) -> Path:
    for name in names:
        if (repos_dir / name).is_dir():
            return repos_dir / name
    raise TaskError(f"{where}: no clone of {repo} in {repos_dir}: clone https://github.com/{repo} "
                    f"into {repos_dir / names[-1]}")


def _resolve_commit(clone: Path, commit: str, where: str) -> str:
    found = _git(clone, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    if found.returncode != 0:
        raise TaskError(f"{where}: commit {commit} is not in {clone}: fetch it "
                        f"(git -C {clone} fetch origin {commit})")
    return found.stdout.decode().strip()


def _write_tree(clone: Path, tree_ish: str, target: Path, where: str) -> None:
    """`tree_ish` of `clone`, extracted into `target`, which appears whole or not at all."""
    archive = _git(clone, "archive", "--format=tar", tree_ish)
    if archive.returncode != 0:
        raise TaskError(f"{where}: git archive {tree_ish} failed in {clone}: "
                        f"{archive.stderr.decode().strip()}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with tempfile.TemporaryFile() as tar_file:
            tar_file.write(archive.stdout)
            tar_file.seek(0)
            with tarfile.open(fileobj=tar_file) as tar:
                tar.extractall(partial, filter="data")
        try:
            partial.rename(target)
        except OSError:
            if not target.is_dir():  # another loader of the same rows wrote it first otherwise
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _bugged_tree(clone: Path, commit: str, bug_patch: str, where: str) -> tuple[str, str]:
    """The tree of `commit` with the bug patch applied, and the reference fix (bugged -> clean), made
    in a throwaway index so the clone's own index and work tree stay as they are."""
    with tempfile.TemporaryDirectory() as scratch:
        index = {"GIT_INDEX_FILE": str(Path(scratch) / "index")}
        steps = [("read-tree", commit), ("apply", "--cached", "-"), ("write-tree",)]
        for step in steps:
            done = _git(clone, *step, stdin=bug_patch.encode() if "-" in step else None, env=index)
            if done.returncode != 0:
                raise TaskError(f"{where}: the bug 'patch' does not apply to {commit[:12]} in {clone}: "
                                f"{done.stderr.decode().strip()}")
        tree = done.stdout.decode().strip()
    fix = _git(clone, "diff-tree", "-p", "--binary", "--full-index", tree, f"{commit}^{{tree}}")
    if fix.returncode != 0:
        raise TaskError(f"{where}: cannot reverse the bug patch in {clone}: {fix.stderr.decode().strip()}")
    return tree, fix.stdout.decode()


def checkout_snapshot(repos_dir: Path, repo: str, base_commit: str, where: str) -> Snapshot:
    """The snapshot of `repo` at `base_commit` from its clone in `repos_dir` (built once, then reused)."""
    clone = _find_clone(repos_dir, [clone_name(repo)], repo, where)
    commit = _resolve_commit(clone, base_commit, where)
    target = repos_dir / SNAPSHOTS / clone.name / commit
    if not target.is_dir():
        _write_tree(clone, commit, target, where)
    return Snapshot(repo_dir=target, gold_patch=None)


def swesmith_snapshot(repos_dir: Path, repo: str, bug_patch: str, where: str) -> Snapshot:
    """A SWE-smith row's snapshot: the clean commit its mirror name carries, with the bug applied."""
    parts = swesmith_parts(repo)
    if parts is None:
        raise TaskError(f"{where}: 'repo' {repo!r} is not a SWE-smith mirror name "
                        f"(swesmith/owner__name.commit)")
    upstream, short_commit = parts
    mirror = repo[len(SWESMITH_PREFIX):]
    clone = _find_clone(repos_dir, [mirror, clone_name(upstream)], upstream, where)
    commit = _resolve_commit(clone, short_commit, where)
    tree, gold_patch = _bugged_tree(clone, commit, bug_patch, where)
    digest = hashlib.sha256(bug_patch.encode()).hexdigest()[:16]
    target = repos_dir / SNAPSHOTS / clone.name / f"{commit}+bug-{digest}"
    if not target.is_dir():
        _write_tree(clone, tree, target, where)
    return Snapshot(repo_dir=target, gold_patch=gold_patch)
