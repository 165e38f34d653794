"""polyattn_lightning: Lightning training for transformers whose attention is not (only) softmax."""

__version__ = "0.1.0"
