"""Event ids that need no system call each: 64 random bits drawn once per process (again in a forked child,
which would otherwise repeat its parent's ids), then a counter. 32 hex digits, as 128 random bits would be;
two processes share ids only if they drew the same 64 bits, and a publisher of many small events pays a
fraction of what os.urandom costs every time."""

from __future__ import annotations

import itertools
import os

_prefix = ""
_counter = itertools.count()


def _draw_prefix() -> None:
    global _prefix, _counter
    _prefix, _counter = os.urandom(8).hex(), itertools.count()


_draw_prefix()
os.register_at_fork(after_in_child=_draw_prefix)


def new_event_id() -> str:
    return f"{_prefix}{next(_counter):016x}"
