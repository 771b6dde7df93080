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
exact for loaders whose randomness comes from torch's generators and `num_workers=0`).

`DataPosition` is where a run stands in its data (epoch, batch, the generator states the
epoch's order was drawn from: the global ones and the loader's own `generator`, its sampler's
and its batch sampler's sampler's, e.g. `DataLoader(shuffle=True, generator=g)` or
`RandomSampler(ds, generator=g)`; those own generators' states when the checkpoint was written,
for a resume at an epoch's start; and a `StatefulDataLoader`'s own state when the loader has
one: torchdata's loader resumes from its `state_dict()` without replaying anything, and
streaming/IterableDataset loaders that support it resume exactly too).

`iter_batches` / `take_batches` are the one batch reader of the tuners and the plan's probes: a
Dataset is batched with its own seeded generator, a short loader can be cycled, and every RNG
(the global ones, the loader's generators) is left as it was, so measuring changes neither the
data order nor the randomness of the run that follows.

Example:
    >>> sampler = ResumableSampler(dataset, seed=0)
    >>> loader = DataLoader(dataset, batch_size=64, sampler=sampler)
    >>> torchspeed.fit(model, loader, epochs=3, checkpoint_dir="ckpt", resume="auto")
"""

from __future__ import annotations

import contextlib
import itertools

from collections.abc import Iterable, Iterator, Sized

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from torchspeed.train.in_memory import sliced_loader
from torchspeed.train.state.rng import capture_rng_state, generator_states, restore_rng_state, set_generator_states

__all__ = ["ResumableSampler", "DataPosition", "is_stateful_loader", "loader_length", "set_epoch", "rebuild_loader", "take_batches", "iter_batches", "keep_rng"]

_KEEP = object()


def rebuild_loader(loader: DataLoader, *, dataset=_KEEP, batch_size=_KEEP, sampler=_KEEP,
                   replace_batch_sampler: bool = False, **settings) -> DataLoader:
    """A copy of `loader` with the given settings changed and every other one kept (collate_fn, workers,
    pin_memory and its device, timeout, worker_init_fn, multiprocessing context, generator, drop_last).
    The one home of rebuilding a DataLoader: the tuners (another batch size or worker count) and DDP
    (a DistributedSampler per rank) both come here. A custom batch_sampler is an error unless
    `replace_batch_sampler` (plain batches of `batch_size` instead: the doctor's measuring copy)."""
    custom = type(loader.batch_sampler) is not BatchSampler and loader.batch_sampler is not None
    if custom and not replace_batch_sampler:
        raise ValueError(f"the DataLoader uses a custom batch_sampler ({type(loader.batch_sampler).__name__}); "
                         "it cannot be rebuilt with another batch size, worker count or sampler here: build "
                         "that DataLoader yourself (or pass batch_size=None to the tuners)")
    kw = dict(num_workers=loader.num_workers, pin_memory=loader.pin_memory, timeout=loader.timeout,
              worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
              generator=loader.generator, collate_fn=loader.collate_fn, drop_last=loader.drop_last,
              batch_size=loader.batch_size if batch_size is _KEEP else batch_size)
    if getattr(loader, "pin_memory_device", ""):
        kw["pin_memory_device"] = loader.pin_memory_device
    if loader.num_workers > 0:
        kw.update(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)
    kw.update(settings)
    if kw["num_workers"] == 0:
        kw.pop("prefetch_factor", None)
        kw.pop("persistent_workers", None)
    data = loader.dataset if dataset is _KEEP else dataset
    if not isinstance(data, IterableDataset):
        kw["sampler"] = (loader.sampler if dataset is _KEEP else None) if sampler is _KEEP else sampler
    return DataLoader(data, **kw)


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


def is_stateful_loader(loader) -> bool:
    """True for loaders that save and restore their own position (torchdata's StatefulDataLoader)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class DataPosition:
    """Where training stands in its data, and how to get back there exactly after a restart.

    `epoch_iter(loader, skip)` returns the iterator for the current epoch positioned after
    `skip` batches: a StatefulDataLoader loads its saved state; a `ResumableSampler` starts
    there; any other loader replays the epoch's order from the saved generator states (the
    global ones and the loader's own) and reads and drops the batches already trained on. A
    resume at an epoch's start (`skip` 0) first puts the loader's own generators back as they
    were when the checkpoint was written, so the epoch draws the order the interrupted run would have.
    """

    def __init__(self, *, keep_rng: bool):
        self.keep_rng = keep_rng  # capture the generator state at each epoch start (only when checkpointing)
        self.epoch = 0
        self.batch = 0              # micro-batches consumed in this epoch
        self.epoch_rng: dict | None = None
        self.epoch_loader_rng: dict | None = None  # the loader's own generators at the epoch's start
        self.loader_rng: dict | None = None        # ... as a checkpoint left them (used by the next epoch_iter)
        self.loader_state: dict | None = None  # a stateful loader's state after `batch` batches
        self._states: dict[int, dict] = {}
        self._stateful = None
        self._gens: dict[str, torch.Generator] = {}

    def epoch_iter(self, loader: Iterable, skip: int) -> Iterator:
        self._stateful = loader if is_stateful_loader(loader) else None
        self._states = {}
        self._gens = _named_generators(loader)
        saved, self.loader_rng = self.loader_rng, None  # a resume's: applied once, by its first epoch
        if not skip:  # a resume at an epoch's start: the loader's generators as the checkpoint left them
            set_generator_states(self._gens, saved)
        if self._stateful is not None:
            if skip and self.loader_state is not None:
                self._stateful.load_state_dict(self.loader_state)
            return self._tap(iter(self._stateful), skip)
        if not skip:
            # The loader's order (DataLoader(shuffle=True)) is drawn now, from the global generator or the
            # loader's own: keep their states.
            self.epoch_rng = capture_rng_state() if self.keep_rng else None
            self.epoch_loader_rng = generator_states(self._gens) if self.keep_rng else None
            return iter(loader)
        at_checkpoint = capture_rng_state()
        if self.epoch_rng is not None:
            restore_rng_state(self.epoch_rng)  # replay the epoch's order exactly as it was drawn
        set_generator_states(self._gens, self.epoch_loader_rng)  # the replay leaves them where the run had them
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        batch_size = getattr(loader, "batch_size", None)
        if isinstance(sampler, ResumableSampler) and batch_size:
            sampler.start_at(min(skip * batch_size, len(sampler)))  # no reading: the sampler starts there
            it = iter(loader)
        else:
            it = iter(loader)
            for _ in range(skip):  # any other loader: read and drop the batches already trained on
                if next(it, None) is None:
                    break
        restore_rng_state(at_checkpoint)  # the global generators continue from where the checkpoint left them
        return it

    def _tap(self, it: Iterator, start: int) -> Iterator:
        # The state after each batch handed out, by count: a prefetcher may read one batch ahead of training.
        k = start
        for batch in it:
            k += 1
            self._states[k] = self._stateful.state_dict()
            self._states.pop(k - 4, None)
            yield batch

    def advance(self) -> None:
        self.batch += 1

    def start_epoch(self, epoch: int, skip: int) -> None:
        self.epoch, self.batch = epoch, skip

    def state_dict(self) -> dict:
        loader_state = self._states.get(self.batch) if self._stateful is not None and self.batch else None
        return {"epoch": self.epoch, "batch_in_epoch": self.batch, "epoch_rng": self.epoch_rng,
                "epoch_loader_rng": self.epoch_loader_rng, "loader_state": loader_state,
                "loader_rng": generator_states(self._gens) if self.keep_rng and not self.batch else None}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch_in_epoch"])
        self.epoch_rng = state.get("epoch_rng")
        self.epoch_loader_rng = state.get("epoch_loader_rng")  # None in a checkpoint from before they were kept
        self.loader_rng = state.get("loader_rng")
        self.loader_state = state.get("loader_state")


def loader_length(loader: Iterable, *, max_steps: int | None = None) -> int | None:
    """Batches per epoch, or None for a loader without len() (streaming, IterableDataset) when
    `max_steps` bounds the run; raises a clear error when neither is known or the loader is empty."""
    try:
        n = len(loader)  # type: ignore[arg-type]
    except TypeError:
        if max_steps:
            return None
        raise TypeError(f"the training loader ({type(loader).__name__}) has no len(), so the run has no length: "
                        "pass max_steps=N (optimizer steps) to train on a streaming or IterableDataset loader") from None
    if n == 0:
        raise ValueError("the training loader is empty: check the dataset path and the batch size")
    return n


def set_epoch(loader, epoch: int) -> None:
    """Tell the loader's sampler (DistributedSampler, ResumableSampler) and batch sampler (BatchRamp)
    which epoch starts."""
    for sampler in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


def _named_generators(loader) -> dict[str, torch.Generator]:
    """The loader's own generators by role (the loader's, its sampler's, its batch sampler's sampler's), each once."""
    found: dict[str, torch.Generator] = {}
    batch_sampler = getattr(loader, "batch_sampler", None)
    for name, obj in (("loader", loader), ("sampler", getattr(loader, "sampler", None)),
                      ("batch_sampler.sampler", getattr(batch_sampler, "sampler", None))):
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not h for h in found.values()):
            found[name] = g
    return found


def _loader_generators(loader) -> list[torch.Generator]:
    return list(_named_generators(loader).values())


@contextlib.contextmanager
def keep_rng(loader=None):
    """Every RNG as it was afterwards: the global ones and the loader's own generators (its sampler's too), so
    reading batches for a measurement does not change the data order or the randomness of the run that follows."""
    gens = _loader_generators(loader) if loader is not None else []
    saved = [g.get_state() for g in gens]
    rng = capture_rng_state()
    try:
        yield
    finally:
        for g, st in zip(gens, saved):
            g.set_state(st)
        restore_rng_state(rng)


def _as_loader(data, batch_size: int | None, seed: int, what: str):
    from torch.utils.data import Dataset

    if not isinstance(data, Dataset) or isinstance(data, IterableDataset):
        return data  # a DataLoader, or any iterable of batches: read as it gives them
    if not batch_size or batch_size < 1:
        raise ValueError(f"{what} is a Dataset, not a loader: pass a positive batch_size to batch it (got {batch_size})")
    return DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=len(data) > batch_size,
                      generator=torch.Generator().manual_seed(seed))


def iter_batches(data, *, batch_size: int | None = None, seed: int = 0, cycle: bool = True,
                 what: str = "the training loader") -> Iterator:
    """The batches of `data`, one at a time: the one batch reader of the tuners and the plan's probes.

    A map-style Dataset is batched here (`batch_size`, shuffled by its own generator seeded with `seed`,
    the last short batch dropped when there is more than one); a DataLoader or any iterable is read as it
    gives its batches. `cycle`: start over at its end (it is shorter than the batches wanted). Every RNG is
    left as it was: the global ones are put back around each read (a shuffling loader draws its order from
    them), the loader's own generators when the reader is closed or dropped. A DataLoader over tensors in
    memory is read as index slices (`in_memory.sliced_loader`: the same batches in the same order, no
    per-sample collate), as the run reads it. A pass that gives no batch is a ValueError naming `what`."""
    loader = _as_loader(data, batch_size, seed, what)
    gens = _loader_generators(loader)
    saved = [g.get_state() for g in gens]
    served = sliced_loader(loader, torch.device("cpu"))  # tensors in memory: the same batches as index slices
    try:
        while True:
            empty = True
            it = _kept(lambda: iter(served))
            while (batch := _kept(lambda: next(it, _END))) is not _END:
                empty = False
                yield batch
            if empty:
                raise ValueError(f"{what} gave no batches: check the dataset and batch size")
            if not cycle:
                return
    finally:
        for g, st in zip(gens, saved):
            g.set_state(st)


_END = object()


def _kept(read):
    rng = capture_rng_state()
    try:
        return read()
    finally:
        restore_rng_state(rng)


def take_batches(data, n: int, *, batch_size: int | None = None, seed: int = 0, cycle: bool = False,
                 what: str = "the training loader") -> list:
    """The first `n` batches of `data` (`iter_batches`: a Dataset is batched, `cycle` starts over at the end,
    every RNG is left as it was): the plan's probes and the tuners take their batches here."""
    reader = iter_batches(data, batch_size=batch_size, seed=seed, cycle=cycle, what=what)
    try:
        return list(itertools.islice(reader, n))
    finally:
        reader.close()
