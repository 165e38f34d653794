"""Why it works, measured: attention norms, attention maps and their figures, and the cubic-spline check.

* ``probe.py``: one forward of a fixed small batch with the ``capture`` hook set on chosen layers (what every
  diagnostic shares; it leaves training as it would have been);
* ``norms.py``: ``||phi(S)||_F``, ``||d phi(S)/dS||_F``, ``||phi(S) v||_F`` per head (the polynomial paper's
  argument), logged by ``callbacks.AttentionNorms`` and drawn by ``polyattn norms``;
* ``maps.py`` and ``figures.py``: ``phi(S)`` per layer and head and where the model looks in its input, drawn by
  ``callbacks.AttentionMaps`` and ``polyattn maps``;
* ``spline.py``: "Attention is a smoothed cubic spline", checked numerically.

Everything here reads models through the ``capture`` contract of
:mod:`polyattn_lightning.attention.switch.base`, so a newly switched family needs nothing of its own.
"""

from .norms import CapturedNorms, NormValues, attention_norms, captured_norms, measure_norms, metric_key
from .probe import Layer, LayerRef, default_probe, probe_attention, probe_batch, probing, run_probe, select_layers

__all__ = [
    "CapturedNorms",
    "Layer",
    "LayerRef",
    "NormValues",
    "attention_norms",
    "captured_norms",
    "default_probe",
    "measure_norms",
    "metric_key",
    "probe_attention",
    "probe_batch",
    "probing",
    "run_probe",
    "select_layers",
]
