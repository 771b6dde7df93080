"""The whole fast image pipeline in one call, as `torchspeed train` uses it (T04-T11, T05).

`build_loaders(path)` turns an ImageFolder or a packed file into training and validation
loaders that yield normalized float batches on the device:

  files -> FastImageFolder / PackedDataset (fast decode to a fixed-size uint8 image)
        -> CachedDataset (optional, shared RAM, T10)
        -> DataLoader (workers measured by the `tune_workers` given, T06-T08; uint8_collate)
        -> DeviceLoader + DeviceAugment (random-resized-crop, flip, jitter, normalize on the device, T05)

With `augment="device"` the CPU only decodes and resizes to `load_size` (about 8/7 of
`size`, deterministic, hence cacheable) and the random crop happens on the device. With
`augment="cpu"` the CPU does the random crop at full resolution (`crop="random"`) and the
flip, the device only jitters (if asked), converts and normalizes. `"auto"` (default) is
"device" on CUDA or with a cache, "cpu" on a CPU, where the batched float crop is slower
than a uint8 crop per image in the workers (docs/data.md).

Under `torchspeed launch` every process builds the same whole loaders; `fit` then gives each
its part (`DeviceLoader.shard` through `shard_loader`, after it has set up the process group):
a disjoint 1/N of the training set per epoch, equal step counts, validation split without
padding (T31).

Example:
    >>> p = build_loaders("photos/", size=128, batch_size=64, device="cuda", tune_workers=torchspeed.tune.tune_loader)
    >>> torchspeed.fit(model, p.train, val_loader=p.val, epochs=10)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, Subset

from torchspeed.data.augment import DeviceAugment, DeviceLoader
from torchspeed.data.cache import CachedDataset
from torchspeed.data.folder import FastImageFolder, ImageDataset, uint8_collate
from torchspeed.data.packed import LocalShuffleSampler, PackedDataset, is_packed
from torchspeed.env import default_device
from torchspeed.train.parallel.distributed import get_world_size
from torchspeed.train.sampler import ResumableSampler
from torchspeed.train.transfer import loader_kwargs

__all__ = ["Pipeline", "build_loaders", "open_images"]


@dataclass
class Pipeline:
    train: DeviceLoader
    val: DeviceLoader | None
    classes: list[str]
    datasets: dict          # "train" / "val": the underlying image datasets (for summary())
    decisions: dict = field(default_factory=dict)


def open_images(path: str | os.PathLike, **options) -> ImageDataset:
    """`PackedDataset` if `path` is a packed file, else `FastImageFolder`; same options."""
    if is_packed(path):
        return PackedDataset(path, **options)
    if os.path.isfile(path):
        raise FileNotFoundError(f"{path} is a file but not a torchspeed packed file (no {path}.index.npz); "
                                "pass an ImageFolder directory or the output of `torchspeed data pack`")
    return FastImageFolder(path, **options)


def build_loaders(path: str | os.PathLike, *, size: int = 224, batch_size: int = 64, val_fraction: float = 0.1,
                  val_path: str | os.PathLike | None = None, workers: int | str = "auto", cache_bytes: int = 0,
                  augment: str = "auto", load_size: int | None = None, jitter: float = 0.0,
                  scale: tuple[float, float] | None = (0.08, 1.0), device: torch.device | str | None = None,
                  on_error: str = "skip", seed: int = 0, progress: bool = True,
                  tune_workers: Callable | None = None) -> Pipeline:
    """Training and validation loaders of device batches for the images at `path`.

    `val_fraction` of the items (a fixed random split) is held out unless `val_path` is
    given; `workers="auto"` measures the DataLoader (T06) with `tune_workers` (the tuner above the data
    layer: `torchspeed.tune.tune_loader`, as `torchspeed train` passes it); `cache_bytes` > 0 keeps decoded
    images in a shared LRU pool of that size (T10, `augment="device"` only). `scale` is the
    random crop's area range; None switches the random crop off (the whole image, resized
    and centre-cropped as in validation, still randomly flipped).

    Example:
        >>> p = build_loaders("photos.tspack", size=64, batch_size=32, workers=0, device="cpu")
    """
    _check_options(workers, tune_workers, augment, val_fraction)
    device = default_device(device)
    if augment == "auto":  # on a CPU the float passes of a batched crop cost more than a uint8 crop per image
        augment = "cpu" if device.type == "cpu" and not cache_bytes else "device"
    load_size = load_size or (round(size * 8 / 7) if augment == "device" else size)
    decisions: dict = {"augment": augment, "size": size, "load_size": load_size,
                       "crop_scale": list(scale) if scale else "off"}
    train_base, train_aug = _train_images(path, augment=augment, size=size, load_size=load_size, scale=scale,
                                          jitter=jitter, cache_bytes=cache_bytes, on_error=on_error)
    val_base = open_images(val_path or path, size=size, crop="center", on_error=on_error)
    train_idx, val_idx = _split(path, len(train_base), len(val_base), val_path=val_path, val_fraction=val_fraction,
                                seed=seed)
    train_ds = CachedDataset(train_base, budget_bytes=cache_bytes) if cache_bytes else train_base
    if cache_bytes:
        decisions["cache_bytes"] = cache_bytes
    train_set = Subset(train_ds, train_idx)
    _check_batch_size(batch_size, len(train_set))
    loader_kw, decisions["loader"] = _loader_settings(train_set, workers, tune_workers, batch_size=batch_size,
                                                      device=device, progress=progress, seed=seed)
    if isinstance(train_base, PackedDataset):
        sampler = LocalShuffleSampler(len(train_set), seed=seed)  # block shuffle: local reads in the file
    else:
        sampler = ResumableSampler(train_set, seed=seed)
    train_loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler, collate_fn=uint8_collate,
                              drop_last=True, **loader_kw)
    val = None
    if val_idx:
        val_loader = DataLoader(Subset(val_base, val_idx), batch_size=batch_size, shuffle=False,
                                collate_fn=uint8_collate, **loader_kw)
        val = DeviceLoader(val_loader, DeviceAugment(size=size, train=False), device)
    return Pipeline(train=DeviceLoader(train_loader, train_aug, device), val=val, classes=list(train_base.classes),
                    datasets={"train": train_base, "val": val_base}, decisions=decisions)


def _check_options(workers: int | str, tune_workers: Callable | None, augment: str, val_fraction: float) -> None:
    """The options' mistakes as errors before any file is opened: "auto" workers without a tuner to measure them,
    an unknown augment place, a validation share outside [0, 1)."""
    if workers == "auto" and tune_workers is None:
        raise ValueError("workers='auto' measures the DataLoader: pass tune_workers=torchspeed.tune.tune_loader, "
                         "or a number of workers")
    if augment not in ("auto", "device", "cpu"):
        raise ValueError(f"augment must be 'auto', 'device' or 'cpu', got {augment!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")


def _train_images(path: str | os.PathLike, *, augment: str, size: int, load_size: int,
                  scale: tuple[float, float] | None, jitter: float, cache_bytes: int,
                  on_error: str) -> tuple[ImageDataset, DeviceAugment]:
    """The training images and their device augmentation, split by where the random crop runs: "device" decodes a
    fixed `load_size` centre crop (cacheable) and crops on the device; "cpu" crops and flips in the loader at full
    resolution, so the device only jitters and normalizes (and a cache would freeze one epoch's crops)."""
    if augment == "device":
        train_base = open_images(path, size=load_size, crop="center", on_error=on_error)
        train_aug = DeviceAugment(size=size, train=True, scale=scale or (1.0, 1.0),
                                  ratio=(3 / 4, 4 / 3) if scale else (1.0, 1.0), flip=True, brightness=jitter,
                                  contrast=jitter, saturation=jitter)
        return train_base, train_aug
    if cache_bytes:
        raise ValueError("cache_bytes needs augment='device': with augment='cpu' every item is a new random "
                         "crop, and caching it would freeze epoch 1's crops")
    train_base = open_images(path, size=size, crop="random" if scale else "center", scale=scale or (0.08, 1.0),
                             flip=True, on_error=on_error)
    train_aug = DeviceAugment(size=size, train=True, crop=False, brightness=jitter, contrast=jitter,
                              saturation=jitter)
    return train_base, train_aug


def _split(path: str | os.PathLike, n: int, n_val_images: int, *, val_path: str | os.PathLike | None,
           val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, validation indices): a random `val_fraction` of the `n` images held out (seeded: the same
    images for the same seed, in every process), or none when `val_path` gives the validation set (all its
    `n_val_images` validate) or `val_fraction` is 0."""
    if val_path is None and val_fraction > 0:
        n_val = max(1, int(round(n * val_fraction)))
        if n - n_val < 1:
            raise ValueError(f"{path} has {n} images: too few to hold out {val_fraction:.0%} for validation")
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        return sorted(perm[n_val:]), sorted(perm[:n_val])  # sorted: reads stay local
    return list(range(n)), (list(range(n_val_images)) if val_path is not None else [])


def _check_batch_size(batch_size: int, n_train: int) -> None:
    """A batch no larger than each process's share of the `n_train` training images (under `torchspeed launch` fit
    splits the loaders later, 1/world each), else an error that says which batch would fit."""
    world = get_world_size()
    per_process = -(-n_train // world)
    if batch_size > per_process:
        where = f" ({per_process} per process, {world} processes)" if world > 1 else ""
        raise ValueError(f"batch size {batch_size} is larger than the {n_train} training images{where}; "
                         f"use --batch-size {max(1, per_process // 4)} or fewer")


def _loader_settings(train_set: Subset, workers: int | str, tune_workers: Callable | None, *, batch_size: int,
                     device: torch.device, progress: bool, seed: int) -> tuple[dict, str]:
    """(DataLoader keyword arguments, the decision as text): measured by `tune_workers` for workers="auto" (T06),
    else the number asked for with the device's transfer settings."""
    if workers == "auto":
        s = tune_workers(train_set, batch_size=batch_size, collate_fn=uint8_collate, device=device,
                         batches=6, progress=progress, seed=seed)
        return s.kwargs(), f"{s.num_workers} workers ({getattr(s, 'reason', 'measured')})"
    return loader_kwargs(device, num_workers=int(workers)), f"{workers} workers (asked for)"
