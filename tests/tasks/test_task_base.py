"""The task base of one job: a task declares its options and implements four methods, and nothing else; the base
saves its hyperparameters as Lightning's own ``save_hyperparameters`` would, builds when it can, prepares the model
in one fixed order (switch, convert, LoRA, shard) and tests the best checkpoint at the end of ``fit`` through a
callback. A task written outside the project (here, and in a script run by the CLI as ``__main__.MyTask``) trains,
checkpoints, loads and resumes without calling anything of the base."""

from __future__ import annotations

import copy
import inspect
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy
from training_helpers import cpu_trainer
from transformers import LlamaConfig, LlamaForCausalLM

from polyattn_lightning.attention import attention_modules
from polyattn_lightning.checkpoint import load_checkpoint
from polyattn_lightning.conversion import ConvertRecipe
from polyattn_lightning.conversion.lora import LoraRecipe, is_lora
from polyattn_lightning.distributed import teardown_process_group
from polyattn_lightning.errors import ConfigError
from polyattn_lightning.models import LRAClassifier
from polyattn_lightning.sharding import ShardedStrategy
from polyattn_lightning.tasks import HFCausalLM, OptimRecipe, TaskModule, preparation
from polyattn_lightning.tasks import logits_evaluation
from polyattn_lightning.tasks.best_checkpoint import BestCheckpointTest

FAST = OptimRecipe(lr=3e-3, reference_batch=None, weight_decay=0.0, warmup_epochs=0.0, warmup_lr=1e-4, min_lr=1e-4)
VOCAB, LENGTH = 6, 8


class Toy(TaskModule):
    """A user's task: it declares its options and the value the data gives, and implements build, forward,
    training_step and evaluate. It calls nothing of the base (no save_hyperparameters, no build)."""

    data_args = ("num_classes",)

    def __init__(
        self,
        num_classes: int | None = None,
        width: int = 16,
        attention: str = "relu",
        optim: OptimRecipe = FAST,
        test_after_fit: bool = False,
    ):
        super().__init__()
        self.built_with: list[int] = []  # the body runs before the base builds: build() can use what it sets

    def build(self) -> None:
        hp = self.hparams
        self.built_with.append(hp.width)
        self.model = LRAClassifier(VOCAB, LENGTH, hp.num_classes, dim=hp.width, mlp_dim=hp.width, depth=1, num_heads=2,
                                   head_dim=8, dropout=0.0, attn_dropout=0.0)
        self.set_metrics(MetricCollection({"top1": MulticlassAccuracy(hp.num_classes, average="micro")}))

    def forward(self, input_ids, mask):
        return self.model(input_ids, mask)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self(batch["input_ids"], batch["mask"]), batch["label"])
        self.log("train/loss", loss)
        return loss

    def evaluate(self, batch, stage: str) -> None:
        logits_evaluation(self, self(batch["input_ids"], batch["mask"]), batch["label"], stage)


class DeeperToy(Toy):
    """A subclass of the user's task with an option of its own, passing the others on."""

    def __init__(self, depth: int = 2, **kwargs):
        super().__init__(**kwargs)


class ToyData(pl.LightningDataModule):
    """Token sequences whose label is the parity of the first token; the data gives ``num_classes``."""

    num_classes = 2

    def __init__(self, batch_size: int = 8):
        super().__init__()
        self.batch_size = batch_size
        ids = torch.randint(0, VOCAB, (48, LENGTH), generator=torch.Generator().manual_seed(3))
        self.train_set = [{"input_ids": row, "mask": torch.ones(LENGTH, dtype=torch.bool), "label": row[0] % 2}
                          for row in ids]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set[:32], batch_size=self.batch_size)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set[32:], batch_size=self.batch_size)

    def test_dataloader(self):
        return self.val_dataloader()


class PlainToy(pl.LightningModule):
    """The reference: Toy's options saved by Lightning itself, the way every task did before the base did it."""

    def __init__(self, num_classes: int | None = None, width: int = 16, attention: str = "relu",
                 optim: OptimRecipe = FAST, test_after_fit: bool = False):
        super().__init__()
        self.save_hyperparameters()


class PlainDeeperToy(PlainToy):
    def __init__(self, depth: int = 2, **kwargs):
        super().__init__(**kwargs)


def switched_specs(module) -> list:
    return [layer.activation_spec for _, layer in attention_modules(module)]


def toy_trainer(root: Path, steps: int, *callbacks, **options) -> pl.Trainer:
    return cpu_trainer(max_steps=steps, default_root_dir=root, callbacks=list(callbacks), val_check_interval=2,
                       limit_val_batches=1, **options)


# ---- declare, implement: nothing to remember -----------------------------------------------------

def test_the_hyperparameters_are_what_lightnings_save_hyperparameters_saves():
    for task, plain, args in ((Toy, PlainToy, dict(num_classes=3, width=8)),
                              (DeeperToy, PlainDeeperToy, dict(depth=4, num_classes=3, attention="poly1"))):
        made, reference = task(**args), plain(**args)
        assert dict(made.hparams) == dict(reference.hparams) and made._hparams_name == reference._hparams_name
        assert dict(made.hparams_initial) == dict(reference.hparams_initial)
    assert dict(DeeperToy(depth=4).hparams) == {"depth": 4, "num_classes": None, "width": 16, "attention": "relu",
                                                "optim": FAST, "test_after_fit": False}


def test_the_base_builds_once_the_init_has_run_and_when_the_values_are_known():
    known = Toy(num_classes=3, width=8)
    assert known.built and known.built_with == [8] and switched_specs(known.model) == ["relu"]
    assert DeeperToy(num_classes=3).built and isinstance(DeeperToy(num_classes=3).model, LRAClassifier)
    waiting = Toy()
    assert not waiting.built and waiting.built_with == []
    with pytest.raises(ConfigError, match="^Toy needs num_classes: give model.init_args.num_classes or use a "
                                          "DataModule that has it$"):
        waiting.configure_model()
    # the signature a plain class has, for whatever reads a task class's (inspect, documentation)
    assert list(inspect.signature(DeeperToy).parameters) == ["depth", "kwargs"]
    assert str(inspect.signature(Toy)) == str(inspect.signature(PlainToy))


def test_a_task_written_for_the_old_base_builds_once_and_a_retired_hook_is_named():
    class OldStyle(Toy):
        def __init__(self, num_classes: int | None = None, width: int = 16):
            super().__init__(num_classes=num_classes, width=width)
            self.save_hyperparameters()  # what every task had to remember
            self.build_if_known()

    old = OldStyle(num_classes=3, width=8)
    assert old.built_with == [8] and dict(old.hparams) == dict(Toy(num_classes=3, width=8).hparams)
    with pytest.warns(UserWarning, match=r"^Older.test_best_checkpoint is no longer called by the task base: the "
                                         r"best checkpoint's test is the BestCheckpointTest callback"):
        class Older(Toy):
            def test_best_checkpoint(self) -> None:
                pass


def test_copying_and_unpickling_restore_a_task_without_building_it_again():
    task = Toy(num_classes=3)
    for clone in (copy.deepcopy(task), pickle.loads(pickle.dumps(task))):
        assert clone.built and clone.built_with == [16] and clone.hparams == task.hparams
        for name, value in task.state_dict().items():
            assert torch.equal(clone.state_dict()[name], value), name


def test_a_user_task_trains_checkpoints_loads_and_resumes(tmp_path):
    pl.seed_everything(0)
    data, task = ToyData(), DeeperToy(depth=3)
    last = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True, every_n_train_steps=2)
    trainer = toy_trainer(tmp_path, 4, last, enable_checkpointing=True)
    trainer.fit(task, datamodule=data)
    assert trainer.global_step == 4 and task.built_with == [16] and task.hparams.num_classes == 2  # from the data
    saved = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert saved["hyper_parameters"] == {**dict(task.hparams)} and saved["hyper_parameters"]["depth"] == 3

    loaded = DeeperToy.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert loaded.built and loaded.hparams == task.hparams and switched_specs(loaded.model) == ["relu"]
    for name, value in task.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name

    resumed = DeeperToy(depth=3)
    toy_trainer(tmp_path, 6).fit(resumed, datamodule=data, ckpt_path=tmp_path / "checkpoints" / "last.ckpt")
    assert resumed.trainer.global_step == 6 and resumed.hparams == task.hparams


SCRIPT = '''
    """A task and its data written in a script, run by the project's CLI as __main__.MyTask."""
    import sys

    import lightning.pytorch as pl
    import torch

    from polyattn_lightning import cli
    from polyattn_lightning.models import LRAClassifier
    from polyattn_lightning.tasks import OptimRecipe, TaskModule


    class MyTask(TaskModule):
        data_args = ("num_classes",)

        def __init__(self, num_classes: int | None = None, width: int = 16, attention: str = "relu",
                     optim: OptimRecipe = OptimRecipe(lr=1e-3, reference_batch=None, warmup_epochs=0.0)):
            super().__init__()

        def build(self):
            self.model = LRAClassifier(6, 8, self.hparams.num_classes, dim=self.hparams.width, mlp_dim=8, depth=1,
                                       num_heads=2, head_dim=4, dropout=0.0, attn_dropout=0.0)

        def forward(self, input_ids):
            return self.model(input_ids, torch.ones_like(input_ids, dtype=torch.bool))

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

        def evaluate(self, batch, stage):
            self.log(f"{stage}/top1", (self(batch[0]).argmax(-1) == batch[1]).float().mean())


    class MyData(pl.LightningDataModule):
        num_classes = 3

        def train_dataloader(self):
            ids = torch.randint(0, 6, (16, 8), generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(list(zip(ids, ids[:, 0] % 3)), batch_size=4)

        val_dataloader = train_dataloader


    if __name__ == "__main__":
        cli.main(sys.argv[1:])
'''


def test_a_task_in_a_script_runs_through_the_cli_and_resumes_from_its_checkpoint(tmp_path):
    script = tmp_path / "my_task.py"
    script.write_text(textwrap.dedent(SCRIPT))
    common = ["fit", "--model", "__main__.MyTask", "--model.width", "8", "--data", "__main__.MyData",
              "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
              "--trainer.limit_val_batches", "1", "--callbacks_off", "[norms, memory]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), *common, *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)

    first = run("--trainer.max_steps", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    [last] = tmp_path.glob("runs/**/checkpoints/last.ckpt")
    saved = load_checkpoint(last)["hyper_parameters"]
    assert saved["_class_path"] == "__main__.MyTask" and (saved["num_classes"], saved["width"]) == (3, 8)
    resumed = run("--trainer.max_steps", "4", "--ckpt_path", str(last))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert load_checkpoint(last)["global_step"] == 4


# ---- one order: switch, convert, LoRA, shard ---------------------------------------------------------

class Watched(HFCausalLM):
    """The tiny decoder noting, each time a step asks it something, what its model looks like then: switched,
    converted (the task's report), with adapters, sharded."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen: dict[str, tuple[bool, bool, bool, bool]] = {}

    def look(self, step: str) -> None:
        self.seen.setdefault(step, (bool(switched_specs(self.model)), self.conversion is not None,
                                    is_lora(self.model), isinstance(self.model, FSDPModule)))

    def attention_options(self):  # the switch step, right before switching
        self.look("switch")
        return super().attention_options()

    def conversion_inputs(self, batch):  # the convert step, collecting its samples
        self.look("convert")
        return super().conversion_inputs(batch)

    def lora_trainable(self):  # the LoRA step, right before adding the adapters
        self.look("lora")
        return super().lora_trainable()


class Tokens(pl.LightningDataModule):
    vocab_size = 64
    collate_fn = None

    def __init__(self):
        super().__init__()
        ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(1))
        self.train_set = [{"input_ids": row} for row in ids]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=4)


@pytest.fixture
def one_rank():
    yield
    teardown_process_group(wait=False)


def test_the_steps_run_in_one_order_switch_convert_lora_shard(tmp_path, one_rank):
    """A pretrained (softmax) decoder, adapted under the sharded strategy: each step sees the ones before it done."""
    assert [step.name for step in preparation.STEPS] == ["switch", "convert", "lora", "shard"]
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, vocab_size=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "pretrained")
    task = Watched(model=str(tmp_path / "pretrained"), attention="poly3", lora=LoraRecipe(r=4, alpha=8),
                   convert=ConvertRecipe(method="transfer", samples=8, steps=2), optim=FAST, test_after_fit=False)
    assert not task.built  # the vocabulary is the data's: built under the trainer
    trainer = cpu_trainer(strategy=ShardedStrategy(process_group_backend="gloo"), max_steps=1, limit_val_batches=0,
                          default_root_dir=tmp_path)
    trainer.fit(task, datamodule=Tokens())
    #                       (switched, converted, adapters, sharded)
    assert task.seen == {"switch": (False, False, False, False),
                         "convert": (True, False, False, False),  # the convert step sees switched modules
                         "lora": (True, True, False, False),  # the adapters go on converted weights
                         }
    assert isinstance(task.model, FSDPModule) and not trainer.strategy.built_on_meta  # sharded, last
    adapters = [p for name, p in task.model.named_parameters() if "lora_" in name]
    assert adapters and all(isinstance(p, DTensor) for p in adapters)  # sharded with the layers they wrap
    assert task.conversion["method"] == "transfer"


# ---- the best checkpoint's test, a callback the base adds ----------------------------------------------

def test_with_test_after_fit_the_best_checkpoint_by_the_tasks_metric_is_tested(tmp_path, caplog):
    pl.seed_everything(0)
    by_loss = ModelCheckpoint(dirpath=tmp_path / "loss", monitor="val/loss", mode="min")
    by_top1 = ModelCheckpoint(dirpath=tmp_path / "top1", monitor="val/top1", mode="max")
    task = Toy(test_after_fit=True)
    trainer = toy_trainer(tmp_path, 6, by_loss, by_top1, enable_checkpointing=True)
    with caplog.at_level(logging.INFO):
        trainer.fit(task, datamodule=ToyData())
    assert trainer.ckpt_path == by_top1.best_model_path  # the task's monitor, though listed second
    assert "test/top1" in trainer.callback_metrics
    score = float(by_top1.best_model_score)
    assert f"testing the best checkpoint by val/top1: {by_top1.best_model_path} (val/top1 {score:.4f})" in caplog.text
    assert [type(cb) for cb in trainer.callbacks].count(BestCheckpointTest) == 1  # not again for the test itself


def test_without_a_best_checkpoint_the_end_weights_are_saved_and_tested_by_path(tmp_path):
    task = Toy(test_after_fit=True)
    trainer = toy_trainer(tmp_path, 2)
    with pytest.warns(UserWarning, match="no best checkpoint was saved: testing the weights at the end of training"):
        trainer.fit(task, datamodule=ToyData())
    assert trainer.ckpt_path == str(tmp_path / "checkpoints" / "end_of_fit.ckpt") and Path(trainer.ckpt_path).is_file()
    assert "test/top1" in trainer.callback_metrics


def test_without_test_after_fit_nothing_is_tested_unless_the_trainer_is_given_the_callback(tmp_path):
    trainer = toy_trainer(tmp_path, 2)
    trainer.fit(Toy(), datamodule=ToyData())
    assert trainer.ckpt_path is None and "test/top1" not in trainer.callback_metrics
    assert not any(isinstance(cb, BestCheckpointTest) for cb in trainer.callbacks)
    given = toy_trainer(tmp_path / "given", 2, BestCheckpointTest())
    with pytest.warns(UserWarning, match="no best checkpoint was saved"):
        given.fit(Toy(), datamodule=ToyData())
    assert "test/top1" in given.callback_metrics


@pytest.mark.parametrize(
    "name, home",
    [
        ("from_deprecated_calibrate", "polyattn_lightning.tasks.steps.convert"),
        ("logits_evaluation", "polyattn_lightning.tasks.evaluation"),
    ],
)
def test_a_name_the_old_task_base_had_is_its_new_home_s_with_one_warning(name, home):
    import importlib

    from polyattn_lightning.tasks import base

    with pytest.warns(FutureWarning, match=rf"tasks\.base\.{name} moved to {home}\.{name}") as caught:
        value = getattr(base, name)
    assert len([w for w in caught if w.category is FutureWarning]) == 1
    assert value is getattr(importlib.import_module(home), name)
