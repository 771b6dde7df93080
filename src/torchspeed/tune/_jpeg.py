"""A decode-heavy image dataset for the loader tuner's tests and benchmark: JPEG bytes in memory.

Each sample is a JPEG encoded once at construction from crops of scikit-image's bundled
photos (no download); `__getitem__` decodes it with Pillow, resizes it and turns it into a
normalised tensor, the work a real image pipeline does in its DataLoader workers (T06).

Example:
    >>> ds = JpegImages(256, size=192, out_size=64)
    >>> x, y = ds[0]        # decoded on every access
"""

from __future__ import annotations

import io

import numpy as np
import torch
from torch.utils.data import Dataset

from torchspeed._extras import require

__all__ = ["JpegImages"]

_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field")


def _photos() -> list[np.ndarray]:
    data = require("skimage.data", "data", feature="the jpeg workload's photos")
    out = []
    for name in _PHOTOS:
        img = getattr(data, name, None)
        if img is None:
            continue
        a = np.asarray(img())
        if a.ndim == 3 and a.shape[2] == 3:
            out.append(a)
    if not out:
        raise RuntimeError("scikit-image's bundled photos are missing; reinstall scikit-image")
    return out


class JpegImages(Dataset):
    """`n` JPEG-encoded crops (`size` px) with 10 labels; decoded and resized to `out_size` per access."""

    def __init__(self, n: int, *, size: int = 192, out_size: int = 64, num_classes: int = 10, seed: int = 0,
                 quality: int = 90):
        Image = require("PIL.Image", "data")

        rng = np.random.default_rng(seed)
        photos = _photos()
        self.blobs: list[bytes] = []
        self.targets = torch.from_numpy(rng.integers(0, num_classes, n)).long()
        for _ in range(n):
            p = photos[rng.integers(len(photos))]
            h, w = p.shape[:2]
            s = int(rng.integers(min(h, w) // 2, min(h, w) + 1))
            y0, x0 = int(rng.integers(0, h - s + 1)), int(rng.integers(0, w - s + 1))
            crop = Image.fromarray(p[y0:y0 + s, x0:x0 + s]).resize((size, size), Image.BILINEAR)
            buf = io.BytesIO()
            crop.save(buf, format="JPEG", quality=quality)
            self.blobs.append(buf.getvalue())
        self.out_size = out_size

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int):
        from PIL import Image

        img = Image.open(io.BytesIO(self.blobs[i])).convert("RGB").resize((self.out_size, self.out_size),
                                                                          Image.BILINEAR)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (x - 0.5) / 0.25, self.targets[i]
