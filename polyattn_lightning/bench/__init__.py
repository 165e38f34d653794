"""Benchmarks: ``python -m polyattn_lightning.bench attention``."""
