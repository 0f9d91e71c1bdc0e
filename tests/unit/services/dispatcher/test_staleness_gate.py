import pytest

from rollstream.services.dispatcher.gate import StalenessGate, admit_group, filtered_samples, next_step
from rollstream.services.reward.book import RewardBook
from rollstream.shared.contract.bus import Delivery
from rollstream.shared.contract.events import TrajectoryFinished, TrajectorySegment, make_envelope
from rollstream.shared.runtime.storage import Storage
from rollstream.shared.tasks.rows import PromptRow


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


def test_filtered_samples_give_their_admission_slots_back():
    gate = StalenessGate(max_staleness=0, batch_size=8)
    assert not gate.admits(8, 4, 0)
    assert gate.admits(8, 4, 0, filtered=4) and not gate.admits(12, 4, 0, filtered=4)


def finish(bus, rollout_id: str, group_id: str, answer: str, sample_index: int,
           group_size: int) -> list[Delivery]:
    ids = dict(run_id=bus.keys.run_id, group_id=group_id, rollout_id=rollout_id, trajectory_id=rollout_id,
               session_id=rollout_id)
    segment = TrajectorySegment(segment_index=0, attempt="a", tokens=[1, 2, 3], response_length=1,
                                loss_mask=[0, 0, 1], rollout_logprobs=[0.0, 0.0, -0.5],
                                turn_policy_versions=[0], status="completed", response_text=answer,
                                sample_index=sample_index, group_size=group_size)
    finished = TrajectoryFinished(status="completed", attempt="a", segment_count=1, group_size=group_size,
                                  sample_index=sample_index, response_text=answer, label="7")
    return [Delivery("trajectories", "0-1", make_envelope(segment, **ids)),
            Delivery("trajectories", "0-2", make_envelope(finished, **ids))]


def test_a_filtered_group_is_admitted_again_and_does_not_count_towards_the_run(bus, tmp_path):
    n, batch_size, total = 2, 4, 4
    gate = StalenessGate(max_staleness=0, batch_size=batch_size)
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size, filter_zero_variance=True)
    row = PromptRow(messages=[{"role": "user", "content": "What is 3 + 4?"}], label="7")

    def step(admitted: int) -> str:
        return next_step(gate, admitted=admitted, filtered=filtered_samples(bus), group_size=n,
                         policy_version=0, total=total)

    admitted = 0
    while step(admitted) == "admit":
        admit_group(bus, row, admitted // n, admitted, n, version=0)
        admitted += n
    assert admitted == 4 and step(admitted) == "done"

    prompts = bus.read_all("prompts")
    answers = ["7", "7", "7", "5"]  # the first group all right (no signal), the second mixed
    for delivery, answer in zip(prompts, answers):
        envelope = delivery.envelope
        for event in finish(bus, envelope.rollout_id, envelope.group_id, answer,
                            delivery.event.sample_index, n):
            group = book.record(event)
            if group:
                book.complete_if_ready(group)
    assert filtered_samples(bus) == 2
    assert step(admitted) == "admit"  # one group short of the run's samples again
    admit_group(bus, row, admitted // n, admitted, n, version=0)
    admitted += n
    assert step(admitted) == "done"
    assert int(bus.redis.get(bus.keys.admitted)) == 6 and len(bus.read_all("prompts")) == 6


def test_the_gate_waits_while_unfiltered_samples_fill_it(bus):
    gate = StalenessGate(max_staleness=0, batch_size=4)
    assert next_step(gate, admitted=4, filtered=0, group_size=2, policy_version=0, total=8) == "wait"
    bus.redis.incrby(bus.keys.filtered, 2)
    assert next_step(gate, admitted=4, filtered=filtered_samples(bus), group_size=2, policy_version=0,
                     total=8) == "admit"
    assert next_step(gate, admitted=4, filtered=0, group_size=2, policy_version=1, total=8) == "admit"


def test_an_admitted_sample_carries_the_rows_agent_tools_role_and_grading(bus):
    from rollstream.shared.tasks.rows import PromptRow

    row = PromptRow(messages=[{"role": "user", "content": "What is 2 + 3?"}], label="5",
                    sandbox_check="true", agent="tool_agent", tools=["calculator"],
                    metadata={"task": "arithmetic"}, role="solver")
    admit_group(bus, row, group_index=0, first_sample=0, n=2, version=3)
    issued = [d.event for d in bus.read_all("prompts")]
    assert [p.sample_index for p in issued] == [0, 1]
    for prompt in issued:
        assert (prompt.agent, prompt.tools, prompt.label, prompt.sandbox_check, prompt.role) == (
            "tool_agent", ["calculator"], "5", "true", "solver")
        assert (prompt.policy_version == 3 and prompt.group_size == 2
                and prompt.metadata == {"task": "arithmetic"})
