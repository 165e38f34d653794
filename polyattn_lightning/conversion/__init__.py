"""Converting a pretrained softmax model to another attention without losing what it learned: one call.

``convert(model, "poly3", samples, method="transfer")`` switches a timm or Hugging Face model through the one
door, :func:`~polyattn_lightning.attention.set_attention`, and converts it in place on ``samples`` (an iterable of
the model's own input batches: tensors for timm, dicts of tensors for HF), returning a :class:`ConversionReport`.
The methods (docs/benchmarks/conversion.md measures them on three pretrained models):

* ``none``: switched as it is (the report still measures each layer against softmax);
* ``calibrate`` (:mod:`.calibrate`): one temperature per head from a grid, folded into the queries; cheap, but
  for x^p, relu and poly1 it can only rescale a head's output, never change its pattern;
* ``transfer`` (:mod:`.transfer`): layer-local attention transfer: each layer's query and key projections (LoRA
  by default) and a factor per head trained to give the softmax layer's output on its own inputs, then folded
  (:mod:`.folding`): no new parameter, the same state-dict keys. It trains on all but ``holdout`` of the samples
  (:mod:`.holdout`) and stops when the layer error of those it does not train on stops falling, keeping the
  weights where it was lowest; the report gives both errors, and it warns when the samples are too few or too
  alike to judge it on, or to train it on.

The call is :func:`~.run.convert` (``run.py``), the task option :class:`~.recipe.ConvertRecipe` (``recipe.py``).

Fine-tuning after the conversion, in full or with LoRA adapters (:mod:`.lora`, peft), is the tasks' (their
``convert`` and ``lora`` options, ``tasks/base.py``).
"""

from .recipe import METHODS, OPTIONS, ConvertRecipe
from .report import ConversionReport
from .run import attention_layers, convert

__all__ = ["METHODS", "OPTIONS", "ConversionReport", "ConvertRecipe", "attention_layers", "convert"]
