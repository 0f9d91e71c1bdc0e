"""The plugins a repository's own pytest configuration loads before the grader's, and the refusal of a
diff that changed their code.

pytest puts the configuration's `addopts` before PYTEST_ADDOPTS, so a `-p NAME` there is imported before
the grader's report plugin (shared/grading/pytest_report_plugin.py) has taken its key. When NAME is a
module of the tree, whatever code of the tree it imports runs first: if the diff changed any of it, that
code could take the key and sign a forged report. `addopts_plugin_refusal` reads every pytest configuration
of the restored tree that pytest could use (pytest.toml, .pytest.toml, pytest.ini, .pytest.ini,
pyproject.toml's [tool.pytest] or [tool.pytest.ini_options], tox.ini's [pytest], setup.cfg's [tool:pytest],
in any directory: which one pytest takes depends on the test ids and on its version; and a file the test
command names with `-c`), collects the `-p` plugins of their `addopts`, maps each to every file of the tree
that could be that module or a package above it, follows the imports those files make (and their
`pytest_plugins`), and names the first file the diff changed on that path. Refusing is the safe side: a
file counts when its path, seen from any directory of the tree, could be the module, so `pythonpath`,
PYTHONPATH and editable installs need no reading.

    python -m pytest tests/unit/shared/grading/test_pytest_config.py -q
"""

from __future__ import annotations

import ast
import configparser
import os
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

CONFIG_NAMES = ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini",
                "setup.cfg")
"""pytest's configuration files, in its order of precedence within one directory (pytest 9; pytest 8
reads the same without the two pytest.toml files)."""

PYTEST_BUILTIN_PLUGINS = frozenset((
    "assertion", "cacheprovider", "capture", "debugging", "doctest", "faulthandler", "fixtures",
    "helpconfig", "junitxml", "legacypath", "logging", "main", "mark", "monkeypatch", "pastebin", "pytester",
    "pytester_assertions", "python", "python_path", "recwarn", "reports", "runner", "setuponly",
    "setupplan", "skipping", "stepwise", "terminal", "threadexception", "tmpdir", "unittest",
    "unraisableexception", "warnings"))
"""`-p NAME` with one of these names imports pytest's own `_pytest.NAME` (pytest 7 to 9), which comes from
wherever pytest itself does: a row whose code under test is pytest is outside what the grader can stop.
Names pytest made its own later (subtests, terminalprogress) are read as modules of the tree, which an
older pytest in the sandbox would import."""

EXTENSION_SUFFIXES = (".so", ".pyd")
MAX_TREE_ENTRIES = 400_000
"""A walk that meets more entries than this (directory symlinks that fan out) refuses the diff."""


@dataclass(frozen=True)
class PluginOption:
    """One `-p NAME` of a configuration's addopts."""

    config: str
    """The configuration file, relative to the tree's root."""
    option: str
    """The option as written, e.g. `-p tinystats_plugin`."""
    module: str
    """The module pytest imports for it."""


def addopts_plugin_refusal(root: Path, changed: set[str], test_command: str = "") -> str | None:
    """Why the diff is refused (a file it changed runs, through a `-p` plugin of the repository's own
    pytest `addopts`, before the grader's plugin), or None. `changed` holds the paths the diff changed,
    added or removed and that were not restored; `root` is the tree with the configuration restored."""
    if not changed:
        return None
    options = [option for config in _config_files(root, test_command)
               for option in plugin_options(root, config)]
    if not options:
        return None
    tree = _TreeIndex(root, changed)
    if tree.too_large:
        return (f"the repository's pytest configuration loads {options[0].option} before the grader's "
                f"plugin, and the tree is too large to tell which of its files that imports: not trusted")
    for option in options:
        chain = tree.changed_import(option.module)
        if chain is not None:
            via = "".join(f", imported by {path}" for path in reversed(chain[:-1]))
            return (f"the diff changed {chain[-1]}{via}, which the repository's own pytest configuration "
                    f"{option.config} loads with `{option.option}` (its addopts) before the grader's "
                    f"plugin: code it changed would run first, so the results are not trusted")
    return None


def _config_files(root: Path, test_command: str) -> list[str]:
    """Every configuration file of the tree pytest could read, relative to the root."""
    found = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(name for name in dirnames if name != ".git")
        relative = PurePosixPath(Path(directory).relative_to(root).as_posix())
        found += [str(relative / name) for name in CONFIG_NAMES if name in filenames]
    for named in _named_config_files(test_command):
        path = root / named
        if path.is_file() and path.resolve().is_relative_to(root.resolve()) and named not in found:
            found.append(named)
    return found


def _named_config_files(test_command: str) -> list[str]:
    """The files a test command hands pytest with `-c` or `--config-file`."""
    try:
        words = shlex.split(test_command)
    except ValueError:
        words = test_command.split()
    named = []
    for i, word in enumerate(words):
        if word in ("-c", "--config-file", "--inifile") and i + 1 < len(words):
            named.append(words[i + 1])
        elif word.startswith(("--config-file=", "--inifile=")):
            named.append(word.partition("=")[2])
        elif word.startswith("-c") and not word.startswith("--") and len(word) > 2:
            named.append(word[2:])
    return [os.path.normpath(name) for name in named if name and not os.path.isabs(name)]


def plugin_options(root: Path, config: str) -> list[PluginOption]:
    """The `-p` plugins of the tree that the configuration file `config` loads through its addopts."""
    words = _addopts_words(root / config)
    options = []
    i = 0
    while i < len(words):  # the scan pytest's PytestPluginManager.consider_preparse makes
        word = words[i]
        i += 1
        if word == "-p":
            if i >= len(words):
                break
            name, option = words[i], f"-p {words[i]}"
            i += 1
        elif word.startswith("-p"):
            name, option = word[2:], word
        else:
            continue
        name = name.strip().lstrip("=").strip()
        if name and not name.startswith("no:") and name not in PYTEST_BUILTIN_PLUGINS:
            options.append(PluginOption(config=config, option=option, module=name))
    return options


def _addopts_words(path: Path) -> list[str]:
    """The configuration's addopts split into words as pytest splits them; when the file cannot be read
    as pytest's configuration, every word of it (refusing is the safe side)."""
    try:
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
    except OSError:
        return []
    try:
        value = _addopts_value(path.name, text)
    except (tomllib.TOMLDecodeError, configparser.Error, AttributeError, TypeError):
        return text.split()
    if isinstance(value, list):
        return [str(word) for word in value]
    if not isinstance(value, str):
        return []
    try:
        return shlex.split(value)
    except ValueError:
        return value.split()


def _addopts_value(name: str, text: str) -> object:
    """The `addopts` value of one configuration file's pytest section (None when it has none)."""
    if name.endswith(".toml"):
        document = tomllib.loads(text)
        tables = [document.get("pytest", {})]
        tool_pytest = document.get("tool", {}).get("pytest", {})
        tables += [tool_pytest, tool_pytest.get("ini_options", {})]
        values = [table.get("addopts") for table in tables if isinstance(table, dict)]
        present = [value for value in values if value is not None]
        if len(present) > 1:  # pytest refuses both tables in one file; read both all the same
            return [str(word) for value in present
                    for word in (value if isinstance(value, list) else str(value).split())]
        return present[0] if present else None
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.read_string(text)
    section = "tool:pytest" if name.endswith(".cfg") else "pytest"  # setup.cfg's; pytest.ini's, tox.ini's
    if not parser.has_section(section):
        return None
    return parser.get(section, "addopts", fallback=None)


def _module_names(module: str) -> list[str]:
    """`a.b.c` -> a, a.b, a.b.c: importing a module first runs the packages above it."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts) + 1) if all(parts[:end])]


def could_be_module(path: PurePosixPath, module: str) -> bool:
    """Whether the file at `path` is imported as `module` when some directory above it is on sys.path."""
    parts = tuple(module.split("."))
    directories = path.parent.parts
    if path.name == "__init__.py":
        return len(directories) >= len(parts) and directories[len(directories) - len(parts):] == parts
    package, stem = parts[:-1], parts[-1]
    if len(directories) < len(package) or directories[len(directories) - len(package):] != package:
        return False
    return path.name == f"{stem}.py" or (path.name.startswith(f"{stem}.")
                                         and path.suffix in EXTENSION_SUFFIXES)


def _module_key(path: PurePosixPath) -> str | None:
    """The last part of the module name a file could be imported as, or None for no module."""
    if path.name == "__init__.py":
        return path.parent.name or None
    if path.suffix == ".py" or path.suffix in EXTENSION_SUFFIXES:
        return path.name.split(".", 1)[0]
    return None


class _TreeIndex:
    """The tree's module files by the last part of their name, each file under every path it has through
    the tree's directory symlinks, and whether the diff changed it."""

    def __init__(self, root: Path, changed: set[str]) -> None:
        self.root = root
        self.real_root = root.resolve()
        self.changed = {PurePosixPath(path) for path in changed}
        self.files: dict[str, list[PurePosixPath]] = {}
        self.entries = 0
        self.too_large = False
        """More than MAX_TREE_ENTRIES entries, counted through the directory symlinks: not walked whole."""
        self._walk(root, PurePosixPath(), (self.real_root,))
        for path in self.changed:  # removed files too: a module the diff deleted is one it changed
            key = _module_key(path)
            if key is not None and path not in self.files.get(key, []):
                self.files.setdefault(key, []).append(path)

    def _walk(self, directory: Path, relative: PurePosixPath, chain: tuple[Path, ...]) -> None:
        if self.too_large:
            return
        try:
            entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
        except OSError:
            return
        self.entries += len(entries)
        if self.entries > MAX_TREE_ENTRIES:
            self.too_large = True
            return
        for entry in entries:
            path = relative / entry.name
            if entry.name == ".git":
                continue
            if entry.is_dir():  # follows symlinks: a link's files are importable under its name
                real = Path(os.path.realpath(entry.path))
                if real in chain or not real.is_relative_to(self.real_root):
                    continue
                self._walk(Path(entry.path), path, (*chain, real))
            else:
                key = _module_key(path)
                if key is not None:
                    self.files.setdefault(key, []).append(path)

    def change_on(self, path: PurePosixPath) -> PurePosixPath | None:
        """What the diff changed of the file at `path`: the file, a directory or symlink on its path, or
        the file the path resolves to; None when it changed none of them."""
        real = Path(os.path.realpath(self.root / path))
        seen = [path]
        if real.is_relative_to(self.real_root):
            seen.append(PurePosixPath(real.relative_to(self.real_root).as_posix()))
        for candidate in seen:
            for changed in (candidate, *candidate.parents):
                if changed in self.changed:
                    return changed
        return None

    def candidates(self, module: str) -> list[PurePosixPath]:
        return [path for path in self.files.get(module.rsplit(".", 1)[-1], [])
                if could_be_module(path, module)]

    def changed_import(self, module: str) -> list[str] | None:
        """The chain of files from `module` to the first file the diff changed that importing it runs,
        or None. Imports are read from the source, wherever they are in it (a hook that runs at
        registration imports too); a name built at run time is not followed."""
        pending = [(name, ()) for name in _module_names(module)]
        visited: set[PurePosixPath] = set()
        while pending:
            name, chain = pending.pop(0)
            for path in self.candidates(name):
                if path in visited:
                    continue
                visited.add(path)
                change = self.change_on(path)
                if change is not None:
                    return [*chain, str(change) if change == path else f"{change} (as {path})"]
                pending += [(imported, (*chain, str(path))) for imported in _imports(self.root / path, path)]
        return None


def _imports(file: Path, path: PurePosixPath) -> list[str]:
    """The modules a Python source file imports (with the packages above them), its `pytest_plugins`
    and the literal names it hands importlib.import_module or __import__."""
    if file.suffix != ".py":
        return []
    try:
        tree = ast.parse(file.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    package = list(path.parent.parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [name for alias in node.names for name in _module_names(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            names += _from_import(node, package)
        elif isinstance(node, ast.Call) and _is_import_call(node):
            names += _module_names(node.args[0].value)
        elif isinstance(node, ast.Assign) and _assigns_pytest_plugins(node):
            names += [name for constant in ast.walk(node.value)
                      if isinstance(constant, ast.Constant) and isinstance(constant.value, str)
                      for name in _module_names(constant.value)]
    return names


def _from_import(node: ast.ImportFrom, package: list[str]) -> list[str]:
    """`from X import a, b`: X and the packages above it, and X.a, X.b (each may be a submodule); a
    relative X is named from the importing file's own directories."""
    if node.level:
        if node.level - 1 > len(package):
            return []
        base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else []))
        names = [base] if base else []
    else:
        base = node.module or ""
        names = _module_names(base)
    prefix = f"{base}." if base else ""
    return names + [prefix + alias.name for alias in node.names if alias.name != "*"]


def _is_import_call(node: ast.Call) -> bool:
    function = node.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    return (name in ("import_module", "__import__") and bool(node.args)
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))


def _assigns_pytest_plugins(node: ast.Assign) -> bool:
    return any(isinstance(target, ast.Name) and target.id == "pytest_plugins" for target in node.targets)
