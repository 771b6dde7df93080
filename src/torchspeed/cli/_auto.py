"""What `torchspeed train` / `data bench` / `tune` pick when an option is `auto` (T05, T35: sizes and crops).

- `--size auto`: the median shorter side of up to 256 images of the dataset (read from
  the file headers, nothing decoded), rounded down to a multiple of 8 and kept within
  [32, 224]; so 96-px images train at 96, not upscaled to 224.
- `--crop-scale LO,HI` (RandomResizedCrop's area range) or `off` (no random crop: resize
  and centre crop, as validation, plus the random flip).
- `small_val_warning`: a validation set under 400 images reads accuracy to worse than +-5
  points (the 95% binomial interval at 50%), so differences of a few points there are noise.

Example:
    >>> auto_size("photos/")            # 96 for a folder of 96-px JPEGs
    >>> parse_crop_scale("0.25,1")      # (0.25, 1.0)
"""

from __future__ import annotations

import math
import os

from torchspeed.data.decode import image_size
from torchspeed.data.pipeline import open_images

__all__ = ["SIZE_CAP", "MIN_SIZE", "auto_size", "parse_size", "parse_crop_scale", "small_val_warning"]

SIZE_CAP, MIN_SIZE, SAMPLE = 224, 32, 256
VAL_MIN = 400  # 1.96 * sqrt(0.25 / 400) = 0.049: +-5 points


def auto_size(path: str | os.PathLike, *, cap: int = SIZE_CAP) -> int:
    """The median shorter image side of the dataset at `path`, rounded down to a multiple of 8, in [32, cap]."""
    ds = open_images(path, size=None, crop=None, on_error="skip")
    n = len(ds)
    step = max(1, n // SAMPLE)
    sides = []
    for i in range(0, n, step):
        try:
            h, w = image_size(ds.read(i))
        except Exception:  # noqa: BLE001 - a bad file is reported by the loader later; here it is not counted
            continue
        sides.append(min(h, w))
    if not sides:
        return min(cap, 224)
    sides.sort()
    median = sides[len(sides) // 2]
    return max(MIN_SIZE, min(cap, median // 8 * 8))


def parse_size(value: str, flag: str = "--size", minimum: int = 16) -> int | str:
    """`auto` or an int of at least `minimum`, else ValueError naming the flag."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{flag} must be a number of pixels or auto, got {value!r}") from None
    if n < minimum:
        raise ValueError(f"{flag} {n} is too small; use at least {minimum} (or auto)")
    return n


def parse_crop_scale(value: str) -> tuple[float, float] | None:
    """`LO,HI` with 0 < LO <= HI <= 1 -> (LO, HI); `off` -> None (no random crop)."""
    if value.lower() in ("off", "none"):
        return None
    try:
        lo, hi = (float(v) for v in value.split(","))
    except ValueError:
        raise ValueError(f"--crop-scale must be LO,HI (e.g. 0.08,1) or off, got {value!r}") from None
    if not 0 < lo <= hi <= 1:
        raise ValueError(f"--crop-scale {value}: need 0 < LO <= HI <= 1 (the crop's share of the image area)")
    return lo, hi


def small_val_warning(n_val: int) -> str | None:
    """A one-line warning when `n_val` validation images cannot resolve a few points of accuracy."""
    if n_val <= 0 or n_val >= VAL_MIN:
        return None
    half = 1.96 * math.sqrt(0.25 / n_val)
    return (f"the validation set has {n_val} images: one image is {100 / n_val:.1f} points of accuracy and the "
            f"95% interval is up to +-{100 * half:.0f} points, so differences of a few points are noise; "
            f"use --val-fraction or a --val folder of {VAL_MIN}+ images to compare settings")
