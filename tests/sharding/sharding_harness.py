"""What the sharding tests and their 2-rank worker share: a tiny Llama on random tokens, the tiny ViT on digits, and
a fit of either under one process, DDP or the sharded strategy from a saved initial state dict.

The decoder: 2 Llama layers of width 32 (``LlamaDecoderLayer`` is the block), vocabulary 64, on 64 random sequences
of 16 tokens loaded by a :class:`ResumableDataLoader` (global batch 8: 8 steps an epoch, so step 2 is mid-epoch). No
dropout: its training draws no random number, so a run on 2 ranks and one on 1 process with the same global batch
are comparable step by step, and so is a run resumed on another number of ranks. The ViT is the cluster tests'
(``cluster_harness.tiny_classifier``: 2 ``Block``s of width 32 on 8x8 digits).

:func:`uneven`: either task with validation and test splits whose two ranks' shares make different numbers of
batches (:data:`VAL_SIZE` and :data:`TEST_SIZE` samples in batches of :data:`EVAL_BATCH`): 5 and 4 samples, 2 and 1
batches; 9 and 8, 3 and 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from cluster_harness import digits, tiny_classifier
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import Subset
from training_helpers import cpu_trainer

from polyattn_lightning.data import DigitsDataModule
from polyattn_lightning.data.evaluation import eval_loader
from polyattn_lightning.data.resumable import ResumableDataLoader
from polyattn_lightning.sharding import ShardedStrategy, build_later, full_state_dict
from polyattn_lightning.tasks import HFCausalLM, OptimRecipe

LLAMA = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    tie_word_embeddings=True,
)
VOCAB, SEQUENCES, LENGTH, GLOBAL_BATCH = 64, 64, 16, 8
#: optimizer steps of the compared runs
STEPS = 4


class TokenData(pl.LightningDataModule):
    """Random token sequences (fixed seed) as ``{"input_ids": ...}`` batches; ``vocab_size`` for the task."""

    vocab_size = VOCAB

    def __init__(self, batch_size: int):
        super().__init__()
        self.batch_size = batch_size
        ids = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(7))
        self.rows = [{"input_ids": row} for row in ids]

    def train_dataloader(self) -> ResumableDataLoader:
        return ResumableDataLoader(self.rows, batch_size=self.batch_size, shuffle=True)


#: the uneven evaluation splits (:func:`uneven`) and their per-rank batch size
VAL_SIZE, TEST_SIZE, EVAL_BATCH = 9, 17, 4


class UnevenTokens(TokenData):
    """:class:`TokenData` with validation and test (and predict) splits of the first rows, through the project's
    evaluation loaders."""

    def val_dataloader(self):
        return eval_loader(self.rows[:VAL_SIZE], self.trainer, batch_size=EVAL_BATCH)

    def test_dataloader(self):
        return eval_loader(self.rows[VAL_SIZE : VAL_SIZE + TEST_SIZE], self.trainer, batch_size=EVAL_BATCH)

    predict_dataloader = test_dataloader


class UnevenDigits(DigitsDataModule):
    """The digits with disjoint validation and test splits of :data:`VAL_SIZE` and :data:`TEST_SIZE` samples."""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        held_out = self.val_set
        self.val_set = Subset(held_out, range(VAL_SIZE))
        self.test_set = Subset(held_out, range(VAL_SIZE, VAL_SIZE + TEST_SIZE))


def uneven(kind: str) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    """The ``decoder`` or ``vit`` task and its data with the uneven evaluation splits, batch :data:`EVAL_BATCH`."""
    if kind == "decoder":
        return tiny_decoder(), UnevenTokens(EVAL_BATCH)
    return tiny_classifier(), UnevenDigits(img_size=8, batch_size=EVAL_BATCH, num_workers=0)


def tiny_decoder(attention: Any = "poly3") -> HFCausalLM:
    optim = OptimRecipe(lr=3e-3, reference_batch=None, warmup_epochs=0.0, warmup_lr=1e-4, min_lr=1e-4)
    return HFCausalLM(hf_config=dict(LLAMA), attention=attention, vocab_size=VOCAB, optim=optim, test_after_fit=False)


def make(kind: str, attention: Any, devices: int) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    """The ``decoder`` or ``vit`` task and its data at the per-rank batch of ``devices`` ranks."""
    if kind == "decoder":
        return tiny_decoder(attention), TokenData(GLOBAL_BATCH // devices)
    return tiny_classifier(attention=attention), digits(batch_size=32 // devices)


def strategy(layout: str, **options: Any):
    """``single`` (one process), ``ddp`` or ``fsdp`` (:class:`ShardedStrategy`), on gloo."""
    if layout == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if layout == "fsdp":
        return ShardedStrategy(process_group_backend="gloo", **options)
    return "auto"


def fit(
    kind: str,
    attention: Any,
    layout: str,
    devices: int,
    init: Path,
    steps: int,
    callbacks: tuple = (),
    ckpt_path: str | None = None,
    **trainer_options: Any,
) -> tuple[pl.Trainer, pl.LightningModule]:
    """Seed, build, load the initial state dict ``init``, fit ``steps`` optimizer steps (no validation)."""
    pl.seed_everything(0, workers=True)
    model, data = make(kind, attention, devices)
    model.load_state_dict(torch.load(init, weights_only=True))
    trainer = cpu_trainer(
        devices=devices,
        strategy=strategy(layout),
        max_steps=steps,
        limit_val_batches=0,
        callbacks=list(callbacks),
        **trainer_options,
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, model


def weights(model: pl.LightningModule) -> dict[str, torch.Tensor]:
    """The whole weights on CPU (gathered from every rank when sharded; every rank must call it)."""
    return {key: value.detach().cpu().clone() for key, value in full_state_dict(model).items()}


def save_initial_states(folder: Path) -> dict[str, Path]:
    """The initial state dicts every run of the tests starts from, one per model kind."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind in ("decoder", "vit"):
        pl.seed_everything(0)
        model, _ = make(kind, "softmax", 1)
        paths[kind] = folder / f"{kind}_init.pt"
        torch.save(model.state_dict(), paths[kind])
    return paths


def meta_build(devices: int, **options: Any) -> pl.LightningModule:
    """The tiny decoder made under :func:`build_later` and fitted 0 steps on ``devices`` sharded ranks: built on the
    meta device, sharded, then initialised by HF's own init."""
    pl.seed_everything(0)
    with build_later():
        model, data = make("decoder", "poly3", devices)
    assert not model.built
    trainer = cpu_trainer(devices=devices, strategy=strategy("fsdp", **options), max_steps=0, limit_val_batches=0)
    trainer.fit(model, data)
    return model
