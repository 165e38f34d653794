"""``PolyattnCLI``: Lightning's CLI over this project's tasks, each of its steps handing one concern to its module.

In the order LightningCLI runs them: :meth:`~PolyattnCLI.parse_arguments` (the YAML pre-checks of
:mod:`.prechecks`, a checkpoint's run config of :mod:`.ckpt_path`, renamed options of :mod:`.parser`),
:meth:`~PolyattnCLI._parse_ckpt_path` (:mod:`.ckpt_path`), :meth:`~PolyattnCLI.before_instantiate_classes` (the
run's folder of :mod:`.runs`, the value checks of :mod:`.prechecks`), :meth:`~PolyattnCLI.instantiate_trainer` (the
standard callbacks of :mod:`.defaults`, the progress bar of :mod:`.console`) and :meth:`~PolyattnCLI._run_subcommand`
(:mod:`.console`, :mod:`.runs`). The parser and its defaults are :mod:`.parser` and :mod:`.defaults`;
:func:`~.dispatch.make_cli` wires them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from .. import data, tasks  # noqa: F401  (registers the short class names)
from ..callbacks.preemption import EXIT_INTERRUPTED, StopOnSignal
from ..callbacks.standard import OPT_IN_KEYS, merge_callbacks
from ..sharding import ShardedStrategy, build_later
from ..sharding.checkpoints import META_FILE
from .ckpt_path import keep_run_outputs, load_errors_named, saved_run_config, say_replaced, sharded_folder
from .config import as_list, component_class, init_args, resolve_task_defaults
from .console import default_progress_bar, say_where, say_written, without_version
from .defaults import add_defaults, batch_limits_read_as_counts, given_short_keys, standard_off
from .parser import renamed_options
from .prechecks import check_config, check_moved_configs, check_yaml_syntax
from .run_log import kept_for_run_log, run_log
from .runs import place_logs, removed_if_unstarted, resume_command, resumed_run_dir


class PolyattnCLI(LightningCLI):
    """LightningCLI with the project's defaults, its checks before any model is built, and its run folders."""

    def init_parser(self, **kwargs: Any):
        batch_limits_read_as_counts(self.trainer_class)  # before the parser reads the Trainer's signature
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        """The project's defaults and the standard callbacks' short keys (:func:`~.defaults.add_defaults`)."""
        add_defaults(parser)

    def parse_arguments(self, parser, args) -> None:
        """Parse, first reading :func:`~.ckpt_path.saved_run_config` in for ``validate``/``test``/``predict`` of a
        checkpoint given without a config; then, where the model's class renames init arguments (``renamed_args``),
        parse again with each deprecated key given on the command line read as its new one
        (:func:`~.parser.renamed_options`), so it overrides that one field where the config sets the new key.
        Lightning's warning about ``args`` given beside a command line stays out where those ``args`` are that
        command line with the saved config added."""
        self.given_args = (
            [str(arg) for arg in (sys.argv[1:] if args is None else args)] if not isinstance(args, dict) else []
        )
        check_moved_configs(self.given_args)
        check_yaml_syntax(self.given_args)
        saved = saved_run_config(self.given_args)
        if saved is not None:
            rank_zero_info(
                f"{self.given_args[0]}: no --config given: using {saved}, the config of the checkpoint's run"
            )
            args = self.given_args = [self.given_args[0], "--config", str(saved), *self.given_args[1:]]
        with warnings.catch_warnings():
            if saved is not None:  # the command line, completed here: not the mix of both that Lightning warns of
                warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")
            super().parse_arguments(parser, args)
        if not self.given_args:
            return
        subcommand = self.config.get("subcommand")
        model = (self.config[subcommand] if subcommand else self.config).get("model")
        rewritten, messages = renamed_options(self.given_args, getattr(component_class(model), "renamed_args", {}))
        if messages:
            for message in messages:
                warnings.warn(message, FutureWarning, stacklevel=1)
            self.given_args = rewritten
            self.config = parser.parse_args(rewritten)

    def _parse_ckpt_path(self) -> None:
        """``--ckpt_path`` probed first (:func:`~.ckpt_path.sharded_folder`: a missing path or a weight file stops
        the run here, before any model is built); a sharded folder's hyperparameters come from its ``meta.pt``, read
        the safe way as a file; a file's that cannot be read raise an error naming it
        (:func:`~.ckpt_path.load_errors_named`), and those that replace the config's are said, except where this
        run writes (:data:`~.ckpt_path.RUN_OUTPUTS`), which it keeps when given."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path:
            return super()._parse_ckpt_path()
        before = init_args(self.config[subcommand].model)
        folder = sharded_folder(ckpt_path)
        if folder is not None:
            self.config[subcommand].ckpt_path = str(folder / META_FILE)
            try:
                super()._parse_ckpt_path()  # LightningCLI's: torch.load(weights_only=True) of a file
            finally:
                self.config[subcommand].ckpt_path = str(folder)
            return keep_run_outputs(self.config[subcommand].model, before)
        with load_errors_named(ckpt_path):
            super()._parse_ckpt_path()
        keep_run_outputs(self.config[subcommand].model, before)
        say_replaced(ckpt_path, before, init_args(self.config[subcommand].model))

    def before_instantiate_classes(self) -> None:
        """The logger pointed at the run's folder (:func:`~.runs.place_logs`). With ``--ckpt_path``, build the model
        without its ``pretrained`` file: the checkpoint's weights replace those anyway, and resuming or evaluating a
        fine-tuned run must not need that file. The best checkpoint's monitor defaults to the task's. Then
        :func:`~.prechecks.check_config`, so a bad name or path stops the run before any model is built."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        place_logs(config, self.subcommand, getattr(self, "given_args", []))
        model_args = config.model.get("init_args") if hasattr(config.model, "get") else None
        if config.get("ckpt_path") and model_args is not None and model_args.get("pretrained"):
            model_args.pretrained = None
        resolve_task_defaults(config)
        check_config(config)

    def instantiate_classes(self) -> None:
        """Also tell the model which checkpoint's saved hyperparameters built it (``hparams_checkpoint``), so its
        errors can name that checkpoint rather than the config the values no longer come from. Under the sharded
        strategy the model is built later, in ``configure_model`` (:func:`~.sharding.build_later`). What the building
        says (a model build, a conversion, a kernel compilation) is kept for the run's ``run.log``, which opens once
        the trainer knows the run's folder (:func:`.run_log.kept_for_run_log`)."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        strategy = component_class(config.trainer.get("strategy"))
        sharded = isinstance(strategy, type) and issubclass(strategy, ShardedStrategy)
        with build_later() if sharded else contextlib.nullcontext(), kept_for_run_log() as self.early_records:
            super().instantiate_classes()
        ckpt_path = self.config[self.subcommand].get("ckpt_path") if self.subcommand else None
        if ckpt_path and self.model is not None:
            self.model.hparams_checkpoint = ckpt_path

    def instantiate_trainer(self, **kwargs: Any):
        """The trainer with the user's ``trainer.callbacks`` and the standard callbacks this run does not leave out
        (:func:`~.defaults.standard_off`), merged by their identity (:func:`~.callbacks.standard.merge_callbacks`,
        one info line per decision). A listed entry left out for its short key is removed from the config the run
        saves, and an opt-in callback that runs is named in its ``callbacks_on``, so that config resumes with the
        same callbacks."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        parser = self._parser(self.subcommand)
        given = given_short_keys(config, parser.get_defaults(), self.given_args)
        off = standard_off(config, given)
        config.callbacks_on = [key for key in OPT_IN_KEYS if key not in off]  # the saved config resumes with them
        standard = {key: self._get(self.config_init, key) for key in parser.callback_keys if key not in off}
        trainer_config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        listed, entries = as_list(trainer_config.get("callbacks")), as_list(config.trainer.get("callbacks"))
        settings = {key: init_args({"init_args": config.get(key)}) for key in standard}
        entry_args = [init_args(entry) for entry in entries] if len(entries) == len(listed) else [{}] * len(listed)
        merged = merge_callbacks(standard, list(zip(listed, entry_args)), settings, given)
        for message in merged.messages:
            rank_zero_info(message)
        if merged.dropped:
            config.trainer.callbacks = [entry for index, entry in enumerate(entries) if index not in merged.dropped]
        listed = [callback for index, callback in enumerate(listed) if index not in merged.dropped]
        trainer_config["callbacks"] = listed
        callbacks = [callback for key, callback in standard.items() if key not in merged.off]
        progress_bar = default_progress_bar(trainer_config, listed)
        # the bar first: it has stopped (and drawn its last frame) when the run summary prints, at teardown
        return self._instantiate_trainer(trainer_config, ([progress_bar] if progress_bar else []) + callbacks)

    def _run_subcommand(self, subcommand: str) -> None:
        """Say where the run writes, run it with its ``run.log`` (:mod:`.run_log`), then list what it wrote
        (:mod:`.console`). A run that fails before its first training step removes the log folder it created
        (:func:`~.runs.removed_if_unstarted`). ``fit``
        resuming in its own folder does not warn that its checkpoint folder is not empty; a Ctrl-C names the command
        that resumes (:class:`~.callbacks.StopOnSignal`), and one Lightning stopped on (before the first step, or a
        second one) exits with the same status 130, not Lightning's 1."""
        trainer = self.trainer
        log_dir = trainer.log_dir if trainer.logger is not None and rank_zero_only.rank == 0 else None
        log_dir = Path(log_dir) if log_dir else None  # fast_dev_run's DummyLogger has none
        ckpt_path = self.config[subcommand].get("ckpt_path")
        run_dir = resumed_run_dir(ckpt_path) if subcommand == "fit" else None
        resumed_here = run_dir is not None and log_dir is not None and run_dir.resolve() == log_dir.resolve()
        if subcommand != "fit":  # a checkpoint's ModelCheckpoint state names its run's folder: expected here
            warnings.filterwarnings("ignore", message=r".*dirpath has changed")
        if trainer.progress_bar_callback is not None:
            trainer.progress_bar_callback.get_metrics = without_version(trainer.progress_bar_callback.get_metrics)
        for callback in trainer.callbacks:
            if isinstance(callback, StopOnSignal) and self.given_args:
                callback.resume_command = functools.partial(resume_command, self.given_args)
        try:
            with (
                removed_if_unstarted(log_dir, trainer),
                run_log(log_dir, self.early_records),
                warnings.catch_warnings(),
            ):
                say_where(subcommand, log_dir, ckpt_path if resumed_here else None)
                if resumed_here:  # ModelCheckpoint's setup warns about any folder with files in it
                    own = re.escape(os.path.join(trainer.log_dir, "checkpoints"))
                    warnings.filterwarnings("ignore", message=rf"Checkpoint directory {own} exists and is not empty")
                super()._run_subcommand(subcommand)
        except SystemExit as error:
            if error.code == 1 and isinstance(error.__context__, KeyboardInterrupt):
                raise SystemExit(EXIT_INTERRUPTED) from None  # Lightning's sys.exit(1) after its Ctrl-C shutdown
            raise
        say_written(subcommand, log_dir)  # after run.log is closed: it lists that file too
