"""Trainer tests: this folder holds `trainer_batches.py` (random rollout batches), imported by the tests below it."""
