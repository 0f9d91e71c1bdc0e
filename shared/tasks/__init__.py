"""What the dispatcher issues: prompt rows (rows.py), datasets (datasets.py), Harbor task directories
(harbor.py), SWE-bench rows (swebench.py), coding tasks as prompt rows (prompts.py), and rule-based
answer scoring (scoring.py).
"""
