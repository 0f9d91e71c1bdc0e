"""`rollstream inspect`: look into runs, live in Redis, trimmed, or only in their archive.

One module per command; each reads runs through connections.py, which imports none of the others:

    app.py          the typer sub-app `inspect_app` (cli/main.py mounts it): options, exit codes
    connections.py  Redis, storage and settings; a run's history read and decoded; `InspectError`
    runs.py         `rollstream inspect runs` and `rollstream inspect streams RUN`
    trajectory.py   `rollstream inspect trajectory RUN ROLLOUT`: one rollout turn by turn
    diff.py         `rollstream inspect diff RUN_A RUN_B`: two runs compared event by event

Collecting (`collect_*`, `load_rollout`, `rollout_document`, `diff_runs`) is kept apart from
rendering (`*_table`, `render_*`), which returns rich renderables.
"""
