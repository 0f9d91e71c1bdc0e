"""The sandbox-grader service: grades finished rollouts in a sandbox through RQ jobs
(`rollstream-sandbox-grader`).
"""
