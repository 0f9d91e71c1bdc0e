"""Built-in environments whose tools register themselves on import: the calculator (calculator.py) and
the coding tools on a sandboxed git workspace (coding.py).
"""
