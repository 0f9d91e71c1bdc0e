"""The console's rollout inspector: one rollout as `rollstream inspect trajectory --json` has it
(shared/contract/rollout_view.py), plus what the terminal leaves to files: each attempt's stored artifacts (a
coding episode's diff, a black-box agent's log), each grade's sandbox output, and the commands that replay the
rollout.

Files are read only from the run's own folder in storage, and at most ARTIFACT_CHARS of each: an event names
the path, and an event is no reason to show any file the console can read.

    python -m pytest tests/unit/services/console -q
"""

from __future__ import annotations

import shlex
from typing import Any

from rollstream.shared.contract.rollout_view import TokenDecoder, load_rollout, rollout_document
from rollstream.shared.contract.run_source import RunSource
from rollstream.shared.runtime.storage import Storage

ARTIFACT_CHARS = 200_000


def read_run_file(storage_uri: str, run: str, uri: str) -> dict[str, Any]:
    """{"text": ...} of a file of the run's storage (cut at ARTIFACT_CHARS), or {"error": why not}."""
    storage = Storage(storage_uri)
    folder = storage.path(run) + "/"
    path = uri if uri.startswith(folder) else storage.path(run, *uri.split("/")[-2:])
    if ".." in path.split("/") or not path.startswith(folder):
        return {"uri": uri, "error": f"not shown: {uri} is outside the run's storage"}
    try:
        data = storage.read_bytes(path)
    except OSError as exc:
        return {"uri": uri, "error": f"unreadable: {exc}"}
    text = data.decode("utf-8", "replace")
    if len(text) > ARTIFACT_CHARS:
        text = f"{text[:ARTIFACT_CHARS]}\n... [cut: {len(text)} characters in all]"
    return {"uri": uri, "text": text}


def replay_commands(run: str, rollout_id: str, sandboxed: bool) -> list[str]:
    """How to run the rollout through the pipeline again: its run's finished rollouts re-graded in the
    sandbox and re-scored (a sandbox-graded rollout), or re-scored (the others), into a new run where it keeps
    its id."""
    target = f"{run}-replay"
    replay = f"rollstream replay {shlex.quote(run)} --to {shlex.quote(target)}"
    if sandboxed:
        replay += " --streams trajectories --finished-only --services sandbox-grader,reward"
    else:
        replay += " --streams trajectories,grades --services reward"
    return [replay, f"rollstream inspect trajectory {shlex.quote(target)} {shlex.quote(rollout_id)}"]


def inspect_rollout(source: RunSource, rollout_id: str, decoder: TokenDecoder | None,
                    default_role: str | None = None) -> dict[str, Any]:
    """Everything the inspector shows of one rollout; RunDataNotFound when the run has none of that id.
    default_role: the run's (roles.default), whose name a segment naming no role is shown with."""
    doc = rollout_document(load_rollout(source, rollout_id), decoder, default_role)
    sandboxed = False
    for attempt in doc["attempts"]:
        finished = attempt["finished"] or {}
        sandboxed = sandboxed or bool(finished.get("needs_grade"))
        attempt["artifact_files"] = {name: read_run_file(source.storage_uri, source.run, uri)
                                     for name, uri in (finished.get("artifacts") or {}).items()}
    for grade in doc["grades"]:
        if grade.get("log_uri"):
            grade["log"] = read_run_file(source.storage_uri, source.run, grade["log_uri"])
    doc["replay"] = replay_commands(source.run, rollout_id, sandboxed)
    return doc
