"""JPEG folders made from scikit-image's bundled photos, for tests, benchmarks and docs.

`make_jpeg_folder` writes an ImageFolder-style tree (one subfolder per class): each image is
a random crop of a real photo, resized to an ImageNet-like size and re-encoded as JPEG.
The class is the photo a crop came from, so the set is also *learnable*: a small CNN tells
the photos apart from colour and texture, far above chance, in a few hundred steps.
Nothing is downloaded: the photos ship with scikit-image.

Example:
    >>> make_jpeg_folder("data/photos", n_per_class=25)           # ~400-530 px, quality 90
    >>> make_jpeg_folder("data/tiny", n_per_class=40, max_side=64)  # small, for tests
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from torchspeed._extras import require

__all__ = ["PHOTOS", "load_photo", "make_jpeg_folder"]

# Colour photos bundled with scikit-image (no download needed).
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
          "stereo_motorcycle")


def load_photo(name: str) -> np.ndarray:
    if name not in PHOTOS:
        raise ValueError(f"unknown photo {name!r}; choose from {', '.join(PHOTOS)}")
    img = getattr(require("skimage.data", "data", feature="the bundled sample photos"), name)()
    if isinstance(img, tuple):  # stereo_motorcycle returns (left, right, disparity)
        img = img[0]
    return np.ascontiguousarray(img[..., :3])


def make_jpeg_folder(dst: str | os.PathLike, *, n_per_class: int = 25, classes: int | tuple[str, ...] = 8,
                     max_side: tuple[int, int] | int = (450, 530), min_crop: float = 0.35, quality: int = 90,
                     seed: int = 0) -> Path:
    """Write `n_per_class` JPEGs per class under `dst/<photo>/NNNN.jpg` and return `dst`.

    Each image: a random crop (area fraction >= `min_crop`, aspect 3/4..4/3) of the class's
    photo, randomly flipped, resized (OpenCV INTER_AREA) so its longer side is `max_side`
    (an int, or a (low, high) range drawn per image), encoded at `quality`.

    Example:
        >>> root = make_jpeg_folder("photos", n_per_class=25, classes=4)
    """
    cv2, simplejpeg = require("cv2", "data"), require("simplejpeg", "data")
    names = PHOTOS[:classes] if isinstance(classes, int) else tuple(classes)
    if not names or len(names) > len(PHOTOS):
        raise ValueError(f"classes must be 1..{len(PHOTOS)} or names from {PHOTOS}")
    lo, hi = (max_side, max_side) if isinstance(max_side, int) else max_side
    rng = np.random.default_rng(seed)
    dst = Path(dst)
    for name in names:
        photo = load_photo(name)
        H, W = photo.shape[:2]
        (dst / name).mkdir(parents=True, exist_ok=True)
        for k in range(n_per_class):
            area = rng.uniform(min_crop, 1.0) * H * W
            ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
            w = int(min(W, round(np.sqrt(area * ratio))))
            h = int(min(H, round(np.sqrt(area / ratio))))
            y, x = int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1))
            crop = photo[y:y + h, x:x + w]
            if rng.random() < 0.5:
                crop = crop[:, ::-1]
            side = int(rng.integers(lo, hi + 1))
            s = side / max(h, w)
            size = (max(1, round(w * s)), max(1, round(h * s)))
            interp = cv2.INTER_AREA if s < 1 else cv2.INTER_LINEAR
            img = cv2.resize(np.ascontiguousarray(crop), size, interpolation=interp)
            data = simplejpeg.encode_jpeg(img, quality=quality, colorspace="RGB", colorsubsampling="420")
            (dst / name / f"{k:04d}.jpg").write_bytes(data)
    return dst
