"""Keys (keys.py): every key of a run in its namespace and in one Redis Cluster slot, and RQ job ids that RQ
takes whatever the run and rollout ids hold.

    python -m pytest tests/unit/shared/contract/test_keys.py -q
"""

import pytest

from rollstream.shared.contract.keys import Keys
from rollstream.shared.contract.streams import STREAMS


def test_keys_are_namespaced_per_run_in_one_cluster_slot():
    from redis.crc import key_slot

    keys = Keys("run1")
    assert keys.stream("prompts") == "rs:{run1}:prompts"
    assert keys.state("reward", "group", "g1") == "rs:{run1}:state:reward:group:g1"
    every_key = [*(keys.stream(stream) for stream in STREAMS), keys.trained_batches, keys.incarnation]
    assert len({key_slot(key.encode()) for key in every_key}) == 1
    assert key_slot(Keys("run2").stream("prompts").encode()) != key_slot(every_key[0].encode())
    assert {Keys.run_of(key) for key in every_key} == {"run1"}
    assert Keys.run_of("rq:queue:default") is None and Keys.run_of("rs:run1:prompts") is None
    with pytest.raises(ValueError, match="unknown stream"):
        keys.stream("nope")
    with pytest.raises(ValueError):
        Keys("a:b")


def test_grade_job_ids_are_ids_rq_takes_whatever_the_run_and_rollout_ids_hold():
    from rq.job import validate_job_id

    plain = Keys("run-1").grade_job_id("abc", "rollout_7")
    assert plain == "grade-run-1-abc-rollout_7"
    odd = [Keys("exp.v2/α").grade_job_id("abc", "r:1"), Keys("exp.v2/α").grade_job_id("abc", "r:2"),
           Keys("exp.v2/α").grade_job_id("abd", "r:1")]
    for job_id in [plain, *odd]:
        validate_job_id(job_id)
    assert len(set(odd)) == 3 and odd[0] == Keys("exp.v2/α").grade_job_id("abc", "r:1")


def test_the_reward_services_keys_are_its_state_in_the_runs_namespace():
    reward = Keys("run1").reward
    assert reward.group("g1") == Keys("run1").state("reward", "group", "g1")  # as its book always named it
    per_group = [reward.group("g1"), reward.segments("g1"), reward.ended("g1"), reward.resolved("g1"),
                 reward.assigned("g1"), reward.done("g1")]
    once = [reward.ready_groups, reward.ready_rollouts, reward.filtered_groups, reward.seal_counter,
            reward.sealed_groups, reward.held_groups, reward.dropped, reward.awaiting_grades]
    assert len(set(per_group + once)) == 14
    # what the reward service's Redis user may write (infra/redis-users.acl: ~rs:*:state:reward:*)
    assert all(key.startswith("rs:{run1}:state:reward:") for key in per_group + once)
    assert reward.segments("g1") != reward.segments("g2")
