"""How the trainer's ranks share a minibatch's micro-batches, and which settings may have several ranks."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rollstream.services.trainer.ppo import MicroBatch
from rollstream.services.trainer.ranks import Ranks
from rollstream.shared.runtime.config import Settings


def micro(index: int, length: int = 4) -> MicroBatch:
    ones = torch.ones(1, length)
    return MicroBatch(tokens=torch.full((1, length), index), position_ids=torch.arange(length)[None],
                      attention_mask=None, loss_mask=ones, behaviour_logprobs=-ones, advantages=ones,
                      weights=ones * (index + 1))


def test_each_rank_runs_every_world_size_th_micro_batch_and_as_many_as_every_other_rank():
    micros = [micro(i, length=4 + i) for i in range(5)]
    shares = [Ranks(rank, 2).own_share(micros) for rank in range(2)]
    (first, first_real), (second, second_real) = shares
    assert [int(m.tokens[0, 0]) for m in first] == [0, 2, 4] and first_real == 3
    assert [int(m.tokens[0, 0]) for m in second[:second_real]] == [1, 3] and second_real == 2
    assert len(first) == len(second), "every rank takes part in as many reductions"
    padding = second[-1]
    assert padding.weights.shape == micros[0].weights.shape and not padding.weights.any()
    assert micros[0].weights.all(), "the copy leaves the micro-batch it copied alone"
    # every real micro-batch runs once, on one rank
    assert sorted(int(m.tokens[0, 0]) for m in first[:first_real] + second[:second_real]) == list(range(5))


def test_one_rank_runs_every_micro_batch_without_padding():
    micros = [micro(i) for i in range(3)]
    assert Ranks().own_share(micros) == (micros, 3)
    assert Ranks().share(None) is None and Ranks().gather("x") == ["x"]


def test_several_ranks_need_the_deepspeed_backend():
    with pytest.raises(ValidationError, match="deepspeed"):
        Settings(train={"ranks": 2})
    assert Settings(train={"ranks": 2, "backend": "deepspeed"}).train.ranks == 2
