"""Every task refuses, from Python, a keyword option its constructor does not take: one line naming it, the closest
option and every option the task takes, before anything is built; a task written outside the project (a subclass of
the base that does nothing for it) refuses the same way. Copying and unpickling a task still work."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest

from polyattn_lightning import tasks
from polyattn_lightning.errors import ConfigError, UnknownOptionError
from polyattn_lightning.tasks import ClassificationModule, TaskModule

TASKS = [getattr(tasks, name) for name in tasks.__all__ if isinstance(getattr(tasks, name), type)]
TASKS = [task for task in TASKS if issubclass(task, TaskModule) and task is not TaskModule]
TINY_VIT = dict(patch_size=8, embed_dim=8, depth=1, num_heads=1, mlp_ratio=1)


def test_every_task_of_the_package_is_checked():
    assert {task.__name__ for task in TASKS} == {
        "ClassificationModule",
        "DetectionModule",
        "HFCausalLM",
        "HFSequenceClassification",
        "LRAModule",
    }


@pytest.mark.parametrize("task", TASKS, ids=lambda task: task.__name__)
def test_a_task_refuses_an_unknown_option_in_one_line_listing_its_options(task):
    options = [name for name in inspect.signature(task.__init__).parameters if name != "self"]
    with pytest.raises(UnknownOptionError) as refused:
        task(attentio="poly3", foo=1)
    message = str(refused.value)
    assert isinstance(refused.value, ConfigError) and isinstance(refused.value, TypeError)
    assert message == (
        f"{task.__name__} has no options 'attentio' (did you mean 'attention'?), 'foo'; "
        f"its options: {', '.join(options)}"
    )
    assert "\n" not in message


def test_a_task_written_outside_the_project_refuses_the_same_way():
    class Probe(TaskModule):
        def __init__(self, width: int = 4, attention: str = "softmax"):
            super().__init__()
            self.save_hyperparameters()

    assert Probe(width=8).hparams.width == 8
    with pytest.raises(
        UnknownOptionError,
        match=r"^Probe has no option 'widht' \(did you mean 'width'\?\); its "
        r"options: width, attention$",
    ):
        Probe(widht=8)


def test_a_built_task_copies_and_unpickles():
    module = ClassificationModule(
        "vit_tiny_patch16_224", num_classes=3, img_size=16, model_kwargs=TINY_VIT, attention="relu"
    )
    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert type(clone) is ClassificationModule and clone.hparams == module.hparams
        assert clone.model.head.out_features == 3
