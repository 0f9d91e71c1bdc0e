"""Agents: the agent loop and its context (loop.py), tools (tools.py), the tool-call formats models write
(tool_calls.py), and the built-in environments (environments/: calculator, coding).
"""
