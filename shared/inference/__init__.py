"""Talking to the inference fleet: the vLLM fleet client (fleet.py) with what it reads of each server on
/v1/models and its health (fleet_servers.py), session routing with bounded load (fleet_routing.py), vLLM's
answers read token-exactly (vllm_answers.py) and weight sync (weight_sync.py); model groups beside the
policy (model_groups.py); and checkpoints written in the layout the servers reload (serving_weights.py).
"""
