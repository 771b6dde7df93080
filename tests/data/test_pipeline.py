import pytest
import torch

from torchspeed.data import FastImageFolder
from torchspeed.data.pipeline import build_loaders, open_images


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
                      progress=False)
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
