"""Talking to the inference fleet: the vLLM fleet client with session routing and weight sync (fleet.py),
and checkpoints written in the layout the servers reload (serving_weights.py).
"""
