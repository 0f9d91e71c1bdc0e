"""A real vLLM server's weight sync against the checkpoint's size, next to the disk's read throughput measured
in the same run.

For each model shape (`HIDDENxLAYERS`: the tiny Llama's architecture, tokenizer and vocabulary, head_dim 64,
intermediate 2 x hidden), writes two randomly initialised checkpoints the way the trainer writes its versions
(shared/inference/serving_weights.py), starts a vLLM CPU server of the first (untimed), then syncs it the way
the trainer does (rollstream.shared.inference.weight_sync: pause, reload_weights, reset the prefix cache,
resume, probe: the server's prompt logprobs must match transformers' own), alternating between the two
checkpoints, `--rounds` times. Before every sync the checkpoint's files are dropped from the page cache
(posix_fadvise DONTNEED), so the server reads them from the disk; beside every sync the same files are
dropped and read back with plain 8 MiB reads: the disk's throughput on those bytes. Prints the medians per
size and sync / read: how far a sync is from what the disk allows.

    python bench/bench_checkpoint_sync.py [--shapes 128x2 512x4 1024x4] [--rounds 3] [--workdir DIR]
                                          [--smoke] [--json PATH]
    python bench/bench_checkpoint_sync.py --fleet-url http://127.0.0.1:8000 --model models/tiny-llama
        # a running server of --model: only its shape is measured, and it serves --model again at the end
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from results import Figure, parse_args, write_result

from rollstream.cli.vllm_server import VllmServer, free_port
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.inference.weight_sync import sync_weights
from rollstream.shared.inference.weight_transport import DiskTransport, WeightUpdate

PROBE = list(range(1, 33))
TOLERANCE = 1e-3
"""The trainer's default parity tolerance (train.parity_tolerance)."""
HEAD_DIM = 64
READ_CHUNK = 8 << 20


def write_checkpoint(base: Path, shape: tuple[int, int] | None, seed: int,
                     out: Path) -> tuple[Path, list[float]]:
    """A checkpoint of base's architecture (`shape`: hidden, layers instead of base's), weights from `seed`;
    and the logprobs of PROBE it gives, which the server must serve once it loaded it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollstream.shared.inference.serving_weights import write_serving_checkpoint

    config = AutoConfig.from_pretrained(base)
    if shape is not None:
        hidden, layers = shape
        config.update({"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
                       "num_attention_heads": hidden // HEAD_DIM, "num_key_value_heads": hidden // HEAD_DIM,
                       "head_dim": HEAD_DIM})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    write_serving_checkpoint(model, out, tokenizer_source=base)
    with torch.no_grad():  # each probe token's logprob given the ones before it, as vLLM's prompt logprobs
        logits = model(input_ids=torch.tensor([PROBE])).logits[0, :-1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(PROBE[1:])[:, None])
    return out, expected.squeeze(-1).tolist()


def weight_files(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("*.safetensors"))


def drop_from_page_cache(checkpoint: Path) -> None:
    for path in weight_files(checkpoint):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_read_seconds(checkpoint: Path) -> float:
    drop_from_page_cache(checkpoint)
    started = time.perf_counter()
    for path in weight_files(checkpoint):
        with open(path, "rb", buffering=0) as f:
            while f.read(READ_CHUNK):
                pass
    return time.perf_counter() - started


async def cold_sync_seconds(url: str, checkpoint: Path, expected: list[float]) -> float:
    drop_from_page_cache(checkpoint)
    async with FleetClient([url]) as fleet:
        started = time.perf_counter()
        diffs, _ = await sync_weights(fleet, DiskTransport(1), WeightUpdate(1, checkpoint=checkpoint), PROBE,
                                      expected)
        seconds = time.perf_counter() - started
    if (worst := max(diffs.values())) > TOLERANCE:
        raise RuntimeError(f"the server serves other weights than {checkpoint} after the sync: {worst:.2e}")
    return seconds


def measure(url: str, checkpoints: list[tuple[Path, list[float]]], rounds: int) -> tuple[float, float]:
    """Median seconds of a cold sync and of a cold read of the same files, alternating the checkpoints."""
    a, b = (expected for _, expected in checkpoints)
    if max(abs(x - y) for x, y in zip(a, b)) < 10 * TOLERANCE:
        raise RuntimeError("the two checkpoints give nearly the same logprobs: no probe tells them apart")
    syncs, reads = [], []
    for index in range(rounds):
        checkpoint, expected = checkpoints[(index + 1) % 2]  # the server starts on the first
        syncs.append(asyncio.run(cold_sync_seconds(url, checkpoint, expected)))
        reads.append(cold_read_seconds(checkpoint))
    return statistics.median(syncs), statistics.median(reads)


async def put_back(url: str, model: Path) -> None:
    async with FleetClient([url]) as fleet:
        await fleet.reload_weights(url, str(model.resolve()))


def parse_shape(text: str) -> tuple[int, int]:
    hidden, _, layers = text.partition("x")
    if not (hidden.isdigit() and layers.isdigit()) or int(hidden) % HEAD_DIM:
        raise argparse.ArgumentTypeError(f"{text!r}: HIDDENxLAYERS with HIDDEN a multiple of {HEAD_DIM}")
    return int(hidden), int(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/tiny-llama"),
                        help="tokenizer and architecture of the checkpoints; with --fleet-url, served")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[(128, 2), (512, 4), (1024, 4)],
                        help="HIDDENxLAYERS of each checkpoint size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fleet-url", default=None, help="a running vLLM server of --model (its shape only)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the checkpoints go: the disk measured (default: the temp directory)")
    args = parse_args(parser, smoke={"shapes": [(128, 2)], "rounds": 1})
    shapes: list[tuple[int, int] | None] = [None] if args.fleet_url else args.shapes
    rows = []
    with tempfile.TemporaryDirectory(prefix="rs-bench-ckpt-", dir=args.workdir) as tmp:
        for shape in shapes:
            name = "served" if shape is None else f"{shape[0]}x{shape[1]}"
            checkpoints = [write_checkpoint(args.model, shape, seed, Path(tmp) / f"{name}-seed{seed}")
                           for seed in (0, 1)]
            size = sum(path.stat().st_size for path in weight_files(checkpoints[0][0]))
            if args.fleet_url:
                sync_s, read_s = measure(args.fleet_url, checkpoints, args.rounds)
                asyncio.run(put_back(args.fleet_url, args.model))
            else:
                log = Path(tmp) / f"vllm-{name}.log"
                with VllmServer(checkpoints[0][0], free_port(), log_path=log) as server:
                    server.wait_healthy()
                    sync_s, read_s = measure(server.url, checkpoints, args.rounds)
            rows.append((name, size, sync_s, read_s))
            print(f"{name}: {size / 2**20:.1f} MiB, sync {sync_s:.3f} s, read {read_s:.4f} s", flush=True)
    print(f"\nweight sync of one vLLM server (CPU), checkpoint read cold; medians of {args.rounds} rounds")
    print(f"{'shape':<10}{'MiB':>9}{'sync s':>9}{'read s':>9}{'sync MiB/s':>12}{'disk MiB/s':>12}"
          f"{'sync/read':>11}")
    for name, size, sync_s, read_s in rows:
        mib = size / 2**20
        print(f"{name:<10}{mib:>9.1f}{sync_s:>9.3f}{read_s:>9.4f}{mib / sync_s:>12.0f}{mib / read_s:>12.0f}"
              f"{sync_s / read_s:>11.1f}")
    figures = [Figure(f"weight sync, {size / 2**20:.1f} MiB checkpoint ({name})", sync_s,
                      "cold read of its files", read_s, "s") for name, size, sync_s, read_s in rows]
    write_result(args.json, figures, [
        f"one vLLM server; pause, reload_weights, reset prefix cache, resume, parity probe of {len(PROBE)} "
        f"tokens; files dropped from the page cache before each sync and each read; medians of {args.rounds} "
        "rounds"])


if __name__ == "__main__":
    main()
