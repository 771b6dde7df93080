import pytest
import torch

from torchspeed.data import FastImageFolder
from torchspeed.data.pipeline import build_loaders, open_images
from torchspeed.tune.loader import tune_loader


def test_split_and_batches(photo_folder):
    p = build_loaders(photo_folder, size=24, batch_size=4, val_fraction=0.25, workers=0, device="cpu", progress=False)
    train_idx, val_idx = p.train.loader.dataset.indices, p.val.loader.dataset.indices
    assert not set(train_idx) & set(val_idx) and len(train_idx) + len(val_idx) == 24 and len(val_idx) == 6
    x, y = next(iter(p.train))
    assert x.shape == (4, 3, 24, 24) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert -3 < x.mean().item() < 3 and p.decisions["augment"] == "cpu"  # auto on a CPU: crop in the loader
    xv, _ = next(iter(p.val))
    # validation is deterministic: the normalized centre crop
    base = FastImageFolder(photo_folder, size=24, crop="center")[val_idx[0]][0]
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    torch.testing.assert_close(xv[0], (base.float() / 255 - mean) / std, rtol=1e-4, atol=1e-4)


def test_device_mode_with_cache_and_auto_workers(photo_folder):
    p = build_loaders(photo_folder, size=16, batch_size=4, workers="auto", cache_bytes=1 << 22, device="cpu",
                      progress=False, tune_workers=tune_loader)
    assert p.decisions["augment"] == "device" and p.decisions["load_size"] == 18 and "workers" in p.decisions["loader"]
    for _ in range(2):
        shapes = {tuple(x.shape) for x, _ in p.train}
    assert shapes == {(4, 3, 16, 16)}
    assert p.train.loader.dataset.dataset.stats().hits > 0  # epoch 2 came from the cache


def test_bad_paths(tmp_path, photo_folder):
    (tmp_path / "x.bin").write_bytes(b"123")
    with pytest.raises(FileNotFoundError, match="not a torchspeed packed file"):
        open_images(tmp_path / "x.bin")
    with pytest.raises(ValueError, match="larger than"):
        build_loaders(photo_folder, size=16, batch_size=64, workers=0, device="cpu")


def test_device_loaders_split_between_processes(photo_folder, monkeypatch):
    # What fit does under `torchspeed launch --nproc 2` (shard_loader -> DeviceLoader.shard), per rank by hand.
    from torchspeed.train.parallel.shard import shard_loader

    p = build_loaders(photo_folder, size=16, batch_size=4, val_fraction=0.25, workers=0, device="cpu", progress=False)
    train_idx, val_idx = p.train.loader.dataset.indices, p.val.loader.dataset.indices  # 18 and 6 of the 24
    assert shard_loader(p.train) is p.train  # no process group: one process reads everything
    train = [shard_loader(p.train, seed=0, rank=r, world_size=2) for r in (0, 1)]
    assert all(t.device == p.train.device and t.augment is p.train.augment for t in train)
    assert len(train[0]) == len(train[1]) == 2  # 9 images each, batch 4, drop_last: equal steps on both ranks
    orders = []
    for epoch in (0, 1):
        seen = []
        for t in train:
            t.sampler.set_epoch(epoch)  # what fit does every epoch
            seen.append([train_idx[i] for i in t.sampler])
        assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == sorted(train_idx)
        orders.append(seen[0])
    assert orders[0] != orders[1]  # a new shuffle every epoch
    assert [tuple(x.shape) for x, _ in train[1]] == [(4, 3, 16, 16)] * 2
    val = [shard_loader(p.val, for_eval=True, rank=r, world_size=2) for r in (0, 1)]
    val_seen = [[v.dataset.dataset.indices[i] for i in v.dataset.indices] for v in val]
    assert not set(val_seen[0]) & set(val_seen[1]) and sorted(val_seen[0] + val_seen[1]) == sorted(val_idx)
    assert sum(len(y) for v in val for _, y in v) == len(val_idx)  # every validation image counted once
    with pytest.raises(ValueError, match="less than one batch"):
        shard_loader(p.train, rank=0, world_size=6)  # 3 images per process, batch 4
    monkeypatch.setenv("WORLD_SIZE", "3")  # under torchrun, before fit splits: the check counts per process
    with pytest.raises(ValueError, match=r"\(6 per process, 3 processes\)"):
        build_loaders(photo_folder, size=16, batch_size=8, val_fraction=0.25, workers=0, device="cpu",
                      progress=False)


def test_auto_workers_without_a_tuner_names_the_fix(photo_folder):
    with pytest.raises(ValueError, match="tune_workers=torchspeed.tune.tune_loader"):
        build_loaders(photo_folder, size=16, batch_size=4, workers="auto", device="cpu")
