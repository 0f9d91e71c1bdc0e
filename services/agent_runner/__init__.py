"""The agent-runner service: prompts in, agent episodes against the vLLM fleet, trajectory events out
(`rollstream-agent-runner`).
"""
