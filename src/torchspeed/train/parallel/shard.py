"""Each rank's share of the data under DistributedDataParallel (T31): DistributedSampler loaders,
evaluation shards that count every sample once, and shards of a plain list of batches.

The process group itself (ranks, set-up, collectives) is `distributed.py`; this module only
splits data by it.

Example:
    >>> loader = distributed_loader(loader)       # DistributedSampler; call loader.sampler.set_epoch(e)
    >>> val = shard_loader(val_loader, for_eval=True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from torchspeed.train.parallel.distributed import get_rank, get_world_size, is_distributed
from torchspeed.train.sampler import rebuild_loader

__all__ = ["distributed_loader", "shard_loader", "shard_batches"]

_T = TypeVar("_T")

def distributed_loader(loader: DataLoader, *, shuffle: bool | None = None, seed: int = 0,
                       drop_last: bool = False, rank: int | None = None,
                       world_size: int | None = None) -> DataLoader:
    """The same DataLoader, rebuilt with a `DistributedSampler`: each rank reads 1/world_size of the data.

    `shuffle` defaults to what the loader did (a RandomSampler shuffles; a ResumableSampler keeps
    its shuffle and seed). Every epoch needs
    `loader.sampler.set_epoch(epoch)` for a new shuffle (the Trainer does it). Without
    `drop_last` the sampler pads the last shard with repeated samples so every rank has the
    same number of batches (an uneven count would leave one rank waiting in all-reduce).
    Loaders that already use a DistributedSampler are returned as they are.

    Example:
        >>> loader = distributed_loader(DataLoader(ds, batch_size=64, shuffle=True, num_workers=4))
    """
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError("an IterableDataset cannot be split by DistributedSampler: shard it inside the dataset "
                         "with torch.distributed.get_rank()/get_world_size() (or torch.utils.data.get_worker_info())")
    if loader.batch_sampler is not None and type(loader.batch_sampler).__name__ != "BatchSampler":
        raise ValueError(f"the loader uses a custom batch_sampler ({type(loader.batch_sampler).__name__}), which "
                         "cannot be split automatically; build it on a DistributedSampler yourself")
    from torchspeed.train.sampler import ResumableSampler  # a (seed, epoch) order, like DistributedSampler's

    if isinstance(loader.sampler, ResumableSampler):
        shuffle = loader.sampler.shuffle if shuffle is None else shuffle
        seed = loader.sampler.seed
    if shuffle is None:
        if isinstance(loader.sampler, RandomSampler):
            shuffle = True
        elif isinstance(loader.sampler, SequentialSampler):
            shuffle = False
        else:
            raise ValueError(f"the loader uses a custom sampler ({type(loader.sampler).__name__}), which cannot be "
                             "split automatically; use torch.utils.data.DistributedSampler (or a distributed "
                             "version of your sampler) and call set_epoch each epoch")
    world_size = world_size or get_world_size()
    sampler = DistributedSampler(loader.dataset, num_replicas=world_size,
                                 rank=get_rank() if rank is None else rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    if loader.drop_last and loader.batch_size and len(sampler) < loader.batch_size:
        raise ValueError(f"{len(loader.dataset)} samples split between {world_size} processes leave "
                         f"{len(sampler)} per process, less than one batch of {loader.batch_size}: use a batch "
                         f"size of at most {len(sampler)} or fewer processes")
    return rebuild_loader(loader, sampler=sampler)



def shard_loader(loader: Any, *, for_eval: bool = False, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None) -> Any:
    """This rank's part of a training or evaluation loader (a DataLoader, a list of batches, or a
    loader with a `shard(rank, world_size, for_eval=, seed=)` method such as `DeviceLoader`).

    Training: `distributed_loader` (a DistributedSampler, equal batch counts on every rank).
    Evaluation: every world_size-th sample, in order, with no padding, so reduced metrics
    count each sample exactly once (ranks may get one batch more or less; evaluation has
    no collective inside the loop, so that is fine). A wrapper such as `DeviceLoader` splits
    the loader inside it with this same function and wraps the result again.

    `rank` and `world_size` default to the process group's; without one (and without them)
    the loader is returned as it is.

    Example:
        >>> train = shard_loader(train_loader, seed=0); val = shard_loader(val_loader, for_eval=True)
        >>> shard_loader(loader, rank=1, world_size=2)   # rank 1's half, no process group needed
    """
    if rank is None and world_size is None and not is_distributed():
        return loader
    rank = get_rank() if rank is None else rank
    world_size = world_size or get_world_size()
    if world_size == 1:
        return loader
    if callable(getattr(loader, "shard", None)):
        return loader.shard(rank, world_size, for_eval=for_eval, seed=seed)
    if isinstance(loader, DataLoader):
        if not for_eval:
            return distributed_loader(loader, seed=seed, rank=rank, world_size=world_size)
        if isinstance(loader.sampler, DistributedSampler) or isinstance(loader.dataset, IterableDataset):
            return loader
        if loader.batch_sampler is not None and type(loader.batch_sampler).__name__ != "BatchSampler":
            return loader
        ds = torch.utils.data.Subset(loader.dataset, range(rank, len(loader.dataset), world_size))
        return rebuild_loader(loader, dataset=ds)
    if isinstance(loader, (list, tuple)):
        return shard_batches(loader, rank=rank, world_size=world_size, even=not for_eval)
    raise ValueError(f"cannot split a {type(loader).__name__} between {world_size} processes: pass a "
                     "DataLoader (torchspeed adds a DistributedSampler), a list of batches, or a loader "
                     "with a shard(rank, world_size, for_eval=, seed=) method")


def shard_batches(batches: Sequence[_T], *, rank: int | None = None, world_size: int | None = None,
                  even: bool = True) -> list[_T]:
    """Rank `rank`'s share of a list of ready-made batches: every world_size-th batch.

    `even=True` (training) drops the remainder so every rank runs the same number of steps.

    Example:
        >>> shard_batches([b0, b1, b2, b3, b4], rank=1, world_size=2)   # [b1, b3]
    """
    rank = get_rank() if rank is None else rank
    world_size = world_size or get_world_size()
    if not even:
        return list(batches[rank::world_size])
    per_rank = len(batches) // world_size
    if per_rank == 0:
        raise ValueError(f"{len(batches)} batches cannot feed {world_size} processes: give at least one per process")
    return list(batches[rank::world_size][:per_rank])
