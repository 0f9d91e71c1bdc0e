"""The trainer's data path: a Parquet batch to micro-batch tensors, as a share of one training step's time;
and padding waste (padded tokens / real tokens) with and without the trainer's packing of micro-batches.

Writes a batch the way the reward service does (shared/contract/batches.py): --batch-size rows in groups of
--group, each a prompt of 32-128 tokens (loss mask 0) and a response of heavy-tailed length (lognormal about
--median-tokens, sigma 1; loss mask 1), within the model's positions. The trainer's own code then takes it
through its step (services/trainer/training.py Trainer on the model of `make setup`, the torch backend on
this machine's CPU, or its GPU when there is one), --rounds times after an untimed step, medians compared:
    data path   Trainer.load_batch (the Parquet file to rows) + make_micro_batches (rows to packed tensors:
                services/trainer/ppo.py, with the trainer's micro-batch budget)
    step        Trainer.load_batch + Trainer.optimize (which packs the rows itself, then forward, backward,
                optimizer step: train.minibatches of them)
Padding, over the whole batch:
    packed      the micro-batches' tensors as make_micro_batches builds them (several samples per row,
                first-fit by decreasing length)
    unpacked    one sample per row, rows in batch order, each micro-batch as many rows as the same token
                budget holds at its longest row's width (what a trainer without packing pads)

    python bench/bench_data_path.py [--batch-size 32] [--group 4] [--median-tokens 128] [--rounds 5]
                                    [--model models/tiny-llama] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from results import Figure, parse_args, write_result

from rollstream.shared.contract.batches import BatchRow, write_batch
from rollstream.shared.contract.events import BatchReady
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage

RUN = "bench-data-path"
SIGMA = 1.0


def batch_rows(size: int, group: int, median_tokens: int, max_positions: int, vocab: int,
               seed: int) -> list[BatchRow]:
    """A reward-complete batch: whole groups, one prompt per group, heavy-tailed responses."""
    rng = random.Random(seed)
    rows = []
    for index in range(size):
        group_id = f"g{index // group}"
        if index % group == 0:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(32, 128))]
        drawn = round(rng.lognormvariate(0, SIGMA) * median_tokens)
        response = max(8, min(max_positions - len(prompt), drawn))
        tokens = prompt + [rng.randrange(3, vocab) for _ in range(response)]
        rollout = f"r{index}"
        rows.append(BatchRow(sample_index=index, trajectory_id=rollout, rollout_id=rollout, group_id=group_id,
                             session_id=rollout, segment_index=0, tokens=tokens, response_length=response,
                             loss_mask=[0] * len(prompt) + [1] * response,
                             rollout_logprobs=[-rng.uniform(0.1, 3.0) for _ in tokens],
                             turn_policy_versions=[0], status="completed", reward=float(index % 2),
                             advantage=rng.gauss(0, 1)))
    return rows


def unpacked_padding(lengths: list[int], budget: int) -> int:
    """Padded tokens with one sample per row, rows in order, each micro-batch as many rows as fit the budget
    at its longest row's width (a sample longer than the budget alone)."""
    padded, batch = 0, []
    for length in [*lengths, None]:
        if batch and (length is None or (len(batch) + 1) * max(*batch, length) > budget):
            padded += len(batch) * max(batch) - sum(batch)
            batch = []
        if length is not None:
            batch.append(length)
    return padded


@dataclass
class Measured:
    rows: list[BatchRow]
    data_s: float
    """Median time of the data path: Parquet to micro-batch tensors."""
    step_s: float
    """Median time of a training step."""
    micro_batches: list
    """The batch packed as the trainer packs it."""
    micro_batch_tokens: int
    model: Path
    device: str


def measure(args: argparse.Namespace) -> Measured:
    """The trainer's data path and its step on a batch written as the reward service writes one, medians of
    --rounds after an untimed step."""
    from rollstream.services.trainer.ppo import make_micro_batches
    from rollstream.services.trainer.training import Trainer

    with tempfile.TemporaryDirectory(prefix="rs-bench-data-path-") as tmp:
        settings = Settings(run_id=RUN, storage_uri=tmp, model={"path": args.model}, fleet={"urls": []},
                            train={"batch_size": args.batch_size, "trackers": []})
        storage = Storage(settings.storage_uri)
        trainer = Trainer(settings, storage, start=None)
        rows = batch_rows(args.batch_size, args.group, args.median_tokens, trainer.max_positions,
                          trainer.vocab_size, args.seed)
        batch = BatchReady(batch_id="b-bench", uri=write_batch(storage, RUN, "b-bench", rows),
                           sample_count=len(rows), group_ids=list(dict.fromkeys(r.group_id for r in rows)),
                           min_policy_version=0, mean_reward=statistics.fmean(r.reward for r in rows))
        cfg = settings.train

        def data_path() -> float:
            started = time.perf_counter()
            loaded = trainer.load_batch(batch)
            make_micro_batches(loaded, cfg.loss_aggregation, cfg.micro_batch_tokens, trainer.pad_id,
                               trainer.backend.device)
            return time.perf_counter() - started

        def step() -> float:
            started = time.perf_counter()
            trainer.optimize(trainer.load_batch(batch))
            if trainer.backend.device.type == "cuda":
                trainer.torch.cuda.synchronize()
            return time.perf_counter() - started

        step()  # the first step allocates the optimizer's state and warms the kernels
        data_s = statistics.median(data_path() for _ in range(args.rounds))
        step_s = statistics.median(step() for _ in range(args.rounds))
        micros = make_micro_batches(rows, cfg.loss_aggregation, cfg.micro_batch_tokens, trainer.pad_id)
        device = trainer.backend.device
        trainer.close()
    return Measured(rows, data_s, step_s, micros, cfg.micro_batch_tokens, settings.model.path, str(device))


def report(args: argparse.Namespace, measured: Measured) -> None:
    """The data path's share of a step, and the padding with and without packing; the figures (--json)."""
    rows, budget, device = measured.rows, measured.micro_batch_tokens, measured.device
    data_s, step_s = measured.data_s, measured.step_s
    real = sum(len(row.tokens) for row in rows)
    packed = sum(micro.tokens.numel() for micro in measured.micro_batches) - real
    unpacked = unpacked_padding([len(row.tokens) for row in rows], budget)
    lengths = sorted(len(row.tokens) for row in rows)
    print(f"batch of {len(rows)} rows ({args.group} per prompt), {real} tokens, lengths {lengths[0]} / "
          f"{lengths[len(lengths) // 2]} / {lengths[-1]} (min / median / max); micro-batch budget "
          f"{budget} tokens; {measured.model} on {device}; medians of {args.rounds}")
    print(f"data path (Parquet to micro-batch tensors) {data_s * 1e3:8.1f} ms")
    print(f"training step (read, pack, forward, backward, step) {step_s * 1e3:8.1f} ms")
    print(f"data path / step {data_s / step_s:.3f}")
    print(f"padded / real tokens: packed {packed / real:.3f} ({len(measured.micro_batches)} micro-batches), "
          f"unpacked {unpacked / real:.3f}; packed / unpacked {packed / unpacked:.3f}")
    write_result(args.json, [
        Figure("Parquet batch to micro-batch tensors", data_s,
               "one training step (read, pack, forward, backward, optimizer step)", step_s, "s"),
        Figure("padding with the trainer's packing", packed / real, "one sample per row, batch order",
               unpacked / real, "padded / real tokens")],
        [f"{len(rows)} rows, {real} tokens, lengths {lengths[0]}-{lengths[-1]} (median "
         f"{lengths[len(lengths) // 2]}), micro-batch budget {budget} tokens, {device}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/tiny-llama"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--median-tokens", type=int, default=128, help="median response length")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(parser, smoke={"batch_size": 8, "median_tokens": 32, "rounds": 1})
    report(args, measure(args))


if __name__ == "__main__":
    main()
