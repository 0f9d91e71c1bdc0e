"""The reward service: rewards and group advantages, then batch files (`rollstream-reward`).
"""
