"""`FastImageFolder`: a drop-in for torchvision's `ImageFolder` that is decode-fast (T04, T11).

What it does: the same folder layout, `classes`, `class_to_idx`, `samples` and `targets`
as `torchvision.datasets.ImageFolder`, but each item is decoded with the fast backend
(`decode_image`) and returned as a **uint8** CHW tensor made with `torch.from_numpy` (no
copy, no float conversion on the CPU: that happens on the device, in `DeviceAugment`).

With `crop="random"` it does torchvision's RandomResizedCrop on the CPU, cheaply: it reads
the JPEG header, draws the crop box in full-resolution coordinates, and decodes in the DCT
domain at the smallest scale where the crop is still at least `size` pixels on both sides,
so no detail is lost that the output could show; the crop is then resized with OpenCV on
uint8. `crop="center"` resizes the shorter side to `size` and crops the centre square
(deterministic, so it can be cached). `crop=None` returns the full decoded image.

Bad files: with `on_error="raise"` (default) a corrupt, truncated, empty or non-image file
raises `ImageDecodeError` naming the file; with `on_error="skip"` the item is replaced by the
next good one and the file is recorded (across DataLoader workers) in `summary()`.
`check()` decodes every file once up front and drops the bad ones from the index.

When it helps: every JPEG pipeline; see docs/data.md for the measured speed-up.
Cost: none beyond OpenCV's resize kernel differing slightly from Pillow's.

Example:
    >>> ds = FastImageFolder("train/", size=224, crop="random", flip=True)
    >>> x, y = ds[0]          # torch.uint8, (3, 224, 224)
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from torchspeed._extras import require
from torchspeed.data.decode import ImageDecodeError, decode_image, image_size, is_jpeg
from torchspeed.train.loop.progress import track

__all__ = ["FastImageFolder", "ImageDataset", "DataSummary", "load_image", "random_resized_crop_box",
           "uint8_collate", "IMG_EXTENSIONS", "CROPS"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
CROPS = ("random", "center", None)


@dataclass(frozen=True)
class DataSummary:
    """What a dataset holds: usable items, bad files (skipped) and ignored non-image files."""

    total: int
    bad: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()

    @property
    def ok(self) -> int:
        return self.total - len(self.bad)

    def __str__(self) -> str:
        s = f"{self.ok} good images of {self.total}"
        if self.bad:
            s += f"; {len(self.bad)} bad file(s) skipped: " + ", ".join(self.bad[:5]) + (" ..." if len(self.bad) > 5 else "")
        if self.ignored:
            s += f"; {len(self.ignored)} non-image file(s) ignored"
        return s


def random_resized_crop_box(h: int, w: int, *, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                            rng: random.Random | None = None) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params: (top, left, height, width) of a random box."""
    rng = rng or random
    area = h * w
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        ar = math.exp(rng.uniform(*log_r))
        cw = int(round(math.sqrt(target * ar)))
        ch = int(round(math.sqrt(target / ar)))
        if 0 < cw <= w and 0 < ch <= h:
            return rng.randint(0, h - ch), rng.randint(0, w - cw), ch, cw
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def _resize(img: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    cv2 = require("cv2", "data")
    h, w = img.shape[:2]
    if (h, w) == size:
        return np.ascontiguousarray(img)
    # After a DCT-domain reduction a JPEG crop is less than 2x the output, where bilinear is
    # fine and 6x faster than INTER_AREA; only larger shrinks (other formats) pay for averaging.
    interp = cv2.INTER_AREA if h > 2 * size[0] and w > 2 * size[1] else cv2.INTER_LINEAR
    return cv2.resize(img, (size[1], size[0]), interpolation=interp)


def load_image(data, *, size: int | None = None, crop: str | None = "random", scale=(0.08, 1.0),
               ratio=(3 / 4, 4 / 3), flip: bool = False, backend: str = "auto", fast: bool = True,
               rng: random.Random | None = None) -> np.ndarray:
    """Bytes -> HWC uint8 RGB array: decode (DCT-scaled when it can), crop, resize, maybe flip.

    Example:
        >>> load_image(data, size=224, crop="random", flip=True).shape
        (224, 224, 3)
    """
    rng = rng or random
    if crop not in CROPS:
        raise ValueError(f"crop must be one of {CROPS}, got {crop!r}")
    if size is None or crop is None:
        img = decode_image(data, backend=backend, fast=fast)
    else:
        H, W = image_size(data)
        if crop == "random":
            top, left, ch, cw = random_resized_crop_box(H, W, scale=scale, ratio=ratio, rng=rng)
        else:
            ch = cw = min(H, W)
        # Decode at the smallest DCT scale that keeps the crop >= size on both sides (T04).
        hint = (min(H, math.ceil(size * H / ch)), min(W, math.ceil(size * W / cw))) if is_jpeg(data) else None
        img = decode_image(data, size_hint=hint, backend=backend, fast=fast)
        h, w = img.shape[:2]
        if crop == "center":  # the centre square of the decoded image
            ch = cw = min(h, w)
            top, left = (h - ch) // 2, (w - cw) // 2
        elif (h, w) != (H, W):  # the box in decoded pixels (moves by less than one of them)
            sy, sx = h / H, w / W
            top, left = min(h - 1, round(top * sy)), min(w - 1, round(left * sx))
            ch, cw = max(1, min(h - top, round(ch * sy))), max(1, min(w - left, round(cw * sx)))
        img = _resize(img[top:top + ch, left:left + cw], (size, size))
    if flip and rng.random() < 0.5:
        return require("cv2", "data").flip(img, 1)
    return np.ascontiguousarray(img)


class ImageDataset(Dataset):
    """Shared machinery of `FastImageFolder` and `PackedDataset`: decode, crop, bad-file handling.

    Subclasses set `samples` (list of (name, label)), `classes`, `class_to_idx` and implement `read(i)`.
    """

    samples: list[tuple[str, int]]
    classes: list[str]
    ignored: tuple[str, ...] = ()

    def _init_options(self, *, size, crop, scale, ratio, flip, backend, on_error, transform, fast=True,
                      target_transform=None) -> None:
        if crop not in CROPS:
            raise ValueError(f"crop must be one of {CROPS}, got {crop!r}")
        if crop is not None and size is None:
            raise ValueError(f"crop={crop!r} needs a size (e.g. size=224)")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.size, self.crop, self.scale, self.ratio, self.flip = size, crop, scale, ratio, flip
        self.backend, self.on_error, self.transform, self.fast = backend, on_error, transform, fast
        self.target_transform = target_transform
        # Shared memory, so bad files found in DataLoader workers show in the main process's summary.
        self._bad = torch.zeros(len(self.samples), dtype=torch.bool).share_memory_()

    @property
    def targets(self) -> list[int]:
        return [s[1] for s in self.samples]

    @property
    def deterministic(self) -> bool:
        """True when an item is the same every time (safe to cache)."""
        return self.crop != "random" and not self.flip

    def read(self, i: int) -> bytes:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, i: int) -> np.ndarray:
        """Item `i` as an HWC uint8 array; raises `ImageDecodeError` naming the file."""
        name = self.samples[i][0]
        try:
            data = self.read(i)
            return load_image(data, size=self.size, crop=self.crop, scale=self.scale, ratio=self.ratio,
                              flip=self.flip, backend=self.backend, fast=self.fast)
        except ImageDecodeError as e:
            raise e.with_path(name) from None
        except Exception as e:  # cv2/PIL/OS errors on odd inputs: still name the file
            raise ImageDecodeError(f"{type(e).__name__}: {e}", name) from None

    def __getitem__(self, i: int):
        n = len(self.samples)
        for k in range(n):
            j = (i + k) % n
            try:
                img = self.load(j)
            except ImageDecodeError:
                if self.on_error == "raise":
                    raise
                self._bad[j] = True
                continue
            x = torch.from_numpy(img).permute(2, 0, 1)  # CHW view of HWC memory: no copy (T11)
            if self.transform is not None:
                x = self.transform(x)
            y = self.samples[j][1]
            return x, (self.target_transform(y) if self.target_transform is not None else y)
        raise ImageDecodeError("no readable image in the dataset", getattr(self, "root", None))

    def summary(self) -> DataSummary:
        bad = tuple(self.samples[i][0] for i in torch.nonzero(self._bad).flatten().tolist())
        return DataSummary(total=len(self.samples), bad=bad, ignored=tuple(self.ignored))

    def check(self, *, progress: bool = False) -> DataSummary:
        """Decode every item once (at a reduced scale); with on_error="skip" drop bad ones from the index.

        Returns the summary *before* dropping (so it lists the bad files).
        """
        for i in track(range(len(self.samples)), description="checking images", enabled=progress):
            try:
                decode_image(self.read(i), size_hint=8)
            except Exception as e:
                if self.on_error == "raise":
                    err = e if isinstance(e, ImageDecodeError) else ImageDecodeError(f"{type(e).__name__}: {e}")
                    raise err.with_path(self.samples[i][0]) from None
                self._bad[i] = True
        summary = self.summary()
        if summary.bad:
            keep = [i for i in range(len(self.samples)) if not self._bad[i]]
            self._drop_all_but(keep)
            self._bad = torch.zeros(len(self.samples), dtype=torch.bool).share_memory_()
        self._checked = summary
        return summary

    def _drop_all_but(self, keep: list[int]) -> None:
        self.samples = [self.samples[i] for i in keep]


def _scan(root: Path) -> tuple[list[str], list[tuple[str, int]], list[str]]:
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory: expected an ImageFolder (one subfolder per class)")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise FileNotFoundError(f"{root} has no class subfolders: expected root/<class>/<image>.jpg")
    samples, ignored = [], []
    for idx, c in enumerate(classes):
        for dirpath, dirnames, files in sorted(os.walk(root / c, followlinks=True)):
            dirnames.sort()
            for f in sorted(files):
                p = os.path.join(dirpath, f)
                if f.lower().endswith(IMG_EXTENSIONS):
                    samples.append((p, idx))
                elif not f.startswith("."):
                    ignored.append(p)
    if not samples:
        raise FileNotFoundError(f"no image files ({', '.join(IMG_EXTENSIONS)}) under {root}")
    return classes, samples, ignored


class FastImageFolder(ImageDataset):
    """torchvision's ImageFolder layout, fast decoding, uint8 CHW tensors out.

    Options (keyword-only): `size` (output side for the crops), `crop` ("random" =
    RandomResizedCrop, "center", or None = full image), `scale`, `ratio` (as torchvision),
    `flip` (random horizontal flip on the CPU; leave False when `DeviceAugment` flips),
    `backend` (decode backend, "auto" = fastest measured), `fast` (libjpeg's fast integer
    IDCT, TensorFlow's default: about 15% faster, pixels within ~1 level), `on_error`
    ("raise" | "skip"), `transform` (applied to the uint8 tensor), `target_transform`.

    Example:
        >>> ds = FastImageFolder("photos/", size=224, crop="random")
        >>> loader = DataLoader(ds, batch_size=64, num_workers=4, collate_fn=uint8_collate)
    """

    def __init__(self, root: str | os.PathLike, *, size: int | None = 224, crop: str | None = "random",
                 scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: bool = False, backend: str = "auto",
                 fast: bool = True, on_error: str = "raise", transform=None, target_transform=None):
        self.root = str(root)
        self.classes, self.samples, ignored = _scan(Path(root))
        self.ignored = tuple(ignored)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self._init_options(size=size, crop=crop, scale=scale, ratio=ratio, flip=flip, backend=backend,
                           on_error=on_error, transform=transform, fast=fast, target_transform=target_transform)

    def read(self, i: int) -> bytes:
        with open(self.samples[i][0], "rb") as f:
            return f.read()


def uint8_collate(batch):
    """Collate (CHW uint8 view of HWC, label) items into an NCHW batch in channels_last memory.

    The items' memory is HWC, so stacking it as NHWC is a straight copy (no transpose), and
    the batch comes out channels_last, the layout convolutions prefer (T23).
    """
    xs, ys = zip(*batch)
    hwc = [x.permute(1, 2, 0) for x in xs]
    out = None
    if torch.utils.data.get_worker_info() is not None:
        # In a worker, build the batch in shared memory so sending it to the main process is free.
        numel = sum(x.numel() for x in hwc)
        storage = hwc[0].untyped_storage()._new_shared(numel, device="cpu")
        out = torch.empty(0, dtype=torch.uint8).set_(storage).view(len(hwc), *hwc[0].shape)
    x = torch.stack(hwc, 0, out=out).permute(0, 3, 1, 2)
    return x, torch.as_tensor(ys, dtype=torch.int64)
