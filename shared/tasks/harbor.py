"""Harbor task directories: loading and checking them.

Harbor tasks (the format of Harbor, terminal-bench's successor): one directory per task,

    fix-add/
        task.toml            configuration: [verifier] timeout_sec, [agent] timeout_sec, ...
        instruction.md       the agent's instruction (markdown, non-empty)
        environment/
            Dockerfile       the task's container (kept for the docker backend)
            workspace/       optional: the task's starting files (our convention, see below)
        tests/
            test.sh          the verifier: writes /logs/verifier/reward.txt (a number) or
                             reward.json ({"reward": ...}); it may give partial credit
            ...              anything test.sh needs (hidden from the agent)
        solution/
            solve.sh         optional reference solution

task.toml, for example (unknown sections and fields are kept in `config` and ignored; the fields
read here must have the right types):

    version = "1.0"                  # or schema_version = "1.1" with a [task] table
    [metadata]
    difficulty = "easy"
    [verifier]
    timeout_sec = 60.0               # positive number; default 120
    [agent]
    timeout_sec = 300.0              # positive number; default 600
    [environment]
    build_timeout_sec = 300.0
    cpus = 1
    memory_mb = 1024

Workspace convention: on machines without Docker the Dockerfile cannot be built, so a task's
starting files live in `environment/workspace/` (the Dockerfile COPYs them into its WORKDIR, e.g.
`COPY workspace/ /app/`, so both backends start from the same files). A copy of that directory is
the agent's repository and, with the agent's diff applied, the grader's workspace; a task without
it starts from an empty workspace. Every sandbox mounts that workspace at the task's `workdir`: the
Dockerfile's WORKDIR (`dockerfile_workdir`; /app when it sets none), as in the task's own
container, so tests and solutions may use its absolute paths (`sys.path.insert(0, "/app")`,
`cat > /app/x.py`). tests/test.sh runs there, with $WORKSPACE naming it too.

Every problem raises `TaskError` naming the file and the field (and the row, for SWE-bench), e.g.
"tasks/fix-bug/task.toml: [verifier] timeout_sec must be a positive number, got 'abc'".
The example tasks in tests/fixtures/tasks/ show both formats:

    python -m pytest tests/unit/shared/tasks -q
"""

from __future__ import annotations

import math
import posixpath
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.shared.errors import SandboxError, TaskError
from rollstream.shared.sandbox.base import sandbox_path

DEFAULT_VERIFIER_TIMEOUT_S = 120.0

DEFAULT_AGENT_TIMEOUT_S = 600.0

DEFAULT_WORKDIR = "/app"
"""A task's workdir when its Dockerfile sets no WORKDIR: where Harbor and terminal-bench tasks
keep their files."""


@dataclass(frozen=True)
class HarborTask:
    name: str                       # the task directory's name
    path: Path                      # the task directory (absolute)
    instruction: str                # the text of instruction.md
    config: dict[str, Any]          # task.toml, parsed
    workspace: Path | None          # environment/workspace/, or None: an empty workspace
    dockerfile: Path                # environment/Dockerfile
    tests_dir: Path                 # tests/ (holds test.sh)
    solution: Path | None           # solution/solve.sh, if the task has one
    verifier_timeout_s: float = DEFAULT_VERIFIER_TIMEOUT_S
    agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S
    workdir: str = DEFAULT_WORKDIR  # the workspace's path in the sandbox (dockerfile_workdir)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_number(table: dict[str, Any], section: str, key: str, where: Path,
                     default: float | None = None) -> float | None:
    if key not in table:
        return default
    value = table[key]
    if not _is_number(value) or value <= 0:
        raise TaskError(f"{where}: [{section}] {key} must be a positive number, got {value!r}")
    return float(value)


_KINDS = {str: (str,), "number": (int, float), bool: (bool,), dict: (dict,), list: (list,)}

_KIND_NAMES = {str: "a string", "number": "a number", bool: "true or false", dict: "a table", list: "a list"}


def _check_types(table: dict[str, Any], section: str, where: Path, kinds: dict[str, tuple[Any, ...]]) -> None:
    """Each named field, when present, must be one of its kinds (str, "number", bool, dict, list)."""
    label = f"[{section}] " if section else ""
    for key, allowed in kinds.items():
        if key not in table:
            continue
        value = table[key]
        ok = any(isinstance(value, _KINDS[kind]) and (kind is bool or not isinstance(value, bool))
                 for kind in allowed)
        if not ok:
            names = " or ".join(_KIND_NAMES[kind] for kind in allowed)
            raise TaskError(f"{where}: {label}{key} must be {names}, got {value!r}")


def _section(config: dict[str, Any], name: str, where: Path) -> dict[str, Any]:
    value = config.get(name, {})
    if not isinstance(value, dict):
        raise TaskError(f"{where}: [{name}] must be a table, got {value!r}")
    return value


def _validate_config(config: dict[str, Any], where: Path) -> tuple[float, float]:
    _check_types(config, "", where, {"version": (str,), "schema_version": (str,)})
    task = _section(config, "task", where)
    _check_types(task, "task", where, {"name": (str,), "description": (str,), "keywords": (list,),
                                       "authors": (list,)})
    _section(config, "metadata", where)

    verifier = _section(config, "verifier", where)
    verifier_timeout = _positive_number(verifier, "verifier", "timeout_sec", where,
                                        DEFAULT_VERIFIER_TIMEOUT_S)
    _check_types(verifier, "verifier", where, {"env": (dict,), "user": (str,)})
    env = verifier.get("env", {})
    for key, value in env.items():
        if not isinstance(value, str):
            raise TaskError(f"{where}: [verifier] env.{key} must be a string, got {value!r}")

    agent = _section(config, "agent", where)
    agent_timeout = _positive_number(agent, "agent", "timeout_sec", where, DEFAULT_AGENT_TIMEOUT_S)

    environment = _section(config, "environment", where)
    for key in ("build_timeout_sec", "cpus", "memory_mb", "storage_mb"):
        _positive_number(environment, "environment", key, where)
    _check_types(environment, "environment", where, {
        "memory": (str, "number"), "storage": (str, "number"), "allow_internet": (bool,),
        "docker_image": (str,),
    })
    return verifier_timeout, agent_timeout


_HEREDOC = re.compile(r"(?<!<)<<(?!<)(-?)\s*([\"']?)([A-Za-z_][\w.-]*)\2")
"""A heredoc opener in a RUN, COPY or ADD line (BuildKit): `<<EOF`, `<<-"EOF"`; not bash's `<<<`."""


def _instructions(text: str) -> list[tuple[str, str]]:
    """(keyword in upper case, arguments) of each Dockerfile instruction: continuation lines
    joined, comments dropped, heredoc bodies skipped (a `from x import y` line in a Python
    heredoc is no FROM)."""
    lines = text.splitlines()
    found: list[tuple[str, str]] = []
    index = 0
    while index < len(lines):
        line = lines[index].strip()
        index += 1
        if not line or line.startswith("#"):
            continue
        while line.endswith("\\") and index < len(lines):
            following = lines[index].strip()
            index += 1
            if not following.startswith("#"):
                line = line[:-1] + " " + following
        keyword, arguments = (line.split(None, 1) + [""])[:2]
        keyword = keyword.upper()
        if keyword in ("RUN", "COPY", "ADD"):
            for strip_tabs, _, delimiter in _HEREDOC.findall(arguments):
                while index < len(lines):
                    body = lines[index].lstrip("\t") if strip_tabs else lines[index]
                    index += 1
                    if body == delimiter:
                        break
        found.append((keyword, arguments.strip()))
    return found


def _read_text(path: Path) -> str:
    """A task file's text; TaskError naming the file and the byte when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TaskError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc

def dockerfile_workdir(dockerfile: Path | None) -> str:
    """The WORKDIR the final stage of `dockerfile` runs in, as Docker sets it: the last WORKDIR of
    that stage, or of the earlier stage it is built FROM; a relative WORKDIR is taken from the one
    before it (from / when there is none). DEFAULT_WORKDIR (/app) when there is no Dockerfile or
    no WORKDIR applies. TaskError when the final one depends on a variable (not expanded here)."""
    if dockerfile is None or not dockerfile.is_file():
        return DEFAULT_WORKDIR
    text = _read_text(dockerfile)
    stages: list[str | None] = []
    names: dict[str, int] = {}
    for keyword, arguments in _instructions(text):
        if keyword == "FROM":
            words = [word for word in arguments.split() if not word.startswith("--")]
            base = words[0].lower() if words else ""
            # an image's own WORKDIR is not known here; an earlier stage's is
            inherited = stages[names[base]] if base in names else None
            if len(words) >= 3 and words[1].lower() == "as":
                names[words[2].lower()] = len(stages)
            stages.append(inherited)
        elif keyword == "WORKDIR" and stages:
            requested = arguments
            if len(requested) >= 2 and requested[0] == requested[-1] and requested[0] in "\"'":
                requested = requested[1:-1]
            previous = stages[-1] or "/"
            if "$" in requested or ("$" in previous and not requested.startswith("/")):
                # only Docker can expand it; kept unnormalized, refused below if it is the final one
                stages[-1] = posixpath.join(previous, requested)
            else:
                stages[-1] = "/" + posixpath.normpath(posixpath.join(previous, requested)).lstrip("/")
    workdir = (stages[-1] if stages else None) or DEFAULT_WORKDIR
    if "$" in workdir:
        raise TaskError(f"{dockerfile}: WORKDIR {workdir} depends on a variable, which is not "
                        "expanded here; write the path out")
    return workdir


def load_harbor_task(path: Path) -> HarborTask:
    """One Harbor task directory, checked; see the module docstring for the layout."""
    if not path.is_dir():
        raise TaskError(f"{path}: not a task directory (no such directory)")
    toml_path = path / "task.toml"
    if not toml_path.is_file():
        raise TaskError(f"{toml_path}: missing (every task needs its task.toml)")
    try:
        config = tomllib.loads(_read_text(toml_path))
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"{toml_path}: invalid TOML: {exc}") from exc
    verifier_timeout, agent_timeout = _validate_config(config, toml_path)

    instruction_path = path / "instruction.md"
    if not instruction_path.is_file():
        raise TaskError(f"{instruction_path}: missing (the agent's instruction)")
    instruction = _read_text(instruction_path)
    if not instruction.strip():
        raise TaskError(f"{instruction_path}: empty (the agent's instruction)")

    dockerfile = path / "environment" / "Dockerfile"
    if not dockerfile.is_file():
        raise TaskError(f"{dockerfile}: missing (the task's environment)")
    test_sh = path / "tests" / "test.sh"
    if not test_sh.is_file():
        raise TaskError(f"{test_sh}: missing (the task's verifier)")
    try:
        workdir = sandbox_path(dockerfile_workdir(dockerfile), "WORKDIR")
    except SandboxError as exc:
        raise TaskError(f"{dockerfile}: the workspace cannot be mounted at its WORKDIR: {exc}") from None

    root = path.resolve()
    workspace = root / "environment" / "workspace"
    solve_sh = root / "solution" / "solve.sh"
    return HarborTask(
        name=root.name,
        path=root,
        instruction=instruction.strip() + "\n",
        config=config,
        workspace=workspace if workspace.is_dir() else None,
        dockerfile=root / "environment" / "Dockerfile",
        tests_dir=root / "tests",
        solution=solve_sh if solve_sh.is_file() else None,
        verifier_timeout_s=verifier_timeout,
        agent_timeout_s=agent_timeout,
        workdir=workdir,
    )


def load_harbor_tasks(root: Path) -> list[HarborTask]:
    """`root` is one task directory (it has a task.toml) or a directory of task directories, loaded
    in name order; hidden directories and plain files beside the tasks are skipped."""
    if not root.is_dir():
        raise TaskError(f"{root}: no such task directory")
    if (root / "task.toml").exists():
        return [load_harbor_task(root)]
    children = sorted((child for child in root.iterdir()
                       if child.is_dir() and not child.name.startswith((".", "__"))),
                      key=lambda child: child.name)
    if not children:
        raise TaskError(f"{root}: no tasks (expected a task.toml here, or task directories in it)")
    return [load_harbor_task(child) for child in children]

