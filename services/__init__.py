"""One package per service; each has a console script and a main.py that reads top to bottom. No service
imports another (tests/unit/test_layout.py).
"""
