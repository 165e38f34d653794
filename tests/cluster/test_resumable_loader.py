"""The resumable training loader, without a trainer."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, Subset

from polyattn_lightning.data.resumable import ResumableDataLoader


class CountingDataset(Dataset):
    def __init__(self, size: int):
        self.size, self.loaded = size, 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        self.loaded += 1
        return index


class RandomDraws(Dataset):
    """Each sample is its index and one draw from each global RNG, as a random augmentation makes."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, random.random(), np.random.rand(), torch.rand(()).item()], dtype=torch.float64)


def rng_states() -> tuple:
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()


def draws_by_index(loader, number: int) -> dict[int, list[float]]:
    return {int(row[0]): row[1:] for batch in epoch(loader, number) for row in batch}


def epoch(loader, number: int) -> list[list[int]]:
    loader.batch_sampler.sampler.set_epoch(number)  # Lightning does this before every epoch
    return [batch.tolist() for batch in loader]


def test_resuming_mid_epoch_continues_the_same_order_without_loading_the_skipped_batches():
    reference = epoch(ResumableDataLoader(CountingDataset(50), batch_size=4, shuffle=True, drop_last=True), 3)

    interrupted = ResumableDataLoader(CountingDataset(50), batch_size=4, shuffle=True, drop_last=True)
    interrupted.batch_sampler.sampler.set_epoch(3)
    batches = iter(interrupted)
    first = [next(batches).tolist() for _ in range(5)]
    state = interrupted.state_dict()
    assert state == {"epoch": 3, "batches_done": 5}

    data = CountingDataset(50)
    resumed = ResumableDataLoader(data, batch_size=4, shuffle=True, drop_last=True)
    resumed.load_state_dict(state)
    rest = epoch(resumed, 3)
    assert first + rest == reference
    assert data.loaded == len(rest) * 4
    assert resumed.state_dict() == {"epoch": 3, "batches_done": 12}  # a second resume in this epoch stays aligned
    assert epoch(resumed, 4) == epoch(ResumableDataLoader(CountingDataset(50), batch_size=4, shuffle=True, drop_last=True), 4)


def test_a_finished_epochs_state_does_not_skip_into_the_next_epoch():
    loader = ResumableDataLoader(CountingDataset(20), batch_size=4, shuffle=True)
    loader.load_state_dict({"epoch": 1, "batches_done": 3})  # e.g. epoch 1 cut short by limit_train_batches
    assert len(epoch(loader, 2)) == 5


def test_one_process_sees_the_global_batches_of_two_ranks(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")  # seed_everything(7); Lightning seeds DistributedSampler with it
    dataset, batch = CountingDataset(40), 4
    one = epoch(ResumableDataLoader(dataset, batch_size=2 * batch, shuffle=True), 5)
    ranks = []
    for rank in range(2):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=7)
        sampler.set_epoch(5)
        ranks.append(torch.tensor(list(sampler)).split(batch))
    assert [sorted(b) for b in one] == [sorted(r0.tolist() + r1.tolist()) for r0, r1 in zip(*ranks)]


@pytest.mark.slow  # loader worker processes
def test_resuming_mid_epoch_with_persistent_workers_skips_the_finished_batches():
    def loader(data):
        return ResumableDataLoader(data, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)

    reference = epoch(loader(CountingDataset(40)), 1)
    resumed = loader(CountingDataset(40))
    resumed.load_state_dict({"epoch": 1, "batches_done": 6})  # DataLoader asks its batch sampler twice here
    assert epoch(resumed, 1) == reference[6:]
    assert epoch(resumed, 2) == epoch(loader(CountingDataset(40)), 2)  # the persistent workers' next epoch is whole


def test_a_samples_random_draws_depend_on_seed_epoch_and_index_only(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "3")
    before = rng_states()
    by_4 = draws_by_index(ResumableDataLoader(RandomDraws(), batch_size=4, shuffle=True), 0)
    assert rng_states() == before  # loading in the main process leaves dropout's, drop path's and Mixup's RNGs alone
    random.random(), np.random.rand(), torch.rand(())  # nor does the main process's RNG reach the samples
    assert draws_by_index(ResumableDataLoader(RandomDraws(), batch_size=6, shuffle=True), 0) == by_4
    assert len({tuple(draws) for draws in by_4.values()}) == 24  # every sample its own draws
    next_epoch = draws_by_index(ResumableDataLoader(RandomDraws(), batch_size=4, shuffle=True), 1)
    assert all(next_epoch[i] != by_4[i] for i in by_4)
    monkeypatch.setenv("PL_GLOBAL_SEED", "4")
    other_seed = draws_by_index(ResumableDataLoader(RandomDraws(), batch_size=4, shuffle=True), 0)
    assert all(other_seed[i] != by_4[i] for i in by_4)


def test_a_wrapped_subset_is_indexed_by_sample_not_by_seeded_key():
    # Subset has __getitems__, which DataLoader prefers: it must not be reached through the seeding wrapper
    subset = Subset(RandomDraws(), list(range(4, 16)))
    rows = [row for batch in ResumableDataLoader(subset, batch_size=5, shuffle=True) for row in batch]
    assert sorted(int(row[0]) for row in rows) == list(range(4, 16))


@pytest.mark.slow  # loader worker processes
def test_a_samples_random_draws_do_not_depend_on_the_worker_that_loads_it():
    in_process = draws_by_index(ResumableDataLoader(RandomDraws(), batch_size=4, shuffle=True), 2)
    workers = ResumableDataLoader(RandomDraws(), batch_size=3, shuffle=True, num_workers=2, persistent_workers=True)
    assert draws_by_index(workers, 2) == in_process

