"""Applying an agent's diff to a grading workspace (shared/sandbox/workspace.py) without letting it
reach outside.

`apply_diff(workspace, diff)`: first a dry run into the index only (`git apply --cached`, then
`--cached --3way`); paths git would touch must be relative and inside the tree, and a symlink the
patch creates must point inside the workspace (relative, never above the root): checked on the
dry run's result BEFORE the work tree is touched. Then the real `git apply` (or `--3way`), and a
physical check (realpath) of every symlink the patch touched. An unappliable patch gives
(False, git's message).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path, PurePosixPath

from rollstream.shared.sandbox.workspace import GitWorkspace


def git_message(*procs: subprocess.CompletedProcess) -> str:
    lines: list[str] = []
    for proc in procs:
        for line in proc.stderr.decode("utf-8", errors="replace").splitlines():
            if line.strip() and line not in lines:
                lines.append(line.strip())
    return "; ".join(lines)[:2000] or "git apply failed"


def bad_path(path: str) -> str | None:
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


def numstat_paths(workspace: GitWorkspace, patch: Path) -> list[str] | None:
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


def _changed_entries(workspace: GitWorkspace) -> list[tuple[str, str, str]]:
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


def _check_result(workspace: GitWorkspace, entries: list[tuple[str, str, str]]) -> str | None:
    """Refuse a dry-run result that writes through a symlink or creates one pointing out."""
    for mode, blob, path in entries:
        bad = bad_path(path)
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


def apply_diff(workspace: GitWorkspace, diff: str) -> tuple[bool, str]:
    """Apply `diff` to the workspace (git apply, then git apply --3way); (ok, reason)."""
    if not diff.strip():
        return True, "empty diff: nothing to apply"
    patch = workspace.base / f"patch-{uuid.uuid4().hex[:8]}.diff"
    patch.write_bytes(diff.encode("utf-8", errors="surrogateescape"))
    try:
        paths = numstat_paths(workspace, patch)
        for path in paths or []:
            bad = bad_path(path)
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
                return False, git_message(first, second)
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
            return False, git_message(proc)
        for _, _, path in entries:  # physical check of what it made
            real = workspace.root / path
            if real.is_symlink():
                resolved = Path(os.path.realpath(real))
                if resolved != workspace.root and workspace.root not in resolved.parents:
                    return False, f"patch made a symlink {path!r} that resolves outside the workspace"
        return True, "applied" + (" (3-way)" if three_way else "")
    finally:
        patch.unlink(missing_ok=True)

