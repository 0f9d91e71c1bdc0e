"""The project's own tiny model: building it offline (tiny_model.py, `rollstream build-model`) and its
supervised warm-up (warmup.py, `rollstream warmup`).
"""
