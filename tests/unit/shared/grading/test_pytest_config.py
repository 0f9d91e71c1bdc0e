"""Reading the `-p` plugins of a repository's own pytest configuration, and refusing a diff that changed
what they import before the grader's plugin: every configuration file pytest could read, the ways `-p` is
written, dotted names, imports followed through the tree and its directory symlinks. The sandboxed cases
(a real row, both backends) are in test_hostile_swebench.py.

    python -m pytest tests/unit/shared/grading/test_pytest_config.py -q
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollstream.shared.grading import pytest_config
from rollstream.shared.grading.pytest_config import addopts_plugin_refusal, plugin_options


def _tree(root: Path, files: dict[str, str]) -> Path:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


@pytest.mark.parametrize(("config", "text"), [
    ("pytest.ini", "[pytest]\naddopts = -p one -ptwo --strict-markers\n    -p three\n"),
    (".pytest.ini", "[pytest]\naddopts = -p one -ptwo -p three\n"),
    ("tox.ini", "[tox]\nenvlist = py311\n\n[pytest]\naddopts = -p one -ptwo -p three\n"),
    ("setup.cfg", "[metadata]\nname = x\n\n[tool:pytest]\naddopts =\n    -p one\n    -ptwo -p three\n"),
    ("pyproject.toml", "[tool.pytest.ini_options]\naddopts = '-p one -ptwo -p three'\n"),
    ("pyproject.toml", "[tool.pytest.ini_options]\naddopts = ['-p', 'one', '-ptwo', '-p', 'three']\n"),
    ("pyproject.toml", "[tool.pytest]\naddopts = ['-p', 'one', '-ptwo', '-p', 'three']\n"),
    ("pytest.toml", "[pytest]\naddopts = ['-p', 'one', '-ptwo', '-p', 'three']\n"),
])
def test_every_configuration_file_and_way_of_writing_p(tmp_path, config, text):
    _tree(tmp_path, {config: text})
    assert [option.module for option in plugin_options(tmp_path, config)] == ["one", "two", "three"]


def test_disabled_and_pytests_own_plugins_are_not_the_trees(tmp_path):
    _tree(tmp_path, {"pytest.ini": "[pytest]\naddopts = -p no:cacheprovider -p pytester -pno:warnings "
                                   "-p tests.plugins.db -k '-p not_a_plugin' --tb=short\n"})
    options = plugin_options(tmp_path, "pytest.ini")
    # pytest's own scan takes `-p not_a_plugin` inside -k's value for a plugin too: so do we
    assert [(option.option, option.module) for option in options] == [
        ("-p tests.plugins.db", "tests.plugins.db"), ("-p not_a_plugin", "not_a_plugin")]


def test_sections_pytest_does_not_read_and_files_it_cannot_parse(tmp_path):
    _tree(tmp_path, {"tox.ini": "[testenv]\ncommands = pytest -p from_tox\n",
                     "pyproject.toml": "[tool.black]\nline-length = 110\n",
                     "setup.cfg": "[tool:pytest]\naddopts = -p ok\nthis line has no equals sign\n"})
    assert plugin_options(tmp_path, "tox.ini") == []
    assert plugin_options(tmp_path, "pyproject.toml") == []
    # configparser cannot read it: every word of the file counts, on the safe side
    assert [option.module for option in plugin_options(tmp_path, "setup.cfg")] == ["ok"]


def test_a_changed_plugin_module_or_a_package_above_it_is_refused(tmp_path):
    _tree(tmp_path, {"tests/pytest.ini": "[pytest]\naddopts = -p helpers.plugin\npythonpath = .\n",
                     "tests/helpers/__init__.py": "", "tests/helpers/plugin.py": "X = 1\n",
                     "src/pkg/core.py": "Y = 2\n"})
    assert addopts_plugin_refusal(tmp_path, {"src/pkg/core.py", "README.md"}) is None
    why = addopts_plugin_refusal(tmp_path, {"tests/helpers/__init__.py"})
    assert why is not None and why.startswith(
        "the diff changed tests/helpers/__init__.py, which the repository's own pytest configuration "
        "tests/pytest.ini loads with `-p helpers.plugin` (its addopts) before the grader's plugin"), why
    for added in ("helpers/plugin.py", "src/helpers/plugin/__init__.py", "helpers/plugin.cpython-311.so"):
        assert addopts_plugin_refusal(tmp_path, {added}) is not None, added  # a module in its place
    assert addopts_plugin_refusal(tmp_path, {"tests/helpers/plugin.py"}) is not None  # removed, too


def test_imports_are_followed_through_the_tree(tmp_path):
    _tree(tmp_path, {"pyproject.toml": "[tool.pytest.ini_options]\naddopts = '-p tools.plugin'\n",
                     "tools/__init__.py": "", "tools/plugin.py": "from .support import helper\n",
                     "tools/support.py": "def helper():\n    import importlib\n"
                                         "    importlib.import_module('late.module')\n"
                                         "pytest_plugins = ['more_fixtures']\n",
                     "late/module.py": "", "more_fixtures.py": "from pkg.core import value\n",
                     "pkg/__init__.py": "", "pkg/core.py": "", "pkg/unrelated.py": ""})
    assert addopts_plugin_refusal(tmp_path, {"pkg/unrelated.py"}) is None
    for changed, chain in (("late/module.py", "late/module.py, imported by tools/support.py"),
                           ("pkg/core.py", "pkg/core.py, imported by more_fixtures.py, imported by "
                                           "tools/support.py, imported by tools/plugin.py")):
        why = addopts_plugin_refusal(tmp_path, {changed})
        assert why is not None and why.startswith(f"the diff changed {chain}"), why


def test_a_directory_symlink_names_the_module(tmp_path):
    """`pkgs/tools` links to lib/real: on sys.path as pkgs, lib/real/plugin.py is the module tools.plugin."""
    _tree(tmp_path, {"pytest.ini": "[pytest]\naddopts = -p tools.plugin\npythonpath = pkgs\n",
                     "lib/real/__init__.py": "", "lib/real/plugin.py": "", "lib/other.py": ""})
    (tmp_path / "pkgs").mkdir()
    os.symlink("../lib/real", tmp_path / "pkgs" / "tools")
    assert addopts_plugin_refusal(tmp_path, {"lib/other.py"}) is None
    why = addopts_plugin_refusal(tmp_path, {"lib/real/plugin.py"})
    assert why is not None and why.startswith(
        "the diff changed lib/real/plugin.py (as pkgs/tools/plugin.py), which"), why
    assert addopts_plugin_refusal(tmp_path, {"pkgs/tools"}) is not None  # the link itself


def test_a_configuration_the_test_command_names(tmp_path):
    _tree(tmp_path, {"ci/pytest-ci.ini": "[pytest]\naddopts = -p ci_plugin\n", "ci_plugin.py": ""})
    assert addopts_plugin_refusal(tmp_path, {"ci_plugin.py"}, "python -m pytest -rA") is None
    why = addopts_plugin_refusal(tmp_path, {"ci_plugin.py"}, "python -m pytest -c ci/pytest-ci.ini -rA")
    assert why is not None and "ci/pytest-ci.ini loads with `-p ci_plugin`" in why, why


def test_a_tree_too_large_to_walk_is_refused(tmp_path, monkeypatch):
    _tree(tmp_path, {"pytest.ini": "[pytest]\naddopts = -p plugin\n", "plugin.py": "",
                     **{f"pkg/module_{i}.py": "" for i in range(5)}})
    assert addopts_plugin_refusal(tmp_path, {"pkg/module_0.py"}) is None
    monkeypatch.setattr(pytest_config, "MAX_TREE_ENTRIES", 4)
    why = addopts_plugin_refusal(tmp_path, {"pkg/module_0.py"})
    assert why is not None and "too large to tell which of its files that imports" in why, why
