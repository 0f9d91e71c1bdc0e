"""Grading an agent's diff in a sandbox: applying it (diffs.py), running the task's tests and telling
the sandbox's failures from the tests' (runs.py), reading what untrusted code wrote (untrusted.py),
Harbor and SWE-bench grading (harbor.py, swebench.py), the outcome (outcome.py) and task validation
(validation.py).
"""
