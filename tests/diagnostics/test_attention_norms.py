"""The norm callback: its formulas against autograd, the keys it logs, and that training is unchanged by it."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import timm
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from timm.layers import Attention

from polyattn_lightning import cli
from polyattn_lightning.diagnostics.norms import captured_norms, probe_attention, select_layers
from polyattn_lightning.attention import set_attention
from polyattn_lightning.callbacks import AttentionMaps, AttentionNorms
from polyattn_lightning.checkpoint import load_checkpoint
from polyattn_lightning.commands.norms import read_norms
from polyattn_lightning.data import DigitsDataModule
from polyattn_lightning.tasks import ClassificationModule

#: phi as a function of the score matrix, written out independently of the registry (n keys).
PHI = {
    "softmax": lambda s, n: s.softmax(-1),
    "poly3": lambda s, n: s**3 / math.sqrt(n),
    "relu": lambda s, n: torch.relu(s) / n,
    "sigmoid": lambda s, n: torch.sigmoid(s - math.log(n)),
}


@pytest.mark.parametrize("name", sorted(PHI))
def test_captured_norms_match_autograd(name):
    """||phi(S)||_F, ||d phi(S)/dS||_F (the full Jacobian of the map) and ||phi(S) v||_F per head."""
    torch.manual_seed(0)
    module = Attention(12, num_heads=3).double()
    set_attention(module, name)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    (layer,) = select_layers(module)
    (inputs,) = probe_attention([layer], lambda: module(x))[1]
    got = captured_norms(inputs, name)

    s = inputs.q @ inputs.k.transpose(-2, -1) * inputs.temperature
    B, H, nq, nk = s.shape
    want = torch.zeros(3, B, H, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            phi = PHI[name](s[b, h], nk)
            jacobian = torch.autograd.functional.jacobian(lambda m: PHI[name](m, nk), s[b, h])  # (nq, nk, nq, nk)
            want[:, b, h] = torch.stack([phi.norm(), jacobian.norm(), (phi @ inputs.v[b, h]).norm()])
    want = want.mean(1).float()
    torch.testing.assert_close(torch.stack([got.phi, got.jacobian, got.output]), want, rtol=1e-5, atol=1e-7)


FAMILIES = {
    "vit": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2)),
    "swin": ("swin_tiny_patch4_window7_224", dict(img_size=56, embed_dim=24, depths=(2, 2), num_heads=(1, 2))),
    "xcit": ("xcit_nano_12_p16_224", dict(img_size=32, depth=2)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("activation", ["softmax", "poly1", "poly3", "relu", "softplus", "sigmoid"])
def test_every_activation_and_family_gives_finite_norms_per_head(family, activation):
    name, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=3, **kwargs)
    set_attention(model, activation)
    layers = select_layers(model)
    size = kwargs["img_size"]
    metrics = AttentionNorms().measure(model, torch.randn(2, 3, size, size))
    heads = [layer.module.num_heads for layer in layers]
    assert len(metrics) == 3 * sum(h + 1 for h in heads)
    assert all(math.isfinite(v) and v >= 0 for v in metrics.values())
    assert model.training  # put back


def test_unknown_layer_is_named():
    model = timm.create_model("vit_tiny_patch16_224", num_classes=3, img_size=16, patch_size=8, depth=2)
    set_attention(model, "poly3")
    with pytest.raises(ValueError, match=r"no attention layer 3: expected a number 1\.\.2"):
        select_layers(model, [3])


class LossRecorder(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())


def _fit(tmp_path, callbacks, loggers=False, steps=5):
    """A tiny ViT with dropout, attention dropout and drop path on digits: every RNG draw shows in the loss."""
    pl.seed_everything(0)
    module = ClassificationModule(
        "vit_tiny_patch16_224", num_classes=10, attention="poly3", img_size=16,
        model_kwargs=dict(patch_size=4, embed_dim=32, depth=2, num_heads=2, drop_rate=0.2, attn_drop_rate=0.2),
    )
    module.model.blocks[0].drop_path1 = timm.layers.DropPath(0.2)
    recorder = LossRecorder()
    trainer = pl.Trainer(
        max_steps=steps, val_check_interval=steps, limit_val_batches=2, logger=loggers,
        callbacks=[recorder, *callbacks],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        num_sanity_val_steps=0, accelerator="cpu", deterministic=True,
    )
    trainer.fit(module, datamodule=DigitsDataModule(img_size=16, batch_size=16))
    return recorder.losses, module, trainer


def test_callbacks_log_norms_and_maps_and_leave_training_bitwise_unchanged(tmp_path, capsys):
    loggers = [TensorBoardLogger(tmp_path / "with", name="tb"), CSVLogger(tmp_path / "with", name="csv")]
    callbacks = [AttentionNorms(every_n_steps=2, probe_size=4), AttentionMaps(probe_size=4, samples=2)]
    with_losses, with_module, trainer = _fit(tmp_path / "with", callbacks, loggers)
    without_losses, without_module, _ = _fit(tmp_path / "without", [])

    assert len(with_losses) == 5
    assert all(torch.equal(a, b) for a, b in zip(with_losses, without_losses))
    for a, b in zip(with_module.state_dict().values(), without_module.state_dict().values()):
        assert torch.equal(a, b)

    keys = {f"attention/{q}/layer{i:02d}/{h}" for q in ("phi_norm", "jacobian_norm", "output_norm")
            for i in (1, 2) for h in ("head0", "head1", "mean")}
    with open(loggers[1].log_dir + "/metrics.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row.get("attention/phi_norm/layer01/mean")]
    assert keys <= set(rows[0]) and [int(row["step"]) for row in rows] == [0, 2, 4]
    events = EventAccumulator(loggers[0].log_dir)
    events.Reload()
    assert keys <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("attention/jacobian_norm/layer02/mean")] == [0, 2, 4]
    assert {"attention_maps/heatmaps", "attention_maps/overlay"} <= set(events.Tags()["images"])
    pngs = sorted(p.name for p in (tmp_path / "with" / "tb").rglob("*.png"))
    assert pngs == ["step0000005_heatmaps.png", "step0000005_overlay.png"]

    from_tensorboard, from_csv = read_norms(Path(loggers[0].log_dir)), read_norms(Path(loggers[1].log_dir))
    assert len(from_csv) == 3 * 2 and from_tensorboard.keys() == from_csv.keys()
    for key, points in from_csv.items():
        assert [step for step, _ in points] == [0, 2, 4]
        torch.testing.assert_close(torch.tensor(from_tensorboard[key]), torch.tensor(points), rtol=1e-6, atol=0)
    out = tmp_path / "norms.png"
    (tmp_path / "with" / "no_norms").mkdir()
    (tmp_path / "with" / "no_norms" / "metrics.csv").write_text("step,train/loss\n0,2.3\n")  # a run without them
    for evaluation in ("validate_last", "test_last_2"):  # a checkpoint's evaluations: logs without norms
        (tmp_path / "with" / "no_norms" / evaluation).mkdir()
        (tmp_path / "with" / "no_norms" / evaluation / "metrics.csv").write_text("step,val/loss\n0,2.3\n")
    cli.main(["norms", str(tmp_path / "with"), "--layer", "2", "--out", str(out)])
    assert out.stat().st_size > 10_000
    printed = capsys.readouterr().out
    [skipped] = [line for line in printed.splitlines() if line.startswith("skipped")]
    assert skipped == (
        "skipped 3 folders whose logs hold no attention norms (evaluations of a checkpoint, runs with --callbacks_off "
        "[norms] or stopped before the first probe step): with/no_norms, with/no_norms/test_last_2, "
        "with/no_norms/validate_last")
    assert "(2 runs)" in printed  # the TensorBoard and the CSV run

    # the probe travels in checkpoints (a resumed run measures the same samples), loadable with weights_only
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    state = load_checkpoint(tmp_path / "run.ckpt")["callbacks"]
    assert torch.equal(state["AttentionNorms"]["probe"], callbacks[0]._probe)
    assert state["AttentionNorms"]["probe"].shape == (4, 3, 16, 16)
