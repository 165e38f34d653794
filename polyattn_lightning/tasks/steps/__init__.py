"""The steps that prepare a model a task has built, one module each: :mod:`.switch`, :mod:`.convert`, :mod:`.lora`,
:mod:`.shard`. Each reads the task's hooks and hyperparameters and imports no task; the order they run in is
written in one place, ``tasks/preparation.py``."""
