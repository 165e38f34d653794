"""The evaluation loaders without a trainer: each sample once across ranks, and under a sharded strategy the same
number of batches on every rank, the short ranks' last one a padding batch (the 2-rank runs: tests/sharding)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import Dataset

from polyattn_lightning.data.evaluation import PaddingBatch, eval_loader, eval_sampler
from polyattn_lightning.errors import ConfigError
from polyattn_lightning.sharding import ShardedStrategy


class Indices(Dataset):
    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def ranks(world: int, strategy) -> list[SimpleNamespace]:
    return [SimpleNamespace(world_size=world, global_rank=rank, strategy=strategy) for rank in range(world)]


def test_ddp_splits_an_odd_set_across_ranks_without_repeats_or_padding():
    dataset = Indices(181)
    shares = [list(eval_sampler(dataset, trainer, 4)) for trainer in ranks(2, DDPStrategy())]
    assert [len(s) for s in shares] == [91, 90]
    assert sorted(shares[0] + shares[1]) == list(range(181))
    assert eval_sampler(dataset, SimpleNamespace(world_size=1, global_rank=0)) is None
    loaders = [eval_loader(Indices(9), trainer, batch_size=4) for trainer in ranks(2, DDPStrategy())]
    assert [len(loader) for loader in loaders] == [2, 1]  # under DDP a rank may finish first: its forward is local


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_ranks_make_the_same_number_of_batches_and_count_each_sample_once(world):
    strategy = ShardedStrategy(process_group_backend="gloo")
    padded_somewhere = 0
    for size in range(world, 40):
        for batch_size in range(1, 7):
            loaders = [eval_loader(Indices(size), trainer, batch_size=batch_size) for trainer in ranks(world, strategy)]
            passes = [list(loader) for loader in loaders]
            assert len({len(batches) for batches in passes}) == 1, (size, batch_size)
            assert all(len(loader) == len(batches) for loader, batches in zip(loaders, passes))
            real = [
                int(i) for batches in passes for batch in batches if not isinstance(batch, PaddingBatch) for i in batch
            ]
            assert sorted(real) == list(range(size)), (size, batch_size)
            for batches in passes:
                padding = [i for i, batch in enumerate(batches) if isinstance(batch, PaddingBatch)]
                assert padding in ([], [len(batches) - 1]), (size, batch_size)  # at most one, the last
                assert all(batches[i].batch.tolist() == [0] for i in padding)  # one sample: its forward is cheap
                padded_somewhere += bool(padding)
    assert padded_somewhere  # the uneven case is among them: one rank makes one batch more than another


def test_a_split_smaller_than_the_world_size_is_a_one_line_error():
    with pytest.raises(ConfigError) as refused:
        eval_loader(Indices(3), SimpleNamespace(world_size=4, global_rank=3, strategy=DDPStrategy()), batch_size=2)
    assert str(refused.value) == (
        "an evaluation split of 3 samples on 4 ranks: each rank needs one (Lightning's UnrepeatedDistributedSampler); "
        "evaluate on fewer ranks or on a larger split"
    )


def test_evaluation_loaders_leave_the_global_rng_alone():
    states = random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()
    batches = list(eval_loader(Indices(10), None, batch_size=4))
    # a plain DataLoader draws its worker seed from the global torch RNG at every pass
    assert (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()) == states
    assert torch.cat(batches).tolist() == list(range(10))
