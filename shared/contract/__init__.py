"""The contract between services: every event type and how it travels (events.py gathers them: the event
models by stage in event_models/, the streams in streams.py, the envelope and the codec), the Redis stream bus
that carries them (bus.py, with reclaim.py and dead_letters.py; every key of a run from keys.py), the Parquet
archive of every stream (archive/) and the batch files the trainer reads (batches.py). A change here is a
change of the wire format.
"""
