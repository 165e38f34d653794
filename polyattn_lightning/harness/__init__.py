"""Evaluating trained and converted models the way their fields do (``polyattn eval``): causal LMs through
lm-evaluation-harness on local tasks (:mod:`.local_tasks`) or any task it knows, vision runs through ``lightning
test``, the models side by side (:mod:`.table`). The call is :func:`~.evaluate.evaluate`."""

from .evaluate import evaluate
from .local_tasks import CHOICE, LOCAL_TASKS, PERPLEXITY, choice_items, write_tasks
from .table import side_by_side

__all__ = ["CHOICE", "LOCAL_TASKS", "PERPLEXITY", "choice_items", "evaluate", "side_by_side", "write_tasks"]
