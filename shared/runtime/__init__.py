"""What every service runs on: the configuration (config.py, one module per section in sections/), the
service runtime with JSON logs, /healthz and /metrics (service.py), storage (storage.py) and experiment
tracking (tracking.py).
"""
