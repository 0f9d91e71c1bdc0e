"""The `rollstream inspect` sub-app: each command's options, output and exit code; the work is elsewhere.

    rollstream inspect runs                          # every run in Redis and in storage, entries per stream
    rollstream inspect streams RUN                   # per stream: length, ids, archive position, groups' lag
    rollstream inspect trajectory RUN ROLLOUT [--json]  # one rollout turn by turn, tokens coloured by logprob
    rollstream inspect diff RUN_A RUN_B [--streams S]   # two runs or replays compared event by event

cli/main.py mounts `inspect_app` as `rollstream inspect`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from rollstream.cli.inspect.connections import (
    DEFAULT_REDIS_URL,
    connect,
    default_model,
    default_redis_url,
    default_storage,
    err_console,
)
from rollstream.cli.inspect.diff import MEASURED_FIELDS, diff_runs, render_diff
from rollstream.cli.inspect.runs import collect_runs, runs_table, streams_table
from rollstream.cli.inspect.trajectory import render_rollout
from rollstream.shared.contract.bus import STREAMS
from rollstream.shared.contract.rollout_view import (
    load_decoder,
    load_rollout,
    rollout_document,
    run_default_role,
    run_model_path,
)
from rollstream.shared.contract.run_source import open_run
from rollstream.shared.contract.stream_state import collect_streams
from rollstream.shared.errors import RunDataNotFound

inspect_app = typer.Typer(add_completion=False, no_args_is_help=True,
                          help="Look into runs: live in Redis, trimmed, or only in their archive.")

PIPED_WIDTH = 250
"""Width of the output when it goes to a file or a pipe (and COLUMNS is unset): tables are not cut."""

RedisUrl = Annotated[str | None, typer.Option("--redis-url", help="Redis of the runs (default: RS_REDIS_URL, "
                                                 f"else {DEFAULT_REDIS_URL}).")]
StorageOpt = Annotated[str | None, typer.Option("--storage", help="Run storage holding the archives "
                                                   "(default: RS_STORAGE_URI, else runs).")]


def out_console() -> Console:
    """The commands' console: the terminal's width, or wide when piped so that ids are not cut."""
    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=PIPED_WIDTH)
    return console


def _fail(message: str, code: int = 1) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


@inspect_app.command("runs")
def runs_command(redis_url: RedisUrl = None, storage: StorageOpt = None) -> None:
    """List runs in Redis and in storage: where each is, entries per stream, latest policy version."""
    storage = storage or default_storage()
    client = connect(redis_url or default_redis_url())
    out_console().print(runs_table(collect_runs(client, storage), storage))


@inspect_app.command("streams")
def streams_command(run: Annotated[str, typer.Argument(help="Run id.")], redis_url: RedisUrl = None,
                    storage: StorageOpt = None) -> None:
    """Per stream of a run: length, entries added, ids, archive position, groups' lag and pending.

    Lag: entries not yet delivered to the group; pending: delivered, not acknowledged. Unknown run: exit 1."""
    storage = storage or default_storage()
    client = connect(redis_url or default_redis_url())
    try:
        source = open_run(client, storage, run)
    except RunDataNotFound as exc:
        _fail(str(exc))
    out_console().print(streams_table(run, collect_streams(source), source.where))


@inspect_app.command("trajectory")
def trajectory_command(
    run: Annotated[str, typer.Argument(help="Run id.")],
    rollout_id: Annotated[str, typer.Argument(help="Rollout id (envelope rollout_id).")],
    model: Annotated[Path | None, typer.Option(help="Model directory whose tokenizer decodes the tokens "
                                                    "(default: the run's config.json model, else "
                                                    "RS_MODEL__PATH).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead.")] = False,
    redis_url: RedisUrl = None,
    storage: StorageOpt = None,
) -> None:
    """One rollout turn by turn, its tokens coloured by logprob, reward and batch.

    The prompt; every turn's context (dim, not sampled) and sampled tokens coloured by logprob, its policy
    versions (a sync mid-turn highlighted; its role's, as "planner v3", when the rollout has several roles)
    and tool calls; each segment's role; the finish, grade, reward and advantage (each role's where they
    differ); the batch that took it and the version it trained. Read from Redis and the archive. Unknown
    rollout: exit 1."""
    storage = storage or default_storage()
    client = connect(redis_url or default_redis_url())
    try:
        view = load_rollout(open_run(client, storage, run), rollout_id)
    except RunDataNotFound as exc:
        _fail(str(exc))
    path = model or run_model_path(storage, run, default_model())
    decoder, why = load_decoder(path)
    if decoder is None:
        err_console.print(f"[yellow]no tokenizer ({path}: {why}): token ids shown[/]", highlight=False)
    doc = rollout_document(view, decoder, run_default_role(storage, run))
    if as_json:
        print(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        out_console().print(render_rollout(doc))


@inspect_app.command("diff")
def diff_command(
    run_a: Annotated[str, typer.Argument(help="Run A.")],
    run_b: Annotated[str, typer.Argument(help="Run B (a replay, or another run).")],
    streams: Annotated[list[str] | None, typer.Option("--streams", help="Streams to compare (repeat, or "
                                                         "comma-separated; default: all).")] = None,
    limit: Annotated[int, typer.Option(help="Events (and batch rows) listed per stream.")] = 10,
    normalize: Annotated[bool, typer.Option(help="Match across runs: run ids, storage roots, attempt ids and "
                                            "batch ids of the same groups are made alike.")] = True,
    exact: Annotated[bool, typer.Option(help="Compare wall-clock measurements too ("
                                        + ", ".join(MEASURED_FIELDS)
                                        + "); by default they are left out.")] = False,
    redis_url: RedisUrl = None,
    storage: StorageOpt = None,
    redis_url_b: Annotated[str | None, typer.Option(help="Redis of run B (default: --redis-url).")] = None,
    storage_b: Annotated[str | None, typer.Option(help="Storage of run B (default: --storage).")] = None,
) -> None:
    """Compare two runs (or a run and its replay) event by event; exit 0 identical, 1 different.

    Events are matched by event id, time and run id ignored; batch files are compared row by row, keyed by
    (rollout id, segment index). Exit 2: a run or stream that is not there."""
    selected: list[str] = []
    for item in streams or list(STREAMS):
        selected.extend(s.strip() for s in item.split(",") if s.strip())
    unknown = [s for s in selected if s not in STREAMS]
    if unknown:
        _fail(f"unknown stream(s) {', '.join(unknown)}; streams are {', '.join(STREAMS)}", 2)
    storage = storage or default_storage()
    url = redis_url or default_redis_url()
    client_a = connect(url)
    client_b = connect(redis_url_b) if redis_url_b and redis_url_b != url else client_a
    try:
        source_a = open_run(client_a, storage, run_a)
        source_b = open_run(client_b, storage_b or storage, run_b)
    except RunDataNotFound as exc:
        _fail(str(exc), 2)
    report = diff_runs(source_a, source_b, list(dict.fromkeys(selected)), normalize=normalize,
                       ignore=() if exact else MEASURED_FIELDS)
    out_console().print(render_diff(report, limit))
    raise typer.Exit(0 if report.identical else 1)
