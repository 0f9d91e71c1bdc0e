"""Trainer backends: where the model lives and how a gradient step is taken.

    base.py               the Backend protocol and what every backend shares (model loading, RNG state)
    torch_backend.py      plain PyTorch on the CPU or one GPU
    deepspeed_backend.py  DeepSpeed ZeRO stage 2 or 3
    factory.py            make_backend: the backend train.backend names

Tests: tests/unit/services/trainer/test_trainer_backends.py (the DeepSpeed runs go through
tests/unit/services/trainer/deepspeed_step.py).
"""
