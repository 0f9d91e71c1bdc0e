"""The contract between services: every event type (events.py), the Redis stream bus that carries them
(bus.py), the Parquet archive of every stream (archive/) and the batch files the trainer reads
(batches.py). A change here is a change of the wire format.
"""
