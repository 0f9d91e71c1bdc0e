"""A LoRA run's weight sync of real vLLM CPU servers, one role's adapter per version, against a full-model
sync of the same servers measured in the same run (collective, delta off; and disk): seconds per version and
bytes moved, for each model shape.

For each shape (`HIDDENxLAYERS`, as bench/bench_weight_transport.py builds them: the tiny Llama's
architecture, float32) the shape's servers start (untimed) with LoRA enabled: `--roles` adapters at once
(`--enable-lora --max-lora-rank R --max-loras N`, loaded in place at run time). Then, for each fleet size (the
first N of them), each path syncs `--rounds` new versions after one untimed round (it loads every role's
adapter, forms the collective's group):
- lora: the trainer's peft model (the start checkpoint with one adapter per role: rank `--rank`, alpha twice
  the rank, train.lora_target_modules) moves one role's adapter (the roles take turns), writes it with
  save_pretrained to a fresh version directory (adapter_dir), then sync_adapters
  (shared/inference/adapter_sync.py) has every server load it in place and probes it under the role's name.
  Time: the write and the sync. The other adapters stay loaded; the base model never moves.
- collective full: the whole model moved and broadcast (CollectiveTransport over gloo, delta off), as
  bench/bench_weight_transport.py measures it (its functions, not a copy).
- disk: the whole serving checkpoint written, then every server reloads it (DiskTransport), as there.
The LoRA path runs first on every fleet size, while the servers' base is still the trainer's peft model's;
the full paths move the base after it. Every version is checked: each server's prompt logprobs of a probe
must match the trainer's within 1e-3 (train.parity_tolerance), under the adapter for lora, or the benchmark
fails. Prints the medians per shape and path, bytes moved, lora / collective full and lora / disk, and where
a LoRA version's time goes.

    python bench/bench_adapter_sync.py [--shapes 1024x4 2048x4] [--fleets 1 [N ...]] [--rank 8] [--roles 2]
                                       [--rounds 4] [--workdir DIR] [--smoke] [--json PATH]
    The default takes about 2 minutes on 2 cores, most of it starting the two servers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from bench_checkpoint_sync import PROBE, TOLERANCE, parse_shape, weight_files, write_checkpoint
from bench_weight_transport import (
    SERVER_OVERHEAD,
    Plan,
    Policy,
    StepClock,
    Version,
    measure_path,
    wait_for_memory,
)
from results import Figure, parse_args, write_result

from rollstream.cli.vllm_server import VLLM_LORA_RANKS, VllmServer, free_port
from rollstream.shared.inference.adapter_sync import AdapterUpdate, adapter_dir, sync_adapters
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.runtime.sections.train import TrainSettings

PATHS = ("lora", "full", "disk")
LABELS = {"lora": "lora adapter", "full": "collective full", "disk": "disk"}
ROLE_NAMES = ("planner", "solver")
LORA_NUDGE = 0.02
"""Standard deviation of what a step adds to each element of the role's adapter (A and B): enough to move
the probe's logprobs past 10x the parity tolerance, so that a server still serving the old version fails."""


@dataclasses.dataclass
class Row:
    shape: str
    size: int
    """The model's weight bytes."""
    servers: int
    path: str
    versions: list[Version]

    def median(self, field: str) -> float:
        return statistics.median(getattr(version, field) for version in self.versions)

    def median_sync(self) -> float:
        """After the write: the servers' load or push and the parity probe."""
        return statistics.median(version.seconds - version.write_s for version in self.versions)

    def phase_medians(self) -> dict[str, float]:
        names = dict.fromkeys(name for version in self.versions for name in version.phases)
        return {name: statistics.median(v.phases.get(name, 0.0) for v in self.versions) for name in names}


# ------------------------------------------------------------------------------------------- the trainer
class AdapterTrainer:
    """The trainer's peft model: the start checkpoint (the servers' base) with one LoRA adapter per role; a
    step moves one role's adapter, whose probe logprobs the servers must then serve under its name."""

    def __init__(self, checkpoint: Path, roles: Sequence[str], rank: int, run_dir: Path,
                 seed: int = 2) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TrainSettings().lora_target_modules)
        self.model = get_peft_model(base, config, adapter_name=roles[0])
        for role in roles[1:]:
            self.model.add_adapter(role, config)
        self.model.eval()
        self.roles = tuple(roles)
        self.run_dir = run_dir
        self.generator = torch.Generator().manual_seed(seed)
        self.versions = dict.fromkeys(roles, -1)
        self.current: dict[str, AdapterUpdate] = {}
        """Each role's newest written version: what every server must serve."""

    def probe_logprobs(self, role: str) -> tuple[float, ...]:
        import torch

        self.model.set_adapter(role)
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([PROBE])).logits[0, :-1]
            expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(PROBE[1:])[:, None])
        return tuple(expected.squeeze(-1).tolist())

    def step(self, role: str) -> tuple[float, ...]:
        """Move every element of the role's adapter; its new probe logprobs. RuntimeError when the probe
        cannot tell the new version from the one before."""
        import torch

        before = self.probe_logprobs(role)
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                if "lora_" in name and f".{role}." in name:
                    parameter.add_(torch.randn(parameter.shape, generator=self.generator) * LORA_NUDGE)
        after = self.probe_logprobs(role)
        if max(abs(a - b) for a, b in zip(before, after, strict=True)) < 10 * TOLERANCE:
            raise RuntimeError(f"a step of {role!r}'s adapter leaves the probe's logprobs within "
                               f"{10 * TOLERANCE:g}: no parity check would tell its versions apart")
        return after

    def write(self, role: str, expected: tuple[float, ...]) -> AdapterUpdate:
        """The role's adapter written with save_pretrained to the directory of its next version (into a
        temporary directory renamed into place, so that no server reads half an adapter)."""
        self.versions[role] += 1
        directory = adapter_dir(self.run_dir, role, self.versions[role])
        saving = directory.with_name(directory.name + ".tmp")
        self.model.save_pretrained(saving, selected_adapters=[role])
        os.replace(saving / role, directory)  # peft writes an adapter not named "default" into a subfolder
        shutil.rmtree(saving)  # and a model card beside it
        self.current[role] = AdapterUpdate(role, self.versions[role], directory, tuple(PROBE), expected)
        return self.current[role]


# ------------------------------------------------------------------------------------------ measuring
async def sync_lora_version(fleet: FleetClient, clock: StepClock, trainer: AdapterTrainer,
                            moved: Sequence[str], urls: list[str]) -> Version:
    """`moved` roles stepped (untimed), then written and synced to `urls`, checked for parity."""
    expected = {role: trainer.step(role) for role in moved}
    started = time.perf_counter()
    for role in moved:
        trainer.write(role, expected[role])
    write_s = time.perf_counter() - started
    sync_started = time.perf_counter()
    report = await sync_adapters(fleet, urls, list(trainer.current.values()))
    ended = time.perf_counter()
    last_load = max((end for _, end in clock.spans.values()), default=sync_started)
    steps = clock.take(sync_started)
    loads = [seconds for step, seconds in steps.items() if step.startswith("load adapter")]
    phases = {"write": write_s, "models query": steps["prepare"], "load adapter": sum(loads),
              "probe": ended - last_load}
    worst = lora_checked(report, urls, moved)
    sync_s = ended - sync_started
    return Version(ended - started, write_s, sync_s, report.bytes_sent, 0.0, None, worst, phases)


def lora_checked(report, urls: list[str], moved: Sequence[str]) -> float:
    """The worst parity gap of the version's servers; RuntimeError when one failed, loaded other adapters
    than the ones moved, or is off parity."""
    failed = {url: str(failure) for url, failure in report.failures.items()}
    if failed or sorted(report.serving) != sorted(urls):
        raise RuntimeError(f"adapters {list(moved)}: servers left out of the sync: {failed}")
    loaded = {url: sorted(report.loaded.get(url, [])) for url in urls}
    if any(roles != sorted(moved) for roles in loaded.values()):
        raise RuntimeError(f"adapters {list(moved)} moved, the servers loaded {loaded}")
    worst = max(report.diffs.values())
    if worst > TOLERANCE:
        raise RuntimeError(f"adapters {list(moved)}: a server serves other logprobs than the trainer's "
                           f"after the sync: {worst:.2e} > {TOLERANCE:g}")
    return worst


async def measure_lora(trainer: AdapterTrainer, urls: list[str], rounds: int) -> list[Version]:
    """`rounds` versions, each of one role's adapter (the roles take turns), after an untimed one that moves
    and loads every role's."""
    versions = []
    async with FleetClient(urls) as fleet:
        clock = StepClock(fleet)
        await sync_lora_version(fleet, clock, trainer, trainer.roles, urls)
        for index in range(rounds):
            role = trainer.roles[index % len(trainer.roles)]
            versions.append(await sync_lora_version(fleet, clock, trainer, [role], urls))
    return versions


# ---------------------------------------------------------------------------------------- the servers
def lora_arguments(rank: int, roles: int) -> list[str]:
    """vLLM's arguments of a server holding `roles` adapters of `rank` at once (as cli/vllm_server.py's
    lora_arguments gives a LoRA run's), none loaded at the start."""
    served_rank = min(r for r in VLLM_LORA_RANKS if r >= rank)
    return ["--enable-lora", "--max-lora-rank", str(served_rank), "--max-loras", str(roles)]


@contextlib.contextmanager
def lora_servers(checkpoint: Path, count: int, size: int, extra_args: list[str],
                 logs: Path) -> Iterator[list[str]]:
    """`count` LoRA-enabled servers of `checkpoint`, started one after another (untimed), all stopped at
    the end."""
    with contextlib.ExitStack() as stack:
        urls = []
        for index in range(count):
            wait_for_memory(SERVER_OVERHEAD + 3 * size)  # its model, a host copy, the buckets
            server = stack.enter_context(VllmServer(checkpoint, free_port(), extra_args=extra_args,
                                                    log_path=logs / f"vllm-{checkpoint.name}-{index}.log"))
            waited = server.wait_healthy(timeout_s=600)
            print(f"  server {index + 1}/{count} healthy after {waited:.0f} s ({server.url}, cores "
                  f"{server.cores}, load {os.getloadavg()[0]:.1f})", flush=True)
            urls.append(server.url)
        yield urls


# -------------------------------------------------------------------------------------------- a shape
def measure_shape(args: argparse.Namespace, shape: tuple[int, int], plan: Plan) -> list[Row]:
    """Every fleet size and path of one shape on LoRA-enabled servers of it: the adapters first, while the
    servers' base is the trainer's, then the full model by each transport."""
    name = f"{shape[0]}x{shape[1]}"
    start, _ = write_checkpoint(args.model, shape, 0, plan.workdir / f"{name}-start")
    size = sum(path.stat().st_size for path in weight_files(start))
    roles = [*ROLE_NAMES, *(f"role{i}" for i in range(len(ROLE_NAMES) + 1, args.roles + 1))][:args.roles]
    trainer = AdapterTrainer(start, roles, args.rank, plan.workdir / f"{name}-run")
    policy = Policy(start, args.model)
    print(f"{name}: {size / 2**20:.1f} MiB, fleets {args.fleets}, adapters {roles} of rank {args.rank}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    with lora_servers(start, max(args.fleets), size, lora_arguments(args.rank, args.roles),
                      plan.workdir) as urls:
        for count in args.fleets:
            rows.append(Row(name, size, count, "lora", asyncio.run(measure_lora(trainer, urls[:count],
                                                                                  plan.rounds))))
            report_progress(rows[-1])
        for count in args.fleets:
            for path in PATHS[1:]:
                versions = asyncio.run(measure_path(path, plan.bucket_mbs[0], urls[:count], policy, plan))
                rows.append(Row(name, size, count, path, versions))
                report_progress(rows[-1])
    shutil.rmtree(start)
    return rows


def report_progress(row: Row) -> None:
    print(f"  {row.servers} server(s), {LABELS[row.path]}: {row.median('seconds'):.3f} s per version, "
          f"{row.median('bytes_moved') / 2**20:.2f} MiB moved (load {os.getloadavg()[0]:.1f})", flush=True)


# ---------------------------------------------------------------------------------------- the report
def baselines(rows: list[Row]) -> dict[tuple[str, int, str], Row]:
    return {(row.shape, row.servers, row.path): row for row in rows}


def table(rows: list[Row], rounds: int) -> str:
    by = baselines(rows)
    lines = [f"per version, medians of {rounds} rounds; write: the adapter's or the checkpoint's; sync: "
             "the servers' load or push and the parity probe; vs full, vs disk: the path's seconds / theirs, "
             "same shape and fleet",
             f"{'shape':<8}{'MiB':>7}{'srv':>4}  {'path':<17}{'s':>8}{'write s':>9}{'sync s':>8}"
             f"{'MiB moved':>11}{'parity':>9}{'vs full':>9}{'vs disk':>9}"]
    for row in rows:
        full, disk = (by[(row.shape, row.servers, path)].median("seconds") for path in ("full", "disk"))
        lines.append(f"{row.shape:<8}{row.size / 2**20:>7.1f}{row.servers:>4}  {LABELS[row.path]:<17}"
                     f"{row.median('seconds'):>8.3f}{row.median('write_s'):>9.3f}{row.median_sync():>8.3f}"
                     f"{row.median('bytes_moved') / 2**20:>11.2f}"
                     f"{max(v.worst_diff for v in row.versions):>9.1e}"
                     f"{row.median('seconds') / full:>9.3f}{row.median('seconds') / disk:>9.3f}")
    return "\n".join(lines)


def where_time_goes(rows: list[Row]) -> str:
    lines = ["where a LoRA version's time goes (medians, s): write: save_pretrained of the moved adapter; "
             "models query: each server's /v1/models (which adapters at which version it serves); load "
             "adapter: from the first server's request to the last one's answer; probe: the parity check "
             "under the adapter's name"]
    for row in rows:
        if row.path == "lora":
            phases = ", ".join(f"{name} {seconds:.3f}" for name, seconds in row.phase_medians().items())
            lines.append(f"{row.shape} {row.servers} srv: {phases}")
    return "\n".join(lines)


def figures(rows: list[Row], rank: int, roles: int) -> list[Figure]:
    """The adapter against each full path, in seconds and bytes, the largest shape and fleet first."""
    by = baselines(rows)
    baseline_what = {"full": "collective full of the whole model (delta off), same servers",
                     "disk": "disk: the whole checkpoint written + every server's reload, same servers"}
    out = []
    for row in sorted(rows, key=lambda row: (-row.size, -row.servers)):
        if row.path != "lora":
            continue
        where = (f"rank {rank} adapter, one of {roles} live, {row.size / 2**20:.1f} MiB model ({row.shape}), "
                 f"{row.servers} server(s)")
        for path in ("full", "disk"):
            base = by[(row.shape, row.servers, path)]
            out.append(Figure.repeated(f"{where}: s per version (write + sync)",
                                       [v.seconds for v in row.versions], baseline_what[path],
                                       [v.seconds for v in base.versions], "s"))
        full = by[(row.shape, row.servers, "full")]
        out.append(Figure(f"{where}: MiB moved per version", row.median("bytes_moved") / 2**20,
                          "collective full: the whole model", full.median("bytes_moved") / 2**20, "MiB"))
    return out


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/tiny-llama"),
                        help="tokenizer and architecture of the shapes")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[(1024, 4), (2048, 4)],
                        help="HIDDENxLAYERS of each model size")
    parser.add_argument("--fleets", type=int, nargs="+", default=[1], help="servers synced at once")
    parser.add_argument("--rank", type=int, default=8, help="the adapters' LoRA rank (train.lora_rank)")
    parser.add_argument("--roles", type=int, default=2, help="adapters live at once; a version moves one")
    parser.add_argument("--rounds", type=int, default=4, help="timed versions per path and fleet")
    parser.add_argument("--workdir", type=Path, default=None, help="checkpoints, adapters and server logs")
    args = parse_args(parser, smoke={"shapes": [(128, 2)], "fleets": [1], "rounds": 1})
    if args.rounds < 1 or min(args.fleets) < 1 or args.roles < 1:
        parser.error("--rounds, --fleets and --roles must be at least 1")
    if not 1 <= args.rank <= max(VLLM_LORA_RANKS):
        parser.error(f"--rank {args.rank}: vLLM serves adapters of rank 1 to {max(VLLM_LORA_RANKS)}")
    return args


def main() -> None:
    from transformers.utils import logging as hf_logging

    args = arguments()
    hf_logging.disable_progress_bar()
    load_before = os.getloadavg()[0]
    rows: list[Row] = []
    bucket_mb = TrainSettings().sync_bucket_mb
    with tempfile.TemporaryDirectory(prefix="rs-bench-adapter-", dir=args.workdir) as tmp:
        plan = Plan(args.rounds, 0.0, [bucket_mb], Path(tmp), iter(range(1, 10**9)))
        for shape in args.shapes:
            rows += measure_shape(args, shape, plan)
    load_after = os.getloadavg()[0]
    report = [table(rows, args.rounds), where_time_goes(rows)]
    print("\n" + "\n\n".join(report))
    print(f"\nload average {load_before:.1f} at the start, {load_after:.1f} at the end")
    write_result(args.json, figures(rows, args.rank, args.roles), [
        f"real vLLM CPU servers (float32) with LoRA enabled, {args.roles} adapter(s) of rank {args.rank} "
        f"(alpha {2 * args.rank}) live, one moved per version; adapters written with save_pretrained and "
        f"loaded in place; collective over gloo on 127.0.0.1, buckets of {bucket_mb} MiB, delta off; disk: "
        "the checkpoint read from the page cache; one untimed version per path first; parity within "
        f"{TOLERANCE:g} checked on every server every version; load average {load_before:.1f} at the start, "
        f"{load_after:.1f} at the end", *report])


if __name__ == "__main__":
    main()
