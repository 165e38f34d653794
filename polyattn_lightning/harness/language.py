"""Causal LMs through lm-evaluation-harness (the ``[eval]`` extra), in this process: the model is loaded with the
project's attention switched back on (:func:`load_causal_lm`), wrapped in lm-eval's ``HFLM`` and run with
``simple_evaluate`` on the tasks asked for: the local ones (:mod:`.local_tasks`, read from files: nothing is
downloaded) and any task lm-eval knows (they download their data: they need the network).

:func:`evaluate_language` writes each model's results as lm-eval's own CLI does (``simple_evaluate``'s dict without
the per-sample records, numpy values made plain, ``json.dumps(indent=2, default=handle_non_serializable)``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UserInputError
from ..waits import Wait
from .local_tasks import LOCAL_TASKS, write_tasks
from .sources import Source, tokenizer_folder

#: The pip extra that installs lm-evaluation-harness.
EXTRA = 'pip install -e ".[eval]"'
#: lm-eval's warnings on a model passed as an object, as this command always does (no user can act on them).
MODEL_OBJECT_NOTES = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model")


class _DropModelObjectNotes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(MODEL_OBJECT_NOTES)


_DROP_MODEL_OBJECT_NOTES = _DropModelObjectNotes()  # one instance: adding it again is a no-op

#: The environment that keeps ``datasets`` and the Hub from reaching the network (local tasks only).
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def import_harness():
    """lm-eval's ``(HFLM, simple_evaluate, TaskManager, handle_non_serializable)``; a missing extra said in one
    line."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import handle_non_serializable
    except ImportError as err:
        raise UserInputError(f"polyattn eval of a language model needs lm-evaluation-harness: {EXTRA} ({err})")
    return HFLM, simple_evaluate, TaskManager, handle_non_serializable


def check_causal(source: Source) -> None:
    """A saved folder must hold a causal LM (a checkpoint's task class says so: :attr:`Source.language`)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if source.kind != "folder":
        return
    config = AutoConfig.from_pretrained(source.path, local_files_only=True)
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not causal & set(config.architectures or []):
        raise ConfigError(
            f"{source.path}: a {', '.join(config.architectures or [config.model_type])} is not a causal LM; "
            "polyattn eval runs lm-eval on causal LMs (a vision run: give its checkpoint)"
        )


def load_causal_lm(source: Source):
    """The model (switched to its activation, eval mode) and its tokenizer."""
    from transformers import AutoModelForCausalLM

    from ..models.hf_pretrained import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_folder(source), f"{source.label}: tokenizer")
    if source.kind == "folder":
        from ..attention.switch.hf import load_pretrained

        model = load_pretrained(source.path, AutoModelForCausalLM)
    else:
        from ..tasks import HFCausalLM

        model = HFCausalLM.load_from_checkpoint(source.path, map_location="cpu", weights_only=True).model
    return model.eval(), tokenizer


def check_tasks(manager, tasks: list[str]) -> None:
    """Every task name one lm-eval knows."""
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"--tasks: lm-eval knows no task {', '.join(unknown)}; the local tasks are {', '.join(LOCAL_TASKS)}, "
            "any other is one of `lm-eval ls tasks`"
        )


def evaluate_language(
    sources: list[Source],
    tasks: list[str],
    out: Path,
    text: Path,
    limit: int | None = None,
    batch_size: int = 16,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Run lm-eval's ``tasks`` on every model; ``out/<label>.json`` holds each one's results (lm-eval's format),
    ``out/tasks/`` the local tasks' files (only local tasks: lm-eval's own are not indexed, and no network is
    reached: :func:`offline`). Task names are checked before anything is written."""
    HFLM, simple_evaluate, TaskManager, handle_non_serializable = import_harness()
    local = [task for task in tasks if task in LOCAL_TASKS]
    others = [task for task in tasks if task not in LOCAL_TASKS]
    for source in sources:  # models and task names checked before anything is written
        check_causal(source)
    if others:
        with Wait("indexing lm-eval's tasks", why="thousands of task files, read once", after=10):
            manager = TaskManager()
        check_tasks(manager, others)
    if local:
        write_tasks(out / "tasks", text, local, seed)  # a bad --text refused before it writes
        with Wait("indexing lm-eval's tasks and the local ones", why="thousands of task files", after=10):
            manager = TaskManager(include_path=str(out / "tasks"), include_defaults=bool(others))
    out.mkdir(parents=True, exist_ok=True)
    only_local = not others
    with offline() if only_local else contextlib.nullcontext():
        return evaluate_models(sources, tasks, manager, out, limit, batch_size, seed)


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """``datasets`` and the Hub kept from the network while the body runs: the environment (:data:`OFFLINE`) and
    the flags both libraries read from it on import."""
    import datasets.config
    import huggingface_hub.constants

    saved = {name: os.environ.get(name) for name in OFFLINE}
    flags = datasets.config.HF_DATASETS_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    os.environ.update(OFFLINE)
    datasets.config.HF_DATASETS_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_DATASETS_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = flags
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def evaluate_models(sources, tasks, manager, out, limit, batch_size, seed) -> dict[str, dict[str, Any]]:
    """``simple_evaluate`` of every model on the tasks ``manager`` holds; each result written as lm-eval does."""
    HFLM, simple_evaluate, _, handle_non_serializable = import_harness()
    logging.getLogger(HFLM.__module__).addFilter(_DROP_MODEL_OBJECT_NOTES)
    results = {}
    for source in sources:
        with Wait(f"lm-eval on {source.label}", why=f"loading it, then {', '.join(tasks)} ({source.path})", after=10):
            model, tokenizer = load_causal_lm(source)
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(model.device))
            result = simple_evaluate(
                model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=False, random_seed=seed,
                numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            )  # fmt: skip
        result.pop("samples", None)
        result["config"]["model"] = str(source.path)
        (out / f"{source.label}.json").write_text(
            json.dumps(result, indent=2, default=handle_non_serializable, ensure_ascii=False), encoding="utf-8"
        )
        results[source.label] = result
    return results
