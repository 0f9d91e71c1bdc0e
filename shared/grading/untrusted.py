"""Reading what code under test wrote: the verifier's reward files, made so that the code under test
can neither prepare nor protect them.

Before the run the grader makes the layout (`prepare_reward_files`): /logs and /logs/verifier
owned by the grader, mode 1777 (anyone may add files; the sticky bit keeps anyone but the owner from
deleting, renaming or replacing what is there), and reward.txt and reward.json in it, empty, owned
by the grader, mode 0666. The sandbox runs as another user (docker; bubblewrap as root: see
shared/sandbox/base.py's kept mounts), so it can write the files' contents but not chmod them,
delete, rename or replace them, nor swap the directory or point a symlink in their place: whatever
it writes early, the verifier's own write replaces. After the run (nothing of the sandbox is left
running), `parse_reward` checks that the layout is the one it made (same inodes, owners and modes,
regular files with one link each) and refuses the reward when it is not; with a sandbox that runs
as the grader's own user (bubblewrap, not root) this check is the only guard. Exactly one of the
two files may have been written: both written means the code under test may have written one
(reward.json beside test.sh's reward.txt), so neither is trusted.

Files are read without following symlinks (O_NOFOLLOW at every level), only when regular (a FIFO
cannot block the grader), and size capped (`read_untrusted_file`). reward.txt holds a number;
reward.json {"reward": x}, or per-test outcomes {"tests": {id: "passed"|...|bool}} -> fraction
passed; garbled or unwritten gives no score, with the reason.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

MAX_REWARD_FILE_BYTES = 1024 * 1024


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


REWARD_FILES = ("reward.txt", "reward.json")
"""The verifier's reward files, in /logs/verifier."""

_SHARED_DIR_MODE = 0o1777
_REWARD_FILE_MODE = 0o666


@dataclass(frozen=True)
class _Identity:
    """What the code under test must not have changed about an entry the grader made."""
    inode: int
    owner: int
    mode: int
    """File type and permission bits, as st_mode."""


@dataclass(frozen=True)
class RewardFiles:
    """The logs directory and the verifier's reward files as the grader made them."""
    logs: Path
    made: dict[str, _Identity]
    """Path relative to `logs` ("." for logs itself) -> what it was when made."""


def prepare_reward_files(logs: Path) -> RewardFiles:
    """Make logs/ and logs/verifier/ (1777) with empty reward.txt and reward.json (0666), all owned
    by us: the sandbox's user can write the files but not chmod, delete or replace them. The files
    must be owned by the directory's owner: with fs.protected_regular, the kernel refuses other
    users' O_CREAT opens (a shell's `>`) of a file in a sticky world-writable directory unless so."""
    verifier = logs / "verifier"
    verifier.mkdir(parents=True, exist_ok=True)
    for directory in (logs, verifier):
        directory.chmod(_SHARED_DIR_MODE)
    made = {".": _identity(logs), "verifier": _identity(verifier)}
    for name in REWARD_FILES:
        path = verifier / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     _REWARD_FILE_MODE)
        os.close(fd)
        path.chmod(_REWARD_FILE_MODE)  # past the umask
        made[f"verifier/{name}"] = _identity(path)
    return RewardFiles(logs, made)


def _identity(path: Path) -> _Identity:
    st = os.lstat(path)
    return _Identity(st.st_ino, st.st_uid, st.st_mode)


def _changes(files: RewardFiles) -> list[str]:
    """How the entries the grader made differ from what it made, in words."""
    changes = []
    for relative, was in files.made.items():
        where = "/logs" if relative == "." else f"/logs/{relative}"
        try:
            st = os.lstat(files.logs / relative)
        except FileNotFoundError:
            changes.append(f"{where} is gone")
            continue
        if stat.S_IFMT(st.st_mode) != stat.S_IFMT(was.mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else f"of file type {stat.S_IFMT(st.st_mode):o}"
            changes.append(f"{where} is now {kind}")
        elif st.st_ino != was.inode:
            changes.append(f"{where} was replaced")
        elif st.st_uid != was.owner:
            changes.append(f"{where} changed owner")
        elif st.st_mode != was.mode:
            changes.append(f"{where} has mode {stat.S_IMODE(st.st_mode):o}, "
                           f"made {stat.S_IMODE(was.mode):o}")
        elif not stat.S_ISDIR(st.st_mode) and st.st_nlink != 1:
            changes.append(f"{where} has {st.st_nlink} hard links")
    return changes


def parse_reward(files: RewardFiles) -> tuple[float | None, str, dict[str, str]]:
    """(score or None, reason, tests) from logs/verifier/reward.txt or reward.json, when the reward
    files are still the ones prepare_reward_files made and exactly one of them was written."""
    changes = _changes(files)
    if changes:
        return None, (f"reward files were changed by the code under test ({'; '.join(changes)}): "
                      "not trusted"), {}
    written: dict[str, bytes] = {}
    for name in REWARD_FILES:
        try:
            data = read_untrusted_file(files.logs, f"verifier/{name}")
        except ValueError as exc:
            return None, f"reward file refused: {exc}", {}
        if data:
            written[name] = data
    if len(written) == 2:
        return None, ("both reward.txt and reward.json were written (the code under test may have "
                      "written one): not trusted"), {}
    if not written:
        return None, "no reward: neither /logs/verifier/reward.txt nor reward.json was written", {}
    [(name, data)] = written.items()
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

