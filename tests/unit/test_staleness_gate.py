import pytest

from services.dispatcher.main import StalenessGate


def admitted_before_first_update(gate: StalenessGate, group: int) -> int:
    admitted = 0
    while gate.admits(admitted, group, policy_version=0):
        admitted += group
    return admitted


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_generation_runs_at_most_eta_versions_ahead(eta):
    gate = StalenessGate(max_staleness=eta, batch_size=8)
    assert admitted_before_first_update(gate, group=4) == (eta + 1) * 8


def test_synchronous_mode_admits_exactly_one_batch_per_version():
    gate = StalenessGate(max_staleness=0, batch_size=8)
    assert gate.admits(0, 8, 0) and not gate.admits(8, 4, 0)
    assert gate.admits(8, 8, 1) and not gate.admits(16, 4, 1)
