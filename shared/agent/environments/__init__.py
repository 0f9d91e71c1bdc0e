"""Built-in environments whose tools register themselves on import: the calculator (calculator.py) and
the coding tools (coding.py) on a sandboxed git workspace (coding_workspace.py).
"""
