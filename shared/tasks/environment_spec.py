"""What a SWE-bench row's test environment is: the repository at its environment commit, installed with the
row's install commands (`EnvironmentSpec`), found from the row and its dataset (`environment_spec`).

The first of these that the row has decides:

1. the row's `install_config` (SWE-bench-extra, SWE-rebench): `python`, `pre_install` (a list of commands
   that need the system: apt-get; run only where there is an image to run them in), `pip_packages` (a list,
   installed with `pip install`), `install` (a command, e.g. "pip install -e ."); other keys are ignored;
2. our own row fields `install` (a command or a list of them) and `python`;
3. `environments.json` beside the dataset file, with the same keys, under "owner/name@version" (the row's
   `version`) or "owner/name" (SWE-bench keeps its install specs per repository and version):

       {"python-semver/python-semver@3.0.1": {"install": "pip install -e ."},
        "more-itertools/more-itertools": {"python": "3.11", "pip_packages": ["pytest==7.4.4"],
                                          "install": "pip install -e ."}}

4. a row published with an `environment_setup_commit` whose repository is a clone in the repos directory
   (shared/tasks/swebench_repos.py): "pip install -e ." at that commit.

A row with none of these (one that brings its own snapshot in `repo_dir` and names no install) has no
environment: it is graded on the sandbox's own Python, as before environments existed. A row whose only
environment is a published image (`image_name`, SWE-smith) has a spec without install commands, for the
docker backend.

The tree installed from (`source`) is the repository at the environment commit (`environment_setup_commit`,
else `base_commit`), checked out of the clone like a row's snapshot; the row's own snapshot when there is no
clone to check it out of. `key` names the environment: one per repository, commit and install, shared by
every row that has the same. A bad value is a TaskError naming the row and the field.

    python -m pytest tests/unit/shared/tasks/test_environment_spec.py -q
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.shared.errors import TaskError
from rollstream.shared.tasks.swebench_repos import checkout_snapshot, clone_name, swesmith_parts

ENVIRONMENTS_FILE = "environments.json"
"""The per-repository install specs beside a dataset file."""

DEFAULT_INSTALL = ("pip install -e .",)
"""A published row's install when nothing names one: the repository, editable, with its dependencies."""

_PYTHON_VERSION = re.compile(r"^3\.\d{1,2}(\.\d{1,2})?$")
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class EnvironmentSpec:
    repo: str
    """"owner/name" of the repository (a SWE-smith row's upstream one)."""
    commit: str
    """The commit whose dependencies are installed: `environment_setup_commit`, else `base_commit`."""
    source: Path
    """The tree at that commit on the host, which the install commands run in (a copy of it)."""
    python: str | None = None
    """The Python version ("3.11"), or None: the sandbox's own."""
    install: tuple[str, ...] = ()
    """Shell commands run in the tree, in order, with the environment's Python first on PATH."""
    image_name: str | None = None
    """A published image of the environment (SWE-smith), for the docker backend."""
    pre_install: tuple[str, ...] = ()
    """Commands that set up the system (apt-get) before `install`: run in an image, never on the host."""

    @property
    def key(self) -> str:
        """A short stable name: "owner__name-<commit[:12]>-<digest of the rest>"."""
        rest = json.dumps([self.python, list(self.pre_install), list(self.install), self.image_name])
        digest = hashlib.sha256(rest.encode()).hexdigest()[:8]
        name = _KEY_UNSAFE.sub("_", clone_name(self.repo)).strip("._-") or "repo"
        return f"{name}-{_KEY_UNSAFE.sub('_', self.commit)[:12]}-{digest}"


def install_commands(value: Any, where: str, field: str) -> tuple[str, ...]:
    """A command, or a list of commands, as a tuple; a TaskError naming `field` otherwise."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        raise TaskError(f"{where}: '{field}' must be a command or a list of commands (strings), "
                        f"got {value!r}")
    return tuple(item for item in value if item.strip())


def python_version(value: Any, where: str, field: str) -> str | None:
    """A Python version string like "3.11" (None when absent); a TaskError naming `field` otherwise."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not _PYTHON_VERSION.match(value.strip()):
        raise TaskError(f"{where}: '{field}' must be a Python version string like \"3.11\", got {value!r}")
    return value.strip()


def _from_config(config: Any, where: str, field: str) -> tuple[str | None, tuple[str, ...], tuple[str, ...]]:
    """(python, pre_install, install) of an install_config-shaped object."""
    if not isinstance(config, dict):
        raise TaskError(f"{where}: '{field}' must be an object, got {type(config).__name__}")
    python = python_version(config.get("python"), where, f"{field}.python")
    pre_install = install_commands(config.get("pre_install") or [], where, f"{field}.pre_install")
    packages = config.get("pip_packages") or []
    if not isinstance(packages, (list, tuple)) or not all(isinstance(item, str) for item in packages):
        raise TaskError(f"{where}: '{field}.pip_packages' must be a list of requirements (strings), "
                        f"got {packages!r}")
    install = install_commands(config.get("install") or [], where, f"{field}.install")
    pip = ("pip install " + " ".join(shlex.quote(package) for package in packages),) if packages else ()
    return python, pre_install, pip + install


def _environments_file(dataset: Path | None) -> dict[str, Any]:
    if dataset is None:
        return {}
    path = Path(dataset).parent / ENVIRONMENTS_FILE
    if not path.is_file():
        return {}
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TaskError(f"{path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(table, dict):
        raise TaskError(f"{path}: must be an object mapping \"owner/name\" or \"owner/name@version\" to "
                        f"install specs, got {type(table).__name__}")
    return table


def _listed(task: Any, repo: str) -> tuple[str, str, Any] | None:
    """(the file, the key, the spec) from environments.json for the row's repository and version."""
    table = _environments_file(getattr(task, "dataset", None))
    version = getattr(task, "version", None)
    for name in ([f"{repo}@{version}"] if version else []) + [repo]:
        if name in table:
            return str(Path(task.dataset).parent / ENVIRONMENTS_FILE), name, table[name]
    return None


def _upstream(task: Any) -> tuple[str, str | None]:
    """The row's repository ("owner/name") and the commit of its environment, if it names one."""
    repo = getattr(task, "repo", None) or getattr(task, "instance_id", "repo")
    commit = getattr(task, "environment_setup_commit", None) or getattr(task, "base_commit", None)
    parts = swesmith_parts(repo)
    if parts is not None:
        repo, mirror_commit = parts
        commit = commit or mirror_commit
    return repo, commit


def _clone(task: Any, repo: str) -> Path | None:
    repos_dir = getattr(task, "repos_dir", None)
    if repos_dir is None or not (Path(repos_dir) / clone_name(repo)).is_dir():
        return None
    return Path(repos_dir)


def _source(task: Any, repo: str, commit: str | None, where: str) -> Path:
    """The tree at the environment commit: checked out of the clone when there is one and the commit
    is not the snapshot's own; else the row's snapshot."""
    repos_dir = _clone(task, repo)
    if repos_dir is None or commit is None or commit == getattr(task, "base_commit", None):
        return Path(task.repo_dir)
    return checkout_snapshot(repos_dir.resolve(), repo, commit, where).repo_dir


def environment_spec(task: Any) -> EnvironmentSpec | None:
    """The row's environment (see the module's docstring for where it comes from), or None."""
    where = f"{getattr(task, 'dataset', None) or 'dataset'} ({getattr(task, 'instance_id', '?')})"
    repo, commit = _upstream(task)
    image_name = getattr(task, "image_name", None)
    python, pre_install, install = None, (), ()
    own_install = getattr(task, "install", None)
    listed = _listed(task, repo)
    if getattr(task, "install_config", None):
        python, pre_install, install = _from_config(task.install_config, where, "install_config")
    elif own_install is not None or getattr(task, "python", None):
        install = install_commands(own_install or [], where, "install")
        python = python_version(getattr(task, "python", None), where, "python")
    elif listed is not None:
        path, name, config = listed
        python, pre_install, install = _from_config(config, path, name)
    elif getattr(task, "environment_setup_commit", None) and _clone(task, repo) is not None:
        install = DEFAULT_INSTALL
    elif not image_name:
        return None
    source = _source(task, repo, commit, where)
    if commit is None:  # a snapshot of its own, of no named commit: the tree's place names it
        commit = "tree" + hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:8]
    return EnvironmentSpec(repo=repo, commit=commit, source=source, python=python, install=install,
                           image_name=image_name, pre_install=pre_install)
