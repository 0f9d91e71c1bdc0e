"""`rollstream replay`: planning and checking a replay of a recorded run (plan.py) and the command that
publishes it and runs services on it (command.py).
"""
