"""The layout's rules, read from the code itself: no import cycle, no service importing another
service or the command line, the library importing neither, the benchmarks importing no service, stream
names meeting service names only in the consumer map, modules and functions short enough to read whole,
nothing under the old generic top-level names, and every package folder installed under rollstream.*.

    python -m pytest tests/unit/test_layout.py -q
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.support import REPO

ROOTS = {"shared": "rollstream.shared", "services": "rollstream.services", "cli": "rollstream.cli"}
OLD_TOP_LEVEL = ("shared", "services", "cli")


def project_modules() -> dict[str, Path]:
    """rollstream.* module name -> file, for every module of the three installed folders."""
    modules = {}
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imported_names(tree: ast.AST) -> list[tuple[str, int]]:
    """Every absolute module name an import statement names, at any depth (function-level imports
    hide cycles just as well), with its line; `from a.b import c` gives a.b.c and a.b."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, node.lineno))
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line}."""
    modules = project_modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        for name, line in imported_names(ast.parse(path.read_text(), str(path))):
            if name in modules and name != module:
                edges.setdefault(name, line)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def owner(module: str) -> str:
    """'shared', 'cli', or 'services.<name>'."""
    parts = module.split(".")
    return ".".join(parts[1:3]) if parts[1] == "services" and len(parts) > 2 else parts[1]


def test_there_is_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function():
    tree = ast.parse("def late():\n    from rollstream.shared.b import thing\n")
    names = [name for name, _ in imported_names(tree)]
    assert "rollstream.shared.b" in names
    assert cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {}}) == [["a", "b", "c"]]


def test_services_import_only_the_library_and_themselves_and_the_library_imports_neither():
    wrong = []
    for module, edges in import_graph().items():
        mine = owner(module)
        for target, line in edges.items():
            theirs = owner(target)
            allowed = {"shared"} | ({mine} if mine != "shared" else set())
            if mine == "cli":
                continue  # the command line is the supervisor: it may start anything
            if theirs not in allowed:
                where = project_modules()[module].relative_to(REPO)
                wrong.append(f"{where}:{line} ({mine}) imports {target}")
    assert wrong == []


def test_nothing_imports_the_old_generic_top_level_names():
    wrong = []
    for folder in ("shared", "services", "cli", "tests", "bench"):
        for path in (REPO / folder).rglob("*.py"):
            if "fixtures" in path.parts:
                continue
            for name, line in imported_names(ast.parse(path.read_text(), str(path))):
                if name.split(".")[0] in OLD_TOP_LEVEL:
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert wrong == []


def test_every_package_folder_is_installed_under_rollstream():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    folders = {module for module, path in project_modules().items() if path.name == "__init__.py"}
    assert listed == folders
    mapping = config["tool"]["setuptools"]["package-dir"]
    assert mapping == {package: folder for folder, package in ROOTS.items()}


def test_every_folder_with_modules_is_a_package():
    """A folder of modules without __init__.py would be importable in the editable install but
    left out of a built wheel (setuptools installs only the listed packages)."""
    missing = sorted(str(path.parent.relative_to(REPO)) for path in project_modules().values()
                     if not (path.parent / "__init__.py").exists())
    assert missing == []


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> dict:
    """Where to run the installed code from: a directory outside the repository, with an
    environment whose PYTHONPATH does not lead back to it."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return {"cwd": cwd, "env": env}


@pytest.mark.parametrize("name", OLD_TOP_LEVEL)
def test_the_installed_environment_claims_no_generic_top_level_name(name, outside):
    probe = ("import importlib.util, sys; spec = importlib.util.find_spec(sys.argv[1]); "
             "print(spec.origin if spec and spec.origin else (list(spec.submodule_search_locations) "
             "if spec else 'absent'))")
    proc = subprocess.run([sys.executable, "-c", probe, name], capture_output=True, text=True,
                          timeout=60, **outside)
    assert proc.returncode == 0, proc.stderr
    assert str(REPO) not in proc.stdout, f"`import {name}` finds rollstream's folder: {proc.stdout}"


def test_every_console_script_resolves_from_outside_the_repository(outside):
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    scripts = config["project"]["scripts"]
    loader = ("from importlib.metadata import entry_points\n"
              "eps = {ep.name: ep for ep in entry_points(group='console_scripts')}\n"
              "import sys\n"
              "for name in sys.argv[1:]:\n"
              "    assert callable(eps[name].load()), name\n"
              "    print(name, eps[name].value)\n")
    proc = subprocess.run([sys.executable, "-c", loader, *scripts], capture_output=True, text=True,
                          timeout=120, **outside)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [word for name, value in scripts.items() for word in (name, value)]
    assert all(value.startswith("rollstream.") for value in scripts.values())
    bin_dir = Path(sys.executable).parent
    for args in (["rollstream", "--help"], ["rollstream", "config"], ["rollstream", "inspect", "--help"]):
        run = subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True,
                             timeout=120, **outside)
        assert run.returncode == 0, f"{args}: {run.stderr}"


def test_console_scripts_are_the_ones_the_installed_distribution_declares():
    declared = {ep.name: ep.value for ep in entry_points(group="console_scripts")
                if ep.dist is not None and ep.dist.name == "rollstream"}
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert declared == config["project"]["scripts"]


NOT_ERRORS = {"rollstream.shared.contract.bus.StopConsuming"}
"""Exceptions used as signals, not errors: `except RollstreamError` must not swallow them."""


def test_every_project_error_derives_from_the_common_base():
    import importlib
    import inspect

    from rollstream.shared.errors import RollstreamError

    stray = []
    for module_name in project_modules():
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) \
                    and value.__module__ == module_name and f"{module_name}.{name}" not in NOT_ERRORS \
                    and not issubclass(value, RollstreamError):
                stray.append(f"{module_name}.{name}")
    assert stray == []


BENCHMARKS_OF_A_SERVICES_INSIDES = {"bench/bench_data_path.py": "rollstream.services.trainer"}
"""The trainer's data path (a Parquet batch to packed tensors, as a share of a step) is the trainer's own
code, which no command runs alone."""


def test_the_benchmarks_import_no_service():
    """bench/ measures through the library and the command line, as users run them, not a service's
    insides (which would make it a second consumer of a service's private code)."""
    wrong = []
    for path in sorted((REPO / "bench").rglob("*.py")):
        allowed = BENCHMARKS_OF_A_SERVICES_INSIDES.get(str(path.relative_to(REPO)))
        for name, line in imported_names(ast.parse(path.read_text(), str(path))):
            if name.startswith("rollstream.services") and not (allowed and name.startswith(allowed)):
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert wrong == []


def stream_meets_service(tree: ast.AST) -> list[int]:
    """Lines where a stream's name and a consumer group's name are written side by side: in one call's
    arguments, or one tuple, list or dict literal (a module-level NAME = "reward" counts as the name)."""
    from rollstream.shared.contract.bus import STREAMS
    from rollstream.shared.contract.consumers import CONSUMER_GROUPS

    constants = {target.id: node.value.value for node in getattr(tree, "body", [])
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                 for target in node.targets if isinstance(target, ast.Name)}

    def words(nodes) -> set:
        found = set()
        for node in nodes:
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
            elif isinstance(node, ast.Name) and isinstance(constants.get(node.id), str):
                found.add(constants[node.id])
            elif isinstance(node, (ast.Tuple, ast.List)):
                found |= words(node.elts)
        return found

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            parts = [*node.args, *(keyword.value for keyword in node.keywords)]
        elif isinstance(node, (ast.Tuple, ast.List)):
            parts = node.elts
        elif isinstance(node, ast.Dict):
            parts = [*(key for key in node.keys if key is not None), *node.values]
        else:
            continue
        found = words(parts)
        if found & set(STREAMS) and found & set(CONSUMER_GROUPS):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_the_consumer_map_is_the_only_place_where_stream_names_meet_service_names():
    wrong = [f"{path.relative_to(REPO)}:{line}" for module, path in project_modules().items()
             if module != "rollstream.shared.contract.consumers"
             for line in stream_meets_service(ast.parse(path.read_text(), str(path)))]
    assert wrong == []


def test_the_consumer_map_check_finds_a_hand_written_consumer_list():
    written = ('GROUP = "reward"\n'
               'run_consumer(bus, ("grades", "dead"), GROUP, consumer)\n'
               'CONSUMES = {"trainer": ("batches",)}\n'
               'bus.publish("trajectories", event)\n')
    assert stream_meets_service(ast.parse(written)) == [2, 3]


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60


def size_alarms(path: Path) -> list[str]:
    """A module over MAX_MODULE_LINES lines, each function over MAX_FUNCTION_LINES (its def line through its
    last line, a function inside another counted on its own too)."""
    text = path.read_text()
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    alarms = []
    if len(text.splitlines()) > MAX_MODULE_LINES:
        alarms.append(f"{where}: {len(text.splitlines())} lines")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                alarms.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    return alarms


def test_every_module_and_function_is_small_enough_to_read_whole():
    """No module of the library, the services, the command line or the benchmarks over MAX_MODULE_LINES
    lines, no function over MAX_FUNCTION_LINES: alarms, not targets (a module near the limit wants to be
    split where its meaning divides, not squeezed)."""
    modules = [*project_modules().values(), *sorted((REPO / "bench").rglob("*.py"))]
    assert [alarm for path in modules for alarm in size_alarms(path)] == []


def test_the_size_check_finds_a_long_module_and_a_long_function_inside_another(tmp_path):
    functions = "def outer():\n    def inner():\n" + "        pass\n" * MAX_FUNCTION_LINES
    statements = "VALUE = 1\n" * (MAX_MODULE_LINES + 1 - (MAX_FUNCTION_LINES + 2))
    written = tmp_path / "long.py"
    written.write_text(functions + statements)
    assert size_alarms(written) == [f"{written}: {MAX_MODULE_LINES + 1} lines",
                                    f"{written}:1 outer: {MAX_FUNCTION_LINES + 2} lines",
                                    f"{written}:2 inner: {MAX_FUNCTION_LINES + 1} lines"]
