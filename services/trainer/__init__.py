"""The trainer service: trains on each batch as it comes and pushes the new weights to the fleet
(`rollstream-trainer`).
"""
