"""Reading what code under test wrote: the verifier's reward files.

Everything below the logs directory was writable by model code, so files are read without
following symlinks (O_NOFOLLOW at every level), only when regular (a FIFO cannot block the
grader), and size capped (`read_untrusted_file`). The reward is /logs/verifier/reward.txt (a
number) or reward.json ({"reward": x}, or per-test outcomes {"tests": {id: "passed"|...|bool}} ->
fraction passed); both present is refused as ambiguous; missing or garbled gives no score, with
the reason.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
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


def parse_reward(logs: Path) -> tuple[float | None, str, dict[str, str]]:
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

