"""`rollstream inspect`: look into runs, live in Redis, trimmed, or only in their archive.

One module per command; each reads runs through the library (shared/contract/run_source.py, stream_state.py,
rollout_view.py: what the console reads too) and connections.py, which imports none of the others:

    app.py          the typer sub-app `inspect_app` (cli/main.py mounts it): options, exit codes
    connections.py  which Redis, storage and model to read, from the options or the settings
    runs.py         `rollstream inspect runs` and `rollstream inspect streams RUN`
    trajectory.py   `rollstream inspect trajectory RUN ROLLOUT`: one rollout turn by turn
    diff.py         `rollstream inspect diff RUN_A RUN_B`: two runs compared event by event

Collecting (`collect_*`, `load_rollout`, `rollout_document`, `diff_runs`) is kept apart from
rendering (`*_table`, `render_*`), which returns rich renderables.
"""
