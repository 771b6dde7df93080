"""A shuffling sampler whose order is a function of (seed, epoch) and which can start mid-epoch.

`DataLoader(shuffle=True)` draws each epoch's order from torch's global generator, so the
order depends on everything else that drew random numbers before it. `ResumableSampler`
derives the permutation from `seed + epoch` alone, so epoch 7's order is the same in a
fresh process as in the one that was killed, and `start_at(i)` makes the next pass begin
at sample `i`: a resumed run continues with exactly the next batch without reading and
throwing away the batches it already trained on.

Cost: none per step (one `randperm` per epoch). `Trainer.fit(resume=...)` calls
`set_epoch` and `start_at` itself; with any other loader it replays the epoch's order from
the saved generator state and skips the batches already seen, reading them (slower, still
exact for loaders whose randomness comes from torch's generator and `num_workers=0`).

Example:
    >>> sampler = ResumableSampler(dataset, seed=0)
    >>> loader = DataLoader(dataset, batch_size=64, sampler=sampler)
    >>> torchspeed.fit(model, loader, epochs=3, checkpoint_dir="ckpt", resume="auto")
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

__all__ = ["ResumableSampler"]


class ResumableSampler(Sampler[int]):
    """Indices of `data_source` in an order fixed by (seed, epoch); `start_at` skips ahead once."""

    def __init__(self, data_source: Sized | int, *, shuffle: bool = True, seed: int = 0):
        self.n = data_source if isinstance(data_source, int) else len(data_source)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_at(self, index: int) -> None:
        """Make the next pass begin at position `index` of this epoch's order (then reset to 0)."""
        if not 0 <= index <= self.n:
            raise ValueError(f"start index {index} is outside the dataset of {self.n} samples")
        self._start = index

    def order(self, epoch: int | None = None) -> torch.Tensor:
        """The full order of `epoch` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)  # its own generator: the global one is left untouched
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        yield from self.order()[start:].tolist()

    def __len__(self) -> int:
        return self.n
