"""Fast image decoding (T04): one `decode_image` over several JPEG backends.

What it does: decodes JPEG bytes with libjpeg-turbo (simplejpeg), OpenCV or Pillow, and
optionally *in the DCT domain at a reduced scale*: when the caller only needs a smaller
image (`size_hint`), libjpeg-turbo skips most of the inverse DCT and colour work by
decoding straight to the smallest n/8 scale that is still at least that large. This is
where most of the speed over Pillow comes from (FFCV and DALI do the same). Non-JPEG
files (PNG, BMP, WebP, ...) go to Pillow. On CUDA, `decode_jpeg_batch` uses torchvision's
batched nvjpeg decoder.

When it helps: any loader that is decode-bound (JPEG training data on a CPU that cannot
keep up with the accelerator). What it costs: nothing in accuracy at full scale (all
backends are libjpeg(-turbo) builds and agree with Pillow within JPEG tolerance); at a
reduced scale, the image is slightly smoother than a full decode plus resize.

`backend="auto"` times the available CPU backends once per process on a built-in image
and keeps the fastest; a backend that fails on a file falls back to Pillow before the
file is declared broken. Truncated JPEGs are errors with every backend.

Example:
    >>> img = decode_image(open("cat.jpg", "rb").read(), size_hint=224)  # HWC uint8 RGB
    >>> img.shape  # the smallest DCT scale with both sides >= 224
"""

from __future__ import annotations

import io
import math
import time
import warnings
from collections.abc import Sequence

import numpy as np

from torchspeed._extras import require

__all__ = ["ImageDecodeError", "decode_image", "decode_jpeg", "decode_jpeg_batch", "image_size", "is_jpeg",
           "available_backends", "pick_backend", "BACKENDS"]

BACKENDS = ("simplejpeg", "opencv", "pillow", "torchvision")
_AUTO: dict[tuple[bool, bool], str] = {}


class ImageDecodeError(ValueError):
    """A file could not be decoded; `path` names it (when known) and `reason` says why."""

    def __init__(self, reason: str, path: str | None = None):
        self.reason = reason
        self.path = path
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{reason}. Fix or remove the file, or pass on_error='skip' to skip bad files")

    def with_path(self, path: str) -> "ImageDecodeError":
        return ImageDecodeError(self.reason, path)


def is_jpeg(data) -> bool:
    return len(data) >= 3 and bytes(data[:3]) == b"\xff\xd8\xff"


def _check_complete(data) -> None:
    # A truncated JPEG lacks the end-of-image marker after its last scan. OpenCV and Pillow (with
    # LOAD_TRUNCATED_IMAGES) would return a half-grey image silently, so check before any backend
    # runs. Data after the marker (some cameras append metadata) is allowed: inside a scan 0xFF is
    # byte-stuffed, so FFD9 after the last start-of-scan can only be the real end marker.
    tail = bytes(data[-64:]).rstrip(b"\x00\r\n ")
    if tail.endswith(b"\xff\xd9"):
        return
    raw = bytes(data)
    sos = raw.rfind(b"\xff\xda")
    if sos < 0 or raw.find(b"\xff\xd9", sos) < 0:
        raise ImageDecodeError("truncated JPEG (no end-of-image marker)")


def _as_hw(size_hint) -> tuple[int, int]:
    if size_hint is None:
        return 0, 0
    if isinstance(size_hint, int):
        return size_hint, size_hint
    h, w = size_hint
    return int(h), int(w)


# ---------------------------------------------------------------------- backends (bytes -> HWC uint8 RGB)
def _simplejpeg(data, min_h: int, min_w: int, fast: bool = False) -> np.ndarray:
    simplejpeg = require("simplejpeg", "data")

    if min_h or min_w:
        # Only 1/2, 1/4 and 1/8 have SIMD inverse DCTs in libjpeg-turbo; the other n/8 scales
        # measured *slower* than a full decode, so round the scale to a power of two.
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
        f = _reduce_factor(h, w, min_h, min_w)
        min_h, min_w = (math.ceil(h / f), math.ceil(w / f)) if f > 1 else (0, 0)
    # fast: libjpeg's integer-fast IDCT and plain chroma upsampling (TensorFlow's default IDCT).
    return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_h, min_width=min_w, strict=True,
                                  fastdct=fast, fastupsample=fast)


def _reduce_factor(h: int, w: int, min_h: int, min_w: int) -> int:
    """The largest of 1, 2, 4, 8 that keeps ceil(h/f) >= min_h and ceil(w/f) >= min_w."""
    f = 1
    for cand in (2, 4, 8):
        if math.ceil(h / cand) >= min_h and math.ceil(w / cand) >= min_w:
            f = cand
    return f


def _opencv(data, min_h: int, min_w: int, fast: bool = False) -> np.ndarray:
    cv2 = require("cv2", "data")

    flag = cv2.IMREAD_COLOR
    if min_h or min_w:
        h, w = image_size(data)
        flag = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
                8: cv2.IMREAD_REDUCED_COLOR_8}[_reduce_factor(h, w, min_h, min_w)]
    buf = np.frombuffer(data, np.uint8)
    img = cv2.imdecode(buf, flag)
    if img is None:
        raise ValueError("OpenCV could not decode the data")
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


def _pillow(data, min_h: int, min_w: int, fast: bool = False) -> np.ndarray:
    Image = require("PIL.Image", "data")

    with Image.open(io.BytesIO(bytes(data))) as im:
        if (min_h or min_w) and im.format == "JPEG":
            f = _reduce_factor(im.height, im.width, min_h, min_w)
            if f > 1:
                im.draft("RGB", (math.ceil(im.width / f), math.ceil(im.height / f)))
        return np.asarray(im.convert("RGB"))


def _torchvision(data, min_h: int, min_w: int, fast: bool = False) -> np.ndarray:
    import torch

    with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders in favour of torchcodec
        warnings.simplefilter("ignore", DeprecationWarning)
        require("torchvision", "data")
        from torchvision.io import ImageReadMode, decode_jpeg as tv_decode

        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        # HWC contiguous like the other backends (its CHW output would cost a transpose later anyway)
        return np.ascontiguousarray(tv_decode(t, mode=ImageReadMode.RGB).permute(1, 2, 0).numpy())


_FUNCS = {"simplejpeg": _simplejpeg, "opencv": _opencv, "pillow": _pillow, "torchvision": _torchvision}


def available_backends() -> list[str]:
    """CPU JPEG backends importable here, in preference order."""
    out = []
    for name, mod in (("simplejpeg", "simplejpeg"), ("opencv", "cv2"), ("pillow", "PIL"), ("torchvision", "torchvision")):
        try:
            __import__(mod)
            out.append(name)
        except ImportError:
            pass
    return out


def _sample_jpeg() -> bytes:
    """A real photo (scikit-image's astronaut), 512x512, quality 90: timings on a gradient mislead."""
    simplejpeg = require("simplejpeg", "data")

    from torchspeed.data.synthetic import load_photo

    return simplejpeg.encode_jpeg(load_photo("astronaut"), quality=90, colorspace="RGB", colorsubsampling="420")


def pick_backend(*, scaled: bool = False, fast: bool = False, repeats: int = 5) -> str:
    """Time every available CPU backend on a built-in photo; return the fastest (cached per process).

    `scaled`: time a reduced-scale decode (to 1/2) instead of a full one; `fast`: the fast IDCT.
    """
    key = (scaled, fast)
    if key in _AUTO:
        return _AUTO[key]
    data = _sample_jpeg()
    min_h, min_w = (200, 200) if scaled else (0, 0)
    best, best_t = "pillow", float("inf")
    for name in available_backends():
        fn = _FUNCS[name]
        try:
            fn(data, min_h, min_w, fast)  # warm-up (imports, tables)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(data, min_h, min_w, fast)
                times.append(time.perf_counter() - t0)
        except Exception:
            continue
        t = sorted(times)[len(times) // 2]
        if t < best_t:
            best, best_t = name, t
    _AUTO[key] = best
    return best


def image_size(data) -> tuple[int, int]:
    """(height, width) from the header, without decoding the pixels."""
    if is_jpeg(data):
        try:
            import simplejpeg

            h, w, _, _ = simplejpeg.decode_jpeg_header(data)
            return int(h), int(w)
        except Exception:
            pass
    Image = require("PIL.Image", "data")
    try:
        with Image.open(io.BytesIO(bytes(data))) as im:
            return im.height, im.width
    except Exception as e:
        raise ImageDecodeError(f"not an image ({type(e).__name__}: {e})") from None


def decode_jpeg(data, *, size_hint: int | tuple[int, int] | None = None, backend: str = "auto",
                fast: bool = False) -> np.ndarray:
    """Decode JPEG bytes to an HWC uint8 RGB array.

    `size_hint` (int or (h, w)): decode in the DCT domain to the smallest of the scales 1,
    1/2, 1/4, 1/8 with both sides at least this large (simplejpeg, OpenCV, Pillow; torchvision
    decodes at full size). `fast`: simplejpeg's fast integer IDCT and chroma upsampling
    (about 15% faster, pixels differ by about 1 level on average). `backend`: "auto" |
    "simplejpeg" | "opencv" | "pillow" | "torchvision".

    Example:
        >>> decode_jpeg(data, size_hint=224).shape   # a 530x425 JPEG, whose 1/2 scale is too small
        (425, 530, 3)
    """
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"unknown JPEG backend {backend!r}; choose one of auto, {', '.join(BACKENDS)}")
    if not is_jpeg(data):
        raise ImageDecodeError("not a JPEG (no SOI marker)")
    _check_complete(data)
    min_h, min_w = _as_hw(size_hint)
    name = pick_backend(scaled=bool(min_h or min_w), fast=fast) if backend == "auto" else backend
    try:
        return _FUNCS[name](data, min_h, min_w, fast)
    except Exception as e:
        if backend != "auto" or name == "pillow":
            raise ImageDecodeError(f"{name} could not decode it ({type(e).__name__}: {e})") from None
        first = e
    try:  # e.g. CMYK JPEGs, which libjpeg-turbo's RGB output does not take
        return _pillow(data, min_h, min_w)
    except Exception as e:
        raise ImageDecodeError(f"corrupt JPEG ({name}: {first}; pillow: {type(e).__name__}: {e})") from None


def decode_image(data, *, size_hint: int | tuple[int, int] | None = None, backend: str = "auto",
                 fast: bool = False) -> np.ndarray:
    """Decode any image's bytes to HWC uint8 RGB: JPEGs with `decode_jpeg`, other formats with Pillow.

    Raises `ImageDecodeError` for corrupt, truncated or non-image data.

    Example:
        >>> img = decode_image(Path("x.png").read_bytes())
    """
    if len(data) == 0:
        raise ImageDecodeError("empty file")
    if is_jpeg(data):
        return decode_jpeg(data, size_hint=size_hint, backend=backend, fast=fast)
    try:
        return _pillow(data, 0, 0)
    except Exception as e:
        raise ImageDecodeError(f"not a readable image ({type(e).__name__}: {e})") from None


def decode_jpeg_batch(datas: Sequence, *, device="cuda"):
    """Decode a list of JPEG byte strings on the GPU in one nvjpeg call; returns a list of CHW uint8 tensors.

    Example:
        >>> imgs = decode_jpeg_batch([p.read_bytes() for p in paths], device="cuda")
    """
    import torch

    tensors = []
    for d in datas:
        if not is_jpeg(d):
            raise ImageDecodeError("not a JPEG (no SOI marker)")
        _check_complete(d)
        tensors.append(torch.frombuffer(bytearray(d), dtype=torch.uint8))
    with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders in favour of torchcodec
        warnings.simplefilter("ignore", DeprecationWarning)
        from torchvision.io import ImageReadMode, decode_jpeg as tv_decode

        if torch.device(device).type != "cuda":
            return [tv_decode(t, mode=ImageReadMode.RGB) for t in tensors]
        return tv_decode(tensors, mode=ImageReadMode.RGB, device=device)
