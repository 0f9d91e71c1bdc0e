"""Each trained role's version, and in a LoRA run the directory each version of a role's adapter is served
from (services/trainer/training.py).

The trainer's version (PolicyUpdated.version) is its step: one per batch. A role's version grows by one with
each batch that trained it (it held rows of the role with a sampled token); with a full fine-tune the one
role's version is the trainer's. A restarted trainer takes them from the PolicyUpdated it starts from (one
recorded before roles existed has none: the default role's is its version) and from its checkpoint
(ROLE_VERSIONS_FILE, which a LoRA checkpoint holds).

Every version of a role's adapter the trainer publishes is written, in peft's format, to a directory of its
own, `<storage>/<run>/adapters/<role>/v<role version>/`: the servers load it from there (the fleet's sync
loads on a server every adapter whose directory it does not serve), and a server that starts mid-run loads
the newest one it finds.

Tests: tests/unit/services/trainer/test_lora_trainer.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rollstream.shared.contract.events import PolicyUpdated
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.inference.adapter_sync import adapter_dir as version_dir
from rollstream.shared.runtime.storage import Storage, replace_dir

ROLE_VERSIONS_FILE = "role_versions.json"
"""A LoRA checkpoint's roles' versions (role -> version)."""


def starting_role_versions(start: PolicyUpdated | None, checkpoint: Path | None,
                           roles: RunRoles) -> dict[str, int]:
    """Every trained role's version as the trainer starts from `start` (None: the starting model, 0 each) and
    its checkpoint. A role neither names (new to the run) is at 0."""
    versions = dict.fromkeys(roles.trained, 0)
    if start is None:
        return versions
    if not roles.lora:
        return {roles.default: start.version}
    recorded = dict(start.role_versions) or {roles.default: start.version}
    if checkpoint is not None and (checkpoint / ROLE_VERSIONS_FILE).is_file():
        recorded = {**json.loads((checkpoint / ROLE_VERSIONS_FILE).read_text()), **recorded}
    versions.update((role, version) for role, version in recorded.items() if role in versions)
    return versions


def role_versions_of(update: PolicyUpdated, roles: RunRoles) -> dict[str, int]:
    """The roles' versions a PolicyUpdated published."""
    return dict(update.role_versions) or {roles.default: update.version}


def next_role_versions(versions: dict[str, int], trained: list[str], roles: RunRoles,
                       version: int) -> dict[str, int]:
    """The roles' versions after the trainer's step `version` trained `trained`: with a full fine-tune the
    one role's is the step; with LoRA each role it trained grows by one."""
    if not roles.lora:
        return {roles.default: version}
    return {role: current + (role in trained) for role, current in versions.items()}


def write_role_versions(directory: Path, versions: dict[str, int]) -> None:
    (directory / ROLE_VERSIONS_FILE).write_text(json.dumps(versions, sort_keys=True))


def adapter_dir(storage: Storage, run_id: str, role: str, version: int) -> Path:
    """Where the servers load the role's adapter at `version` from: its whole path, links resolved, as a
    server started on it names it (cli/vllm_server.py), so that the sync finds the directory it serves."""
    return version_dir(storage.local_path(run_id), role, version).resolve()


def publish_adapter(storage: Storage, run_id: str, role: str, version: int, write) -> Path:
    """Write the role's adapter at `version` to its directory, whole or not at all (`write(directory)` writes
    its files); returns the directory."""
    final = adapter_dir(storage, run_id, role, version)
    temp = final.with_name(final.name + ".tmp")
    shutil.rmtree(temp, ignore_errors=True)
    temp.parent.mkdir(parents=True, exist_ok=True)
    write(temp)
    replace_dir(temp, final)
    return final


AdapterStates = dict[str, dict]
"""role -> the adapter's tensors by name, as the backend hands them (adapter_state)."""
