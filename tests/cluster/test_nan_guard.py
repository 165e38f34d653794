"""The NaN guard never lets a run train on a non-finite loss, for any LightningModule.

Lightning's BoringModel (not this project's task) shows it is task-agnostic;
AdamW with weight decay shows a skipped step leaves the weights alone (zeroed
gradients would still decay them; dropped ones do not).
"""
from __future__ import annotations

import pytest
import torch
from training_helpers import cpu_trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from polyattn_lightning.callbacks import NonFiniteLossError, NonFiniteLossGuard

BAD_STEP = 3


class LossGoesBadAt(BoringModel):
    def __init__(self, bad_value: float):
        super().__init__()
        self.bad_value = bad_value

    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        if self.global_step == BAD_STEP:
            output["loss"] = output["loss"] * self.bad_value
        return output

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.1)


class WeightsAfterEachStep(Callback):
    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.weights.append(pl_module.layer.weight.detach().clone())


def test_default_raises_naming_the_step():
    trainer = cpu_trainer(max_steps=6, callbacks=[NonFiniteLossGuard()])
    with pytest.raises(NonFiniteLossError, match=rf"global step {BAD_STEP} \(epoch 0, batch {BAD_STEP}\): loss = nan"):
        trainer.fit(LossGoesBadAt(float("nan")))
    assert trainer.global_step == BAD_STEP


def test_skip_leaves_the_weights_unchanged_for_that_step_and_goes_on():
    record = WeightsAfterEachStep()
    trainer = cpu_trainer(max_steps=6, callbacks=[NonFiniteLossGuard(on_nonfinite="skip"), record])
    with pytest.warns(UserWarning, match=rf"global step {BAD_STEP} .*skipping this optimizer step"):
        trainer.fit(LossGoesBadAt(float("inf")))

    assert trainer.global_step == 6 and len(record.weights) == 6
    weights = record.weights
    assert torch.equal(weights[BAD_STEP], weights[BAD_STEP - 1])  # the bad step changed nothing
    assert not torch.equal(weights[BAD_STEP + 1], weights[BAD_STEP])  # the next one trained
    assert all(torch.isfinite(w).all() for w in weights)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'raise' or 'skip'"):
        NonFiniteLossGuard(on_nonfinite="ignore")
