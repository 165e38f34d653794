"""``evaluate(models, out, tasks)``: every model evaluated the way its field does, side by side in one table.

Causal LMs (a ``save_pretrained`` folder or a run's checkpoint) run lm-evaluation-harness (:mod:`.language`);
vision runs run ``lightning test`` (:mod:`.vision`). A conversion run's checkpoint given alone brings its softmax
teacher (:func:`~.sources.teacher_of`). ``out`` (a new or empty folder) receives each model's results as
``<label>.json``, the table as ``table.md``, and the local tasks' files under ``tasks/``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .local_tasks import LOCAL_TASKS
from .sources import find, teacher_of
from .table import side_by_side


def default_text() -> Path:
    """The tiny Llama quickstart's held-out text: the test split of the generated stories (written on first use
    with ``configs/hf/data/generated_stories.yaml``'s defaults)."""
    from ..data import GeneratedStoriesData

    data = GeneratedStoriesData()
    data.prepare_data()
    return Path(data.files()["test"])


def check_out(out: Path) -> None:
    """``out`` must be new or empty: nothing the user had is overwritten."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty folder; give a new folder for the results")


def evaluate(
    models: Sequence[str],
    out: str | Path,
    tasks: Sequence[str] = LOCAL_TASKS,
    text: str | Path | None = None,
    limit: int | None = None,
    batch_size: int = 16,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Evaluate ``models`` (each ``[LABEL=]PATH``) and write the results into ``out``; returns ``label ->
    results`` (lm-eval's dict for a causal LM, ``{"results": {"test": metrics}}`` for a vision run) and prints the
    table. ``tasks``, ``text`` (the held-out text of the local tasks; default :func:`default_text`), ``limit``
    (documents per task), ``batch_size`` and ``seed`` apply to causal LMs."""
    out = Path(out)
    if not models:
        raise ConfigError("give at least one model: a save_pretrained folder, a .ckpt or a run folder")
    sources = [find(str(given)) for given in models]
    if len(sources) == 1 and (teacher := teacher_of(sources[0])) is not None:
        sources.insert(0, teacher)
    labels = [source.label for source in sources]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"two models have the same label ({', '.join(labels)}); name them: LABEL=PATH")
    kinds = {source.language for source in sources}
    if len(kinds) > 1:
        raise ConfigError("give causal LMs or vision runs, not both: they share no metric")
    check_out(out)
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit {limit}: expected a number of documents per task, at least 1")
    if kinds == {True}:
        from .language import evaluate_language, import_harness

        import_harness()  # a missing extra said before anything is written
        held_out = Path(text) if text is not None else default_text()
        results = evaluate_language(sources, list(tasks), out, held_out, limit, batch_size, seed)
    else:
        from .vision import evaluate_vision

        out.mkdir(parents=True, exist_ok=True)
        results = evaluate_vision(sources, out)
    table = side_by_side(results)
    (out / "table.md").write_text(table + "\n", encoding="utf-8")
    print(table)
    print(f"wrote {out}: {', '.join(f'{label}.json' for label in results)}, table.md")
    return results
