"""rollstream's command line.

    rollstream run                 # the local run: Redis, vLLM, every service; trains; summary
    rollstream build-model         # the tiny Llama + tokenizer the local run and the tests use
    rollstream warmup              # supervised warm-up on gold calculator episodes: a start for RL
    rollstream serve-vllm          # a vLLM CPU server for the tiny model
    rollstream serve-policy        # becomes a vLLM server of the run's newest published policy (Compose)
    rollstream validate TASKS      # reference solutions grade 1, empty diffs 0, in the sandbox
    rollstream environments prepare ROWS  # build SWE rows' test environments ahead (cli/environments.py)
    rollstream config [--markdown] # the resolved configuration, or its reference table
    rollstream replay RUN --to NEW # a recorded run re-published into a fresh run (cli/replay/command.py)
    rollstream inspect ...         # runs, streams and consumer groups, one trajectory, diff of two runs
    rollstream chaos poison        # a local run fuzzed with poison entries on every stream; what it kept
    rollstream chaos run           # a local run under kills and restarts of every part; what it kept
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from rollstream.cli.environments import environments_app
from rollstream.cli.inspect.app import inspect_app
from rollstream.cli.replay.command import replay

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Fully asynchronous RL for LLM agents.")
app.command("replay")(replay)
app.add_typer(inspect_app, name="inspect",
              help="Look at runs: streams and consumer groups, one trajectory, a diff of two runs.")
app.add_typer(environments_app, name="environments",
              help="SWE rows' test environments: `prepare` builds them ahead of a run.")
CHAOS_HELP = "Fault injection against a local run, and what the run kept."
chaos_app = typer.Typer(no_args_is_help=True, help=CHAOS_HELP)
app.add_typer(chaos_app, name="chaos", help=CHAOS_HELP)
console = Console()
BASE_MODEL = Path("models/tiny-llama")
WARM_MODEL = Path("models/tiny-llama-warm")
RunId = Annotated[str | None, typer.Option(help="Run namespace; default: a new time-stamped one.")]
FleetUrls = Annotated[list[str] | None,
                      typer.Option(help="Use running vLLM servers instead of starting one.")]


@app.command("build-model")
def build_model(
    out: Annotated[Path, typer.Option(help="Where to write the model.")] = Path("models/tiny-llama"),
    seed: Annotated[int, typer.Option(help="Initialisation seed.")] = 0,
    max_positions: Annotated[int, typer.Option(min=16, help="Context length (RoPE positions); above 1024 for "
                                               "coding agents' long prompts.")] = 1024,
) -> None:
    """Build the tiny Llama (untied embeddings, head_dim 64) with its own BPE tokenizer, offline."""
    from rollstream.cli.model.tiny_model import build_tiny_model

    path = build_tiny_model(out, seed=seed, max_positions=max_positions)
    console.print(f"tiny model written to [bold]{path}[/]")


@app.command("warmup")
def warmup_model(
    model: Annotated[Path, typer.Option(help="Model to start from.")] = BASE_MODEL,
    out: Annotated[Path, typer.Option(
        help="Where to write the warmed-up checkpoint (replaced if present).")] = WARM_MODEL,
    steps: Annotated[int, typer.Option(
        help="Optimizer steps; with --target-exact, the most it trains.")] = 1500,
    target_exact: Annotated[float | None, typer.Option(
        help="Stop at the first check (every 50 steps) whose exact-match rate reaches this; 0 or less: train "
             "all --steps.")] = 0.25,
    batch_size: Annotated[int, typer.Option(help="Gold episodes per step.")] = 32,
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = 1e-3,
    seed: Annotated[int, typer.Option(help="Seed of the training episodes.")] = 0,
    eval_prompts: Annotated[int, typer.Option(
        help="Held-out episodes to evaluate the result on; 0: none.")] = 128,
    temperature: Annotated[float, typer.Option(help="Sampling temperature of the evaluation.")] = 1.0,
) -> None:
    """Supervised warm-up on gold calculator episodes: a partly trained start for RL."""
    from rollstream.cli.model.warmup import evaluate, warmup

    target = target_exact if target_exact and target_exact > 0 else None
    stats = warmup(model, out, steps, batch_size=batch_size, lr=lr, seed=seed, target_exact=target)
    console.print(f"{stats['steps']} steps of {stats['batch_size']} episodes in {stats['seconds']:.1f}s: "
                  f"loss {stats['first_loss']:.3f} -> {stats['final_loss']:.3f}; "
                  f"checkpoint in [bold]{out}[/]")
    if target is not None:
        trail = ", ".join(f"{c['step']}: {c['exact']:.0%}" for c in stats["checks"])
        verdict = "reached" if stats["reached"] else "[bold red]not reached[/]"
        console.print(f"target exact {target:.0%} {verdict}; checks (step: exact) {trail}")
    if eval_prompts > 0:
        result = evaluate(out, eval_prompts, temperature=temperature)
        table = Table(title=f"{out}: {result['prompts']} held-out episodes, "
                            f"temperature {result['temperature']:g}")
        for column in ("exact", "mean reward", "right tool call", "completed", "longest turn", "seconds"):
            table.add_column(column, justify="right")
        table.add_row(f"{result['exact']:.1%}", f"{result['mean_reward']:.3f}",
                      f"{result['correct_tool_call']:.1%}", f"{result['completed']:.1%}",
                      f"{result['longest_turn_tokens']}/{result['max_tokens_per_turn']}",
                      f"{result['seconds']:.1f}")
        console.print(table)
    if target is not None and not stats["reached"]:
        raise typer.Exit(1)


@app.command("serve-vllm", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve_vllm(
    ctx: typer.Context,
    model: Annotated[Path, typer.Option(help="HF model directory.")] = Path("models/tiny-llama"),
    port: Annotated[int, typer.Option(help="Port to serve on.")] = 8000,
    served_name: Annotated[str, typer.Option(help="Model name in the API.")] = "tiny",
    group: Annotated[str | None, typer.Option(
        help="Serve this server group of the run's settings (fleet.groups: its model, name, context length "
             "and vLLM arguments; a policy group's serves the starting model) instead of --model and "
             "--served-name.")] = None,
) -> None:
    """Serve a model with vLLM on the CPU until Ctrl-C (dev endpoints on, for weight sync). Further
    arguments go to vLLM."""
    from rollstream.cli.child_processes import interrupt_on_stop_signals
    from rollstream.cli.vllm_server import VllmServer

    if group is None:
        server = VllmServer(model, port, served_model_name=served_name, extra_args=ctx.args)
    else:
        from rollstream.shared.runtime.config import Settings

        settings = Settings()
        if group not in settings.fleet.groups:
            known = ", ".join(sorted(settings.fleet.groups)) or "none"
            console.print(f"[bold red]no server group {escape(group)!r} in fleet.groups[/] "
                          f"(the groups: {escape(known)})", markup=True)
            raise typer.Exit(2)
        try:
            server = VllmServer.for_group(settings, group, port, extra_args=ctx.args)
        except ValueError as exc:
            console.print(f"[bold red]{escape(str(exc))}[/]", markup=True)
            raise typer.Exit(2) from None
    # Ctrl-C, `kill`, a closed terminal or Ctrl-\\ stop vLLM, while it starts too; a second one SIGKILLs it
    interrupt_on_stop_signals(force=server.kill)
    try:
        with server:
            started = time.monotonic()
            server.wait_healthy()
            console.print(f"vLLM healthy at {server.url} after {time.monotonic() - started:.0f}s; "
                          "Ctrl-C stops it")
            while True:
                time.sleep(1)
    except KeyboardInterrupt:
        console.print("vLLM stopped")


@app.command("serve-policy", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve_policy(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(help="Port to serve on (the host is RS_LISTEN_HOST).")] = 8000,
    group: Annotated[str | None, typer.Option(
        help="A server of this policy group (fleet.groups: its context length and vLLM arguments).")] = None,
) -> None:
    """Become a vLLM server of the run's newest published policy (RS_RUN_ID; the starting model RS_MODEL__PATH
    before the first version): what a supervisor that restarts servers runs (Compose), so that a restarted
    server loads the version the fleet is said to serve before its /health answers. Further arguments go to
    vLLM."""
    from rollstream.cli.vllm_server import VllmStartError, exec_newest_policy
    from rollstream.shared.runtime.config import Settings

    settings = Settings()
    if group is not None and not (group in settings.fleet.groups and settings.fleet.groups[group].policy):
        console.print(f"[bold red]no policy group {escape(group)!r} in fleet.groups[/]", markup=True)
        raise typer.Exit(2)
    try:
        exec_newest_policy(settings, port, ctx.args, group)
    except VllmStartError as exc:
        console.print(f"[bold red]serve-policy failed:[/] {escape(str(exc))}", markup=True, soft_wrap=True)
        raise typer.Exit(1) from None


@app.command("validate")
def validate(
    tasks: Annotated[Path, typer.Argument(
        help="A Harbor task directory, a directory of them, or a SWE-bench .jsonl/.parquet.")],
    backend: Annotated[str, typer.Option(help="Sandbox backend: bubblewrap or docker.")] = "bubblewrap",
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON, one object a task.")
                       ] = False,
) -> None:
    """Check a task set: each task's reference solution must grade 1 and an empty diff 0. A task that fails
    is explained: environment broken, tests wrong, solution failed or empty diff passes, with what to do and
    the tail of its grading log."""
    from rollstream.cli.validation_report import print_report, report_json
    from rollstream.shared.errors import SandboxError, TaskError
    from rollstream.shared.grading.validation import validate_tasks
    from rollstream.shared.sandbox.backends import get_backend
    from rollstream.shared.tasks.harbor import load_harbor_tasks
    from rollstream.shared.tasks.swebench import load_swebench_rows

    try:
        loaded = load_harbor_tasks(tasks) if tasks.is_dir() else load_swebench_rows(tasks)
    except TaskError as exc:
        # escaped: the messages name TOML sections ("[verifier] timeout_sec ..."), not markup
        console.print(f"[bold red]invalid task set:[/] {escape(str(exc))}")
        raise typer.Exit(1) from None
    try:
        sandbox = get_backend(backend)
    except (SandboxError, ValueError) as exc:
        console.print(f"[bold red]no sandbox:[/] {escape(str(exc))}")
        raise typer.Exit(1) from None
    results = validate_tasks(loaded, sandbox)
    if as_json:
        # plain print: rich would wrap the lines and colour the JSON
        print(report_json(results))
    else:
        print_report(console, results, f"{len(results)} tasks, {backend} sandbox")
    if not all(r.ok for r in results):
        raise typer.Exit(1)


@app.command("config")
def show_config(
    markdown: Annotated[bool, typer.Option(help="Print the reference table instead.")] = False,
) -> None:
    """Print the resolved configuration (environment RS_*, RS_CONFIG_FILE, defaults)."""
    from rollstream.shared.runtime.config import Settings, reference_markdown

    # plain print: rich would wrap long table rows
    print(reference_markdown() if markdown else Settings().model_dump_json(indent=2))


def make_warm_model() -> None:
    """The main job's starting point: the tiny model after a short supervised warm-up, partly trained,
    so that RL has room to show that it learns."""
    from rollstream.cli.model.warmup import warmup

    if not (BASE_MODEL / "config.json").exists():
        console.print(f"building the tiny model into {BASE_MODEL}")
        build_model(BASE_MODEL, 0)
    console.print(f"warming up {BASE_MODEL} into {WARM_MODEL} (supervised, about a minute)")
    stats = warmup(BASE_MODEL, WARM_MODEL, 1500, target_exact=0.25)
    console.print(f"warm-up: {stats['steps']} steps, exact {stats['checks'][-1]['exact']:.0%} "
                  "on held-out checks")


def with_train(settings, **train):
    """The settings with these fields of their `train` section replaced."""
    return settings.model_copy(update={"train": settings.train.model_copy(update=train)})


def ensure_model(path: Path) -> None:
    """The default model is made when missing (build, then warm-up); another missing model is an error."""
    if path.exists():
        return
    if path != WARM_MODEL:
        console.print(f"[bold red]no model at {path}[/] (model.path)", markup=True)
        raise typer.Exit(2)
    make_warm_model()


@app.command("run")
def run(
    versions: Annotated[int | None, typer.Option(
        help="Policy versions to train (train.total_versions).")] = None,
    run_id: RunId = None,
    fleet_url: FleetUrls = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 1800.0,
    example: Annotated[str | None, typer.Option(
        help="Run an example instead of the calculator task (cli/examples.py): relay (a planner and a "
             "solver, two LoRA adapters trained together).")] = None,
) -> None:
    """Train locally: embedded Redis (unless RS_REDIS_URL), vLLM on the CPU, every service as a process.

    Ctrl-C, `kill`, a closed terminal (SIGHUP) and Ctrl-\\ (SIGQUIT) stop every process the run started; a
    second one while it stops SIGKILLs them all."""
    from rollstream.cli.child_processes import interrupt_on_stop_signals
    from rollstream.cli.local_run import LocalRun, RunExists, ServiceDied
    from rollstream.shared.errors import DatasetError, SandboxError
    from rollstream.shared.runtime.config import Settings

    run_id = run_id or time.strftime("run-%Y%m%d-%H%M%S")
    if example is None:
        settings = Settings(run_id=run_id)
    else:
        from rollstream.cli.examples import example_settings

        try:
            settings = example_settings(example, run_id)
        except ValueError as exc:
            console.print(f"[bold red]{escape(str(exc))}[/]", markup=True)
            raise typer.Exit(2) from None
    if versions is not None:
        settings = with_train(settings, total_versions=versions)
    local = LocalRun(settings, fleet_urls=fleet_url)
    interrupt_on_stop_signals(force=local.force_stop)
    ensure_model(settings.model.path)
    target = settings.train.total_versions
    progress = None
    try:
        with console.status("starting") as status:
            local.start(on_step=lambda message: status.update(message))
        console.print(f"run [bold]{settings.run_id}[/]: services up, logs in {local.log_dir}")
        if local.console_url:
            token = "#token=<RS_SECURITY__HTTP_TOKEN>" if settings.security.http_token else ""
            console.print(f"console: {local.console_url}{token}", highlight=False)
        with Live(progress_table(None, target), console=console, refresh_per_second=2) as live:
            progress = local.wait_for_version(target, timeout,
                                              on_progress=lambda p: live.update(progress_table(p, target)))
    except KeyboardInterrupt:
        console.print("interrupted: stopping every service")
    except (SandboxError, DatasetError, RunExists, ServiceDied, TimeoutError) as exc:
        # escaped: messages name TOML sections ("[verifier] ...") and quote logs, not markup
        console.print(f"[bold red]run failed:[/] {escape(str(exc))}", markup=True)
        raise typer.Exit(1) from None
    finally:
        codes = local.stop()  # whatever of the run started: Redis, vLLM, server groups, services
        if local.forced:
            console.print("stop forced by a further signal: every process the run started was killed")
    if progress is None:
        raise typer.Exit(130)
    report_run(local, progress, codes)


def report_run(local, progress, codes: dict[str, int | None]) -> None:
    """Write the run's summary (summary.json) and print it, with a warning for what went wrong on the way."""
    from rollstream.cli.run_progress import write_summary

    summary = local.summary(progress)
    summary["exit_codes"] = codes
    path = write_summary(local.run_dir, summary)
    console.print()
    console.print(summary_table(summary))
    if summary["grading_failed"]:
        console.print(f"[bold yellow]warning:[/] {summary['grading_failed']} rollouts could not be graded "
                      "(the sandbox did not run them); they got no reward and were left out of their "
                      f"batches: see the sandbox-grader log in {local.log_dir}", markup=True)
    if summary["restarts"]:
        console.print(f"[bold yellow]warning:[/] processes crashed and were restarted: "
                      f"{restarts_text(summary['restarts'])}; see their logs in {local.log_dir}", markup=True)
    console.print(f"run files: {local.run_dir} (summary: {path})")


@chaos_app.command("poison")
def chaos_poison(
    seed: Annotated[int, typer.Option(help="Seed of the poison entries (same seed, same entries).")] = 0,
    rate: Annotated[float, typer.Option(
        help="Poison entries written per second while the run trains.")] = 4.0,
    versions: Annotated[int, typer.Option(help="Policy versions the run trains (train.total_versions).")] = 3,
    batch_size: Annotated[int | None, typer.Option(
        help="Samples per batch (train.batch_size); default: one group.")] = None,
    per_kind: Annotated[int, typer.Option(help="Entries of each kind on each stream.")] = 1,
    kinds: Annotated[str | None, typer.Option(
        help="Comma-separated kinds (default: all but orphan_finish, which stalls the run; see "
             "cli/chaos/poison.py).")] = None,
    huge_tokens: Annotated[int, typer.Option(help="Tokens of the huge segment.")] = 1_000_000,
    oversized_mb: Annotated[float, typer.Option(help="Size of an oversized body, MB.")] = 2.0,
    run_id: RunId = None,
    fleet_url: FleetUrls = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 1800.0,
) -> None:
    """A local run fuzzed with poison entries on every stream while it trains; what it kept.

    Malformed, truncated, mutated, random, oversized, misplaced and forged entries (cli/chaos/poison.py).
    Prints per stream what was tried and dead-lettered, and the checks: healthy services, the target
    version, every admitted sample in exactly one batch, no forged sample trained. Exit 1 when one fails.
    """
    from rollstream.cli.chaos.poison import run_poison
    from rollstream.cli.chaos.poison_inject import PoisonError
    from rollstream.cli.chaos.poison_report import checks, report_tables
    from rollstream.cli.child_processes import interrupt_on_stop_signals
    from rollstream.cli.local_run import RunExists, ServiceDied
    from rollstream.shared.errors import DatasetError, SandboxError
    from rollstream.shared.runtime.config import Settings

    settings = Settings(run_id=run_id or time.strftime("poison-%Y%m%d-%H%M%S"))
    settings = with_train(settings, total_versions=versions,
                          batch_size=batch_size or settings.data.samples_per_prompt)
    interrupt_on_stop_signals()  # the local run's stop forces itself on a further signal
    ensure_model(settings.model.path)
    try:
        with console.status("starting") as status:
            report, codes, local = run_poison(
                settings, seed=seed, rate=rate, timeout_s=timeout, per_kind=per_kind,
                kinds=kinds.split(",") if kinds else None, oversized_bytes=int(oversized_mb * 2**20),
                huge_tokens=huge_tokens, fleet_urls=fleet_url,
                on_progress=lambda message: status.update(escape(message)))
    except KeyboardInterrupt:
        console.print("interrupted: every service stopped")
        raise typer.Exit(130) from None
    except (SandboxError, DatasetError, RunExists, ServiceDied, TimeoutError, PoisonError,
            ValueError) as exc:
        console.print(f"[bold red]poison run failed:[/] {escape(str(exc))}", markup=True)
        raise typer.Exit(1) from None
    for table in report_tables(report):
        console.print(table)
    for seen in report.unexpected_exits:
        console.print(f"[bold red]process exit:[/] {escape(seen.describe())}", markup=True)
    stopped = ", ".join(f"{name} {code}" for name, code in sorted(codes.items()))
    console.print(f"run {settings.run_id}: services stopped (exit codes: {stopped}); logs in {local.log_dir}")
    if not all(passed for _, passed, _ in checks(report)):
        raise typer.Exit(1)


@chaos_app.command("run")
def chaos_run(
    seed: Annotated[int, typer.Option(help="Seed of the fault order (same seed, same order).")] = 0,
    kills: Annotated[int, typer.Option(
        help="SIGKILLs of each service process and of sandbox work-horses.")] = 1,
    redis_restarts: Annotated[int, typer.Option(help="Kills and restarts of Redis (append-only).")] = 1,
    vllm_restarts: Annotated[int, typer.Option(help="Restarts of the vLLM server.")] = 1,
    pauses: Annotated[int, typer.Option(help="SIGSTOPs of an agent-runner past the reclaim timeout.")] = 1,
    interval: Annotated[float, typer.Option(help="Seconds between two faults.")] = 4.0,
    versions: Annotated[int, typer.Option(
        help="Policy versions the run trains (train.total_versions).")] = 20,
    run_id: RunId = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 7200.0,
) -> None:
    """A local run under fault injection (cli/chaos/harness.py), then the audit of what it kept.

    Exit 1 when the audit finds a sample lost or duplicated, a batch or version twice, work left pending, more
    drops than the faults explain, or a process that exited without the harness stopping it. With black-box
    agents (RS_AGENT__DEFAULT=command) two gateway replicas run and are killed too, like the agent-runners in
    the middle of episodes, and an agent left running or a gateway session open past its end fails it as well.
    """
    from rollstream.cli.chaos.harness import ChaosPlan, ChaosRun, result_tables
    from rollstream.cli.child_processes import interrupt_on_stop_signals
    from rollstream.cli.local_run import RunExists, ServiceDied
    from rollstream.shared.errors import DatasetError, SandboxError
    from rollstream.shared.runtime.config import Settings

    settings = Settings(run_id=run_id or time.strftime("chaos-%Y%m%d-%H%M%S"))
    settings = with_train(settings, total_versions=versions)
    ensure_model(settings.model.path)
    plan = ChaosPlan(seed=seed, kills_per_service=kills, redis_restarts=redis_restarts,
                     vllm_restarts=vllm_restarts, pauses=pauses, interval_s=interval)
    chaos = ChaosRun(settings, plan, on_event=lambda message: console.print(escape(message)))
    interrupt_on_stop_signals(force=chaos.local.force_stop)
    try:
        result = chaos.run(timeout)
    except KeyboardInterrupt:
        console.print("interrupted: every process the run started is stopped")
        raise typer.Exit(130) from None
    except (SandboxError, DatasetError, RunExists, ServiceDied, TimeoutError) as exc:
        console.print(f"[bold red]chaos run failed:[/] {escape(str(exc))}", markup=True)
        raise typer.Exit(1) from None
    for table in result_tables(result):
        console.print(table)
    problems = result.audit.problems()
    for problem in problems:
        console.print(f"[bold red]audit:[/] {escape(problem)}", markup=True)
    console.print(f"run {settings.run_id}: logs in {result.summary['run_dir']}/logs")
    if problems:
        raise typer.Exit(1)


def progress_table(progress, target: int) -> Table:
    table = Table(title="rollstream: local run", show_header=True)
    for column in ("admitted", "finished", "graded", "grading failed", "batches", "policy version",
                   "last batch reward", "dead letters", "restarts"):
        table.add_column(column, justify="right")
    if progress is None:
        table.add_row("-", "-", "-", "-", "-", f"0/{target}", "-", "-", "-")
        return table
    reward = f"{progress.batches[-1].mean_reward:.3f}" if progress.batches else "-"
    failed = f"[bold red]{progress.grading_failed}[/]" if progress.grading_failed else "0"
    table.add_row(str(progress.admitted), str(progress.finished),
                  str(progress.graded - progress.grading_failed),
                  failed, str(len(progress.batches)), f"{progress.version}/{target}", reward,
                  str(len(progress.dead_letters)), restarts_text(progress.restarts))
    return table


def restarts_text(restarts: dict[str, int]) -> str:
    """`0`, or the total and who, in yellow: `3 (reward 2, trainer 1)`."""
    if not restarts:
        return "0"
    who = ", ".join(f"{name} {count}" for name, count in sorted(restarts.items()))
    return f"[bold yellow]{sum(restarts.values())}[/] ({who})"


def summary_table(summary: dict) -> Table:
    table = Table(title=f"run {summary['run_id']}: summary")
    table.add_column("version", justify="right")
    table.add_column("batch mean reward", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("parity |dlogp|", justify="right")
    table.add_column("trained", justify="right")
    for row in summary["per_version"]:
        reward = row["batch_mean_reward"]
        table.add_row(str(row["version"]), "-" if reward is None else f"{reward:.3f}", f"{row['loss']:.4f}",
                      f"{row['parity_max_abs_diff']:.1e}", str(row["trained"]))
    rewards = [row["batch_mean_reward"] for row in summary["per_version"]
               if row["batch_mean_reward"] is not None]
    window = max(1, min(5, len(rewards) // 3))
    learning = (f"batch mean reward {sum(rewards[:window]) / window:.3f} (first {window} versions) -> "
                f"{sum(rewards[-window:]) / window:.3f} (last {window}); " if rewards else "")
    table.caption = (learning + f"{summary['samples_admitted']} samples, "
                     f"{summary['trajectories_finished']} trajectories, "
                     f"{summary['grades'] - summary['grading_failed']} sandbox grades, "
                     f"{summary['grading_failed']} gradings that could not run (left out of their batches), "
                     f"{summary['batches']} batches, "
                     f"{summary['dead_letters']} dead letters, "
                     f"{sum(summary.get('restarts', {}).values())} restarts of crashed processes"
                     + (f", vLLM up in {summary['vllm_startup_s']}s"
                        if summary.get("vllm_startup_s") else ""))
    return table


if __name__ == "__main__":
    app()
