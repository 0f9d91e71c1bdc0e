"""The facts of a run that travel outside the streams (shared/contract/run_facts.py): each names who writes
and who reads it, and the code agrees (every module that touches a fact's key is one of them, and each of
them does), as do the deployment's Redis users (a fact's writers, and no other service, may write it).

    python -m pytest tests/unit/shared/contract/test_run_facts.py -q
"""

from __future__ import annotations

import ast

import pytest

from rollstream.shared.contract import run_facts
from rollstream.shared.contract.keys import Keys
from rollstream.shared.contract.run_facts import FILTERED_SAMPLES, FLEET_VERSIONS, RUN_FACTS, RunFact
from tests.unit.compose.test_redis_users import users
from tests.unit.test_layout import project_modules

COMMANDS = {"rollstream.cli.local_run": "rollstream run",
            "rollstream.shared.inference.vllm_fleet_member": "vllm"}
"""The modules outside services/ that are a fact's writer or reader, by the name the facts give them: the
command line's, and rollstream's plugin in the policy's vLLM servers (Redis user vllm)."""
RECORDS = {name: value.name for name, value in vars(run_facts).items() if isinstance(value, RunFact)}
"""Each fact's record by its name in run_facts.py (FILTERED_SAMPLES) -> the fact."""


def party(module: str) -> str | None:
    """Whose code a module is: a service's (services/<name>/), a command's (COMMANDS), or nobody's."""
    parts = module.split(".")
    if parts[1] == "services":
        return parts[2].replace("_", "-")
    return COMMANDS.get(module)


def touched_facts(tree: ast.AST) -> dict[str, list[int]]:
    """Fact -> the lines where a module touches its key: through its record, `<...>.keys.<fact>` (its
    template) or `<...>.bus.<fact>` (the bus's reader of it)."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in RECORDS:
            found.setdefault(RECORDS[node.id], []).append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in RUN_FACTS:
            owner = node.value
            owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if owner_name in ("keys", "bus"):
                found.setdefault(node.attr, []).append(node.lineno)
    return found


def test_every_module_that_touches_a_fact_is_the_code_of_one_of_its_writers_or_readers():
    wrong, found = [], {name: set() for name in RUN_FACTS}
    for module, path in project_modules().items():
        if module.startswith("rollstream.shared.contract."):
            continue  # the contract itself: the templates, the records, the bus's reader
        for name, lines in touched_facts(ast.parse(path.read_text(), str(path))).items():
            fact, who = RUN_FACTS[name], party(module)
            if module == fact.through:
                continue  # the one module its writers and readers reach it through
            found[name].add(who)
            if who not in fact.writers + fact.readers:
                wrong.append(f"{module}:{lines[0]} touches {name}, which {who or 'nobody named'} neither "
                             "writes nor reads (shared/contract/run_facts.py)")
    assert wrong == []
    # a fact kept through a module is touched by no other
    assert found == {name: set() if fact.through else {*fact.writers, *fact.readers}
                     for name, fact in RUN_FACTS.items()}


def test_the_check_finds_a_fact_touched_by_hand():
    written = ("score.filtered\n"
               "bus.redis.incrby(bus.keys.filtered, 1)\n"
               "versions = self.bus.fleet_versions()\n"
               "key = FLEET_VERSIONS.key(keys)\n")
    assert touched_facts(ast.parse(written)) == {"filtered": [2], "fleet_versions": [3, 4]}


def test_only_a_facts_writers_may_write_it_in_the_deployments_redis():
    """infra/redis-users.acl gives each service user write access to the keys it owns; `rollstream run`
    is no user of it (the local run's Redis has none)."""
    acl = users()
    for fact in RUN_FACTS.values():
        pattern = "~" + fact.key(Keys("RUN")).replace("rs:{RUN}", "rs:*")
        assert {user for user, rules in acl.items() if pattern in rules} == set(fact.writers) & set(acl), fact


def test_the_facts_are_the_ones_the_dispatcher_and_the_fleet_depend_on():
    assert FILTERED_SAMPLES.key(Keys("r")) == Keys("r").filtered == "rs:{r}:filtered"
    assert FILTERED_SAMPLES.writers == ("reward",) and FILTERED_SAMPLES.readers == ("dispatcher",)
    assert FLEET_VERSIONS.key(Keys("r")) == "rs:{r}:fleet:versions" and "trainer" in FLEET_VERSIONS.writers


def test_a_fact_names_a_key_of_keys_and_who_writes_and_reads_it():
    with pytest.raises(ValueError, match="'admited' names no key of Keys"):
        RunFact("admited", "counter", writers=("dispatcher",), readers=("console",))
    with pytest.raises(ValueError, match="needs its writers and its readers"):
        RunFact("admitted", "counter", writers=("dispatcher",), readers=())
