"""Fault injection against a live run: kills, restarts and poison entries, then an audit of what the run
kept."""
