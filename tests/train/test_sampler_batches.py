"""The one batch reader (train/sampler.iter_batches, take_batches): a Dataset batched with a seeded generator,
cycling when the data is shorter than the batches wanted, a clear error when it gives none, and every RNG as
it was, the global ones and the loader's own generator."""

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.train.sampler import iter_batches, take_batches
from torchspeed.tune.lr import find_lr
from torchspeed.tune.optimizer_trial import compare_optimizers


def _data(n=40):
    return TensorDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n) % 3)


def _rng():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def _same_rng(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])


def test_a_dataset_is_batched_with_its_own_seeded_shuffle_and_cycled():
    ds = _data(40)
    a = take_batches(ds, 6, batch_size=16, seed=1, cycle=True)  # 2 full batches a pass (the short one dropped)
    assert len(a) == 6 and all(x.shape == (16, 1) for x, _ in a)
    first = torch.cat([x for x, _ in a[:2]]).flatten()
    assert len(set(first.tolist())) == 32 and not torch.equal(first, torch.arange(32).float())  # shuffled
    again = take_batches(ds, 6, batch_size=16, seed=1, cycle=True)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, again))  # the seed fixes the order
    other = take_batches(ds, 2, batch_size=16, seed=2)
    assert not torch.equal(other[0][0], a[0][0])
    assert len(take_batches(ds, 6, batch_size=16, seed=1)) == 2  # without cycle: what one pass has


def test_every_rng_is_left_as_it_was():
    # A DataLoader that shuffles with the global generator, and one with its own: reading changes neither.
    torch.manual_seed(0)
    before = _rng()
    take_batches(DataLoader(_data(), batch_size=8, shuffle=True), 9, cycle=True)
    assert _same_rng(before, _rng())
    g = torch.Generator().manual_seed(5)
    loader = DataLoader(_data(), batch_size=8, shuffle=True, generator=g)
    state = g.get_state()
    take_batches(loader, 7, cycle=True)
    assert torch.equal(g.get_state(), state)


def test_the_lazy_reader_keeps_the_callers_own_draws_and_undoes_only_its_own():
    torch.manual_seed(0)
    loader = DataLoader(_data(), batch_size=8, shuffle=True)
    reader = iter_batches(loader)
    mine = []
    for _ in range(7):  # past one pass: the loader draws a new order from the global generator each pass
        next(reader)
        mine.append(torch.rand(1))  # the caller's own randomness between reads
    reader.close()
    torch.manual_seed(0)
    expected = [torch.rand(1) for _ in range(7)]
    assert all(torch.equal(a, b) for a, b in zip(mine, expected))


def test_no_batches_is_a_clear_error_naming_the_caller():
    with pytest.raises(ValueError, match="the training loader gave no batches: check the dataset and batch size"):
        take_batches([], 3)
    with pytest.raises(ValueError, match="the data for compare_optimizers gave no batches"):
        compare_optimizers(torch.nn.Linear(1, 3), [], lr=1e-3, steps=2, eval_batches=1)
    with pytest.raises(ValueError, match="the data for find_lr gave no batches"):
        find_lr(torch.nn.Linear(1, 3), [], num_steps=10, progress=False)
    with pytest.raises(ValueError, match="pass a positive batch_size"):
        take_batches(_data(), 2)


def test_tensors_in_memory_are_read_as_the_loaders_own_batches_without_a_per_sample_read(monkeypatch):
    """The plan's probes and the tuners read a DataLoader over tensors as index slices, as the run does: the
    batches the DataLoader gives, in its order, and no `__getitem__` per sample."""
    expected = [b for b in DataLoader(_data(), batch_size=8, shuffle=True,
                                      generator=torch.Generator().manual_seed(4))][:3]
    calls = []
    real = TensorDataset.__getitem__
    monkeypatch.setattr(TensorDataset, "__getitem__", lambda self, i: calls.append(i) or real(self, i))
    got = take_batches(DataLoader(_data(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(4)), 3)
    assert calls == []
    assert all(isinstance(b, list) and torch.equal(b[0], e[0]) and torch.equal(b[1], e[1])
               for b, e in zip(got, expected))
