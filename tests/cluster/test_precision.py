"""Mixed precision through Lightning's own precision plugins.

bf16-mixed trains on CPU; 16-mixed trains with the gradient scaler (Lightning
turns ``precision="16-mixed"`` on CPU into bf16, so the test hands it the fp16
plugin with a CPU scaler, as the GPU path builds it); poly3 attention under
fp16 autocast stays finite on scores where the naive fp16 ``(S**3) @ v`` overflows.
"""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from cluster_harness import digits, tiny_classifier
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins import MixedPrecision
from training_helpers import cpu_trainer

from polyattn_lightning.cli.defaults import default_precision
from polyattn_lightning.checkpoint import SafeCheckpointIO


class RecordSteps(Callback):
    """Training losses, and the dtype autocast gave the first block's MLP output."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.dtypes: set[torch.dtype] = set()

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.model.blocks[0].mlp.register_forward_hook(lambda m, i, out: self.dtypes.add(out.dtype))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def fit_three_steps(model, **trainer_args) -> RecordSteps:
    record = RecordSteps()
    before = [p.detach().clone() for p in model.parameters()]
    cpu_trainer(max_epochs=1, max_steps=3, callbacks=[record], **trainer_args).fit(model, digits(batch_size=32))
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before)), "no optimizer step was taken"
    assert len(record.losses) == 3 and all(torch.isfinite(torch.tensor(record.losses)))
    return record


def test_bf16_mixed_trains_on_cpu():
    pl.seed_everything(0)
    record = fit_three_steps(tiny_classifier(mixup=True, drop_path=0.1), precision="bf16-mixed")
    assert record.dtypes == {torch.bfloat16}


def test_16_mixed_with_grad_scaler_trains_poly3_where_naive_fp16_overflows():
    pl.seed_everything(0)
    model = tiny_classifier(attention="poly3")
    attn = model.model.blocks[0].attn
    dim = attn.qkv.weight.shape[1]
    with torch.no_grad():
        attn.qkv.weight[: 2 * dim] *= 35.0  # q and k rows: scores reach |S| ~ 50, and 50**3 > fp16's 65504
        attn.qkv.weight[2 * dim :] *= 0.1  # v rows: the attention output itself stays far inside fp16's range
    captured = []
    attn.capture = lambda module, inputs: captured.append(inputs)

    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    record = fit_three_steps(model, plugins=[fp16, SafeCheckpointIO()])
    assert record.dtypes == {torch.float16}

    q, k, v, temperature = captured[0].q, captured[0].k, captured[0].v, captured[0].temperature
    assert q.dtype == torch.float16
    assert ((q.float() @ k.float().transpose(-2, -1)) * temperature).abs().max() > 45
    naive = (((q @ k.transpose(-2, -1)) * temperature) ** 3) @ v  # fp16 throughout
    assert not torch.isfinite(naive).all()


@pytest.mark.parametrize(
    "cuda, bf16, expected", [(True, True, "bf16-mixed"), (True, False, "16-mixed"), (False, False, "32-true")]
)
def test_default_precision_is_bf16_mixed_on_gpus_that_have_it(monkeypatch, cuda, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    assert default_precision() == expected
