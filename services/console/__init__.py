"""The console: one run, live, in a web page (main.py)."""
