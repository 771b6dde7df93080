"""The distributed helpers in one process: sharding, unwrapping, LR scaling, and DataParallel (T31)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchspeed
from torchspeed.train.parallel.distributed import (convert_sync_batchnorm, is_rank_zero, maybe_init_distributed,
                                                   rank_zero_only, reduce_metrics, scale_lr_world_size)
from torchspeed.train.parallel.shard import distributed_loader, shard_batches
from torchspeed.train.sampler import ResumableSampler
from torchspeed.train.wrappers import unwrap_model


def _tiny(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))


def _data(n=24):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 2, 2, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_data_parallel_is_unwrapped_with_a_warning_and_trains_the_inner_module(caplog):
    loader = DataLoader(_data(), batch_size=6)
    kw = dict(epochs=1, compile=False, progress=False, schedule=None, precision="fp32", device="cpu")
    inner = _tiny()
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        torchspeed.fit(nn.DataParallel(inner), loader, **kw)
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "DataParallel" in msg and "T31" in msg and "torchspeed launch" in msg
    reference = _tiny()
    torchspeed.fit(reference, loader, **kw)
    for a, b in zip(inner.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)  # the wrapped model itself was trained, exactly like a plain one
    assert not torch.equal(next(inner.parameters()), next(_tiny().parameters()))


def test_distributed_loader_splits_the_data_and_keeps_the_loader_settings():
    ds = _data(25)
    loader = DataLoader(ds, batch_size=4, shuffle=True, drop_last=False)
    shards = [distributed_loader(loader, rank=r, world_size=2) for r in (0, 1)]
    for s in shards:
        assert isinstance(s.sampler, DistributedSampler) and s.sampler.shuffle and s.batch_size == 4
        s.sampler.set_epoch(3)
    idx = [list(s.sampler) for s in shards]
    assert len(idx[0]) == len(idx[1]) == 13  # padded by one repeat: equal step counts on both ranks
    assert set(idx[0]) | set(idx[1]) == set(range(25))
    # sequential loaders stay in order; ResumableSampler keeps its seed
    seq = distributed_loader(DataLoader(ds, batch_size=4), rank=1, world_size=2)
    assert list(seq.sampler) == list(range(1, 25, 2)) + [0]
    res = distributed_loader(DataLoader(ds, batch_size=4, sampler=ResumableSampler(ds, seed=7)), rank=0, world_size=2)
    assert res.sampler.shuffle and res.sampler.seed == 7
    with pytest.raises(ValueError, match="custom sampler"):
        distributed_loader(DataLoader(ds, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 25, 25)),
                           rank=0, world_size=2)


def test_shard_batches_gives_every_rank_the_same_step_count():
    batches = list(range(7))
    assert shard_batches(batches, rank=0, world_size=2) == [0, 2, 4]
    assert shard_batches(batches, rank=1, world_size=2) == [1, 3, 5]
    assert shard_batches(batches, rank=0, world_size=2, even=False) == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="at least one per process"):
        shard_batches([0], rank=0, world_size=2)


def test_single_process_defaults(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert maybe_init_distributed("auto") is None and maybe_init_distributed(False) is None
    with pytest.raises(RuntimeError, match="torchspeed launch"):
        maybe_init_distributed(True)
    assert is_rank_zero() and rank_zero_only(lambda: 5)() == 5
    assert reduce_metrics({"loss": 0.5, "acc": None}, weight=10) == {"loss": 0.5, "acc": None}
    monkeypatch.setenv("RANK", "1")
    assert not is_rank_zero() and rank_zero_only(lambda: 5)() is None
    assert scale_lr_world_size(0.1, world_size=4) == pytest.approx(0.4)
    model = _tiny()
    assert unwrap_model(nn.DataParallel(model)) is model
    bn = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    assert convert_sync_batchnorm(bn, device="cpu") == (bn, False)  # PyTorch has no CPU SyncBatchNorm
