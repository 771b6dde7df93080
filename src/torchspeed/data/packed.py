"""Packed format (T09): an image folder in one file plus an index, read memory-mapped.

What it does: `pack_folder(src, dst)` (the `torchspeed data pack SRC DST` command) writes
every image of an ImageFolder back to back into one data file `DST`, and an index
`DST.index.npz` (byte offsets, lengths, labels, class names, original names). Optionally
each image is first resized so its longer side is at most `max_side` and re-encoded as JPEG
at `quality` (ImageNet at max side 512 shrinks ~3x and decodes ~3x faster).
`PackedDataset(dst)` memory-maps the file: item i is a slice of the map (no open/seek per
file, the OS reads ahead) decoded like `FastImageFolder`. `LocalShuffleSampler` shuffles
blocks of neighbouring items and then items within a window of blocks, so reads stay in a
few regions of the file at a time (sequential enough for disks and network storage) while
batches are still well mixed.

When it helps: many small files on slow or network storage (per-file open/stat costs),
object stores, and datasets larger than the page cache. Cost: one packing pass; the packed
copy uses disk space (less with `max_side`).

Example:
    >>> pack_folder("train/", "train.tspack", max_side=512, quality=90)
    >>> ds = PackedDataset("train.tspack", size=224, crop="random")
    >>> loader = DataLoader(ds, batch_size=256, sampler=LocalShuffleSampler(len(ds)), collate_fn=uint8_collate)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Sampler

from torchspeed._extras import require
from torchspeed.data.decode import ImageDecodeError, decode_image
from torchspeed.data.folder import DataSummary, ImageDataset, _scan
from torchspeed.train.loop.progress import track

__all__ = ["pack_folder", "PackedDataset", "LocalShuffleSampler", "PackResult", "index_path", "is_packed"]

FORMAT = "torchspeed-pack-1"


def index_path(path: str | os.PathLike) -> Path:
    return Path(str(path) + ".index.npz")


def is_packed(path: str | os.PathLike) -> bool:
    return Path(path).is_file() and index_path(path).is_file()


@dataclass(frozen=True)
class PackResult:
    path: str
    index: str
    images: int
    bytes: int
    source_bytes: int
    summary: DataSummary


def _packed_bytes(path: str, *, max_side: int | None, quality: int) -> bytes:
    """One image's bytes to pack: decoded once to check it; larger than `max_side`, resized (longer side =
    max_side, OpenCV INTER_AREA) and re-encoded at `quality`, else the file's own bytes."""
    cv2, simplejpeg = require("cv2", "data"), require("simplejpeg", "data")
    data = Path(path).read_bytes()
    img = decode_image(data, size_hint=None if max_side else 8)
    if max_side and max(img.shape[:2]) > max_side:
        h, w = img.shape[:2]
        s = max_side / max(h, w)
        img = cv2.resize(img, (max(1, round(w * s)), max(1, round(h * s))), interpolation=cv2.INTER_AREA)
        data = simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=quality, colorspace="RGB")
    return data


def _write_index(dst: Path, *, offsets, lengths, labels, classes, names, meta: dict) -> Path:
    """The index beside `dst` written to its temporary name (the caller renames it after the data); its path."""
    idx = index_path(dst)
    np.savez(idx.with_name(idx.name + ".tmp.npz"), offsets=np.asarray(offsets, np.int64),
             lengths=np.asarray(lengths, np.int64), labels=np.asarray(labels, np.int64),
             classes=np.asarray(classes, dtype=np.str_), names=np.asarray(names, dtype=np.str_),
             meta=np.asarray(json.dumps(meta), dtype=np.str_))
    return idx


def pack_folder(src: str | os.PathLike, dst: str | os.PathLike, *, max_side: int | None = None, quality: int = 90,
                on_error: str = "raise", progress: bool = False) -> PackResult:
    """Pack the ImageFolder `src` into `dst` + `dst.index.npz` (written atomically).

    With `max_side`, images larger than that are resized (longer side = max_side, OpenCV
    INTER_AREA) and re-encoded at `quality`; others are copied byte for byte. Every image is
    decoded once to check it: bad files raise `ImageDecodeError` naming the file, or with
    `on_error="skip"` are left out and listed in the result's summary.

    Example:
        >>> r = pack_folder("photos/", "photos.tspack", max_side=256)
        >>> r.images, r.bytes
    """
    require("cv2", "data"), require("simplejpeg", "data")  # before any work: the extra's install line if missing
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if max_side is not None and max_side < 8:
        raise ValueError(f"max_side must be at least 8, got {max_side}")
    classes, samples, ignored = _scan(Path(src))
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    offsets, lengths, labels, names, bad = [], [], [], [], []
    pos = src_bytes = 0
    with open(tmp, "wb") as out:
        for path, label in track(samples, description=f"packing {len(samples)} images", enabled=progress):
            try:
                data = _packed_bytes(path, max_side=max_side, quality=quality)
            except ImageDecodeError as e:
                if on_error == "raise":
                    tmp.unlink(missing_ok=True)
                    raise e.with_path(path) from None
                bad.append(path)
                continue
            src_bytes += os.path.getsize(path)
            out.write(data)
            offsets.append(pos)
            lengths.append(len(data))
            labels.append(label)
            names.append(os.path.relpath(path, src))
            pos += len(data)
    if not offsets:
        tmp.unlink(missing_ok=True)
        raise ImageDecodeError("no readable image to pack", str(src))
    idx = _write_index(dst, offsets=offsets, lengths=lengths, labels=labels, classes=classes, names=names,
                       meta={"format": FORMAT, "max_side": max_side, "quality": quality, "data_bytes": pos})
    os.replace(tmp, dst)
    os.replace(idx.with_name(idx.name + ".tmp.npz"), idx)
    summary = DataSummary(total=len(samples), bad=tuple(bad), ignored=tuple(ignored))
    return PackResult(path=str(dst), index=str(idx), images=len(offsets), bytes=pos, source_bytes=src_bytes,
                      summary=summary)


class PackedDataset(ImageDataset):
    """Items of a packed file, memory-mapped; the same options and outputs as `FastImageFolder`.

    Example:
        >>> ds = PackedDataset("photos.tspack", size=224, crop="random")
        >>> x, y = ds[0]    # uint8 (3, 224, 224), label
    """

    def __init__(self, path: str | os.PathLike, *, size: int | None = 224, crop: str | None = "random",
                 scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: bool = False, backend: str = "auto",
                 fast: bool = True, on_error: str = "raise", transform=None, target_transform=None):
        self.path = self.root = str(path)
        idx = index_path(path)
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path} does not exist: make it with `torchspeed data pack SRC {path}`")
        if not idx.is_file():
            raise FileNotFoundError(f"{idx} is missing: {path} is not a torchspeed packed file "
                                    f"(re-run `torchspeed data pack`)")
        with np.load(idx, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format") != FORMAT:
                raise ValueError(f"{idx}: unknown format {meta.get('format')!r} (expected {FORMAT})")
            self.offsets, self.lengths = z["offsets"], z["lengths"]
            labels, names = z["labels"].tolist(), z["names"].tolist()
            self.classes = z["classes"].tolist()
        if os.path.getsize(path) != meta["data_bytes"]:
            raise ValueError(f"{path} is {os.path.getsize(path)} bytes but its index expects {meta['data_bytes']}: "
                             "the file is truncated or from another pack; re-run `torchspeed data pack`")
        self.meta = meta
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = [(n, int(label)) for n, label in zip(names, labels)]
        self._pos = np.arange(len(self.samples))  # item -> row of the index (changes if check() drops items)
        self._map = None
        self._init_options(size=size, crop=crop, scale=scale, ratio=ratio, flip=flip, backend=backend,
                           on_error=on_error, transform=transform, fast=fast, target_transform=target_transform)

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_map"] = None  # each worker maps the file itself
        return d

    def read(self, i: int):
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        r = self._pos[i]
        o = int(self.offsets[r])
        return self._map[o:o + int(self.lengths[r])]  # a view of the map: no copy until decode reads it

    def _drop_all_but(self, keep: list[int]) -> None:
        super()._drop_all_but(keep)
        self._pos = self._pos[keep]


class LocalShuffleSampler(Sampler[int]):
    """A shuffle that keeps reads local: shuffled blocks of `block` neighbours, mixed within `window` blocks.

    Each epoch (call `set_epoch`, as `fit` does) permutes the blocks, then shuffles the items
    inside each group of `window` consecutive (permuted) blocks. At any time the reader is in
    at most `window` regions of the file.

    Example:
        >>> sampler = LocalShuffleSampler(len(ds), block=64, window=16, seed=0)
    """

    def __init__(self, n: int, *, block: int = 64, window: int = 16, seed: int = 0):
        if n <= 0 or block <= 0 or window <= 0:
            raise ValueError(f"n, block and window must be positive, got {n}, {block}, {window}")
        self.n, self.block, self.window, self.seed, self.epoch = n, block, window, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        n_blocks = -(-self.n // self.block)
        order = torch.randperm(n_blocks, generator=g)
        idx = torch.arange(n_blocks * self.block).view(n_blocks, self.block)[order].flatten()
        idx = idx[idx < self.n]
        span = self.block * self.window
        out = []
        for s in range(0, len(idx), span):
            chunk = idx[s:s + span]
            out.append(chunk[torch.randperm(len(chunk), generator=g)])
        return iter(torch.cat(out).tolist())
