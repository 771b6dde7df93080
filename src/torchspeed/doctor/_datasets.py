"""Dataset timing (T04, T06, T10): `dataset[i]` for a few samples of each map-style dataset the script
loaded from, split into decoding (Pillow, OpenCV, torchvision.io, simplejpeg), torchvision transforms,
and the rest; for JPEG files Pillow decoded, the same files decoded by the faster decoders here. The
`torch.tensor(ndarray)` copies one `dataset[i]` makes are counted too (T11): in DataLoader workers the
loop's probe cannot see them.
"""

from __future__ import annotations

import statistics
import time

from torchspeed.doctor._sites import count_tensor_copies, new_copy_counts

__all__ = ["probe_datasets"]


class _DatasetTimers:
    def __init__(self):
        self.decode = 0.0
        self.transform = 0.0
        self.decoders: dict[str, int] = {}
        self.jpeg_files: list[str] = []
        self._patches = []
        self._depth = 0
        self._decode_depth = 0
        self.copies = new_copy_counts()

    def _patch(self, owner, name, make):
        orig = getattr(owner, name)
        self._patches.append((owner, name, orig, name in vars(owner)))
        setattr(owner, name, make(orig))

    def __enter__(self):
        import functools

        import torch

        timers = self
        self._patch(torch, "tensor", functools.partial(count_tensor_copies, self.copies))
        try:
            from PIL import Image, ImageFile

            def wrap_load(orig):
                def load(img, *a, **k):
                    fmt = getattr(img, "format", None) or "image"
                    fn = getattr(img, "filename", None)
                    if fmt == "JPEG" and fn and len(timers.jpeg_files) < 8 and fn not in timers.jpeg_files:
                        timers.jpeg_files.append(fn)
                    return timers._decode_call(f"PIL {fmt}", orig, img, *a, **k)
                return load

            def wrap_open(orig):
                def open_(*a, **k):
                    return timers._decode_call(None, orig, *a, **k)
                return open_
            self._patch(ImageFile.ImageFile, "load", wrap_load)
            self._patch(Image, "open", wrap_open)
        except ImportError:
            pass
        for modname, fnames, label in (("cv2", ("imread", "imdecode"), "OpenCV"),
                                       ("torchvision.io", ("decode_jpeg", "decode_image", "read_image"), "torchvision.io"),
                                       ("simplejpeg", ("decode_jpeg",), "simplejpeg")):
            try:
                mod = __import__(modname, fromlist=["_"])
            except Exception:
                continue
            for fname in fnames:
                if hasattr(mod, fname):
                    self._patch(mod, fname, self._timed_decoder(label))
        try:
            import torchvision.transforms as T
            import torchvision.transforms.v2 as V2
            self._patch(T.Compose, "__call__", self._timed_transform)
            self._patch(V2.Compose, "forward", self._timed_transform)
        except ImportError:
            pass
        return self

    def _decode_call(self, label, orig, *a, **k):
        """Time a decoder call; nested calls (open -> load) and calls inside transforms count once."""
        outer = self._decode_depth == 0 and self._depth == 0
        self._decode_depth += 1
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            self._decode_depth -= 1
            if outer:
                self.decode += time.perf_counter() - t0
            if label:
                self.decoders[label] = self.decoders.get(label, 0) + 1

    def _timed_decoder(self, label):
        timers = self

        def make(orig):
            def fn(*a, **k):
                return timers._decode_call(label, orig, *a, **k)
            return fn
        return make

    def _timed_transform(self, orig):
        timers = self

        def call(*a, **k):
            t0 = time.perf_counter()
            timers._depth += 1
            try:
                return orig(*a, **k)
            finally:
                timers._depth -= 1
                if timers._depth == 0:
                    timers.transform += time.perf_counter() - t0
        return call

    def __exit__(self, *exc):
        for owner, name, orig, existed in reversed(self._patches):
            if existed:
                setattr(owner, name, orig)
            else:
                delattr(owner, name)
        return False


def _alt_jpeg_speedup(files: list[str]) -> dict | None:
    """Median PIL decode time vs simplejpeg / OpenCV on the script's own JPEG files."""
    import numpy as np
    from PIL import Image
    blobs = []
    for f in files[:4]:
        try:
            with open(f, "rb") as fh:
                blobs.append(fh.read())
        except OSError:
            continue
    if not blobs:
        return None
    import io

    def pil(b):
        with Image.open(io.BytesIO(b)) as im:
            return np.asarray(im.convert("RGB"))
    cands = {"PIL": pil}
    try:
        import simplejpeg
        cands["simplejpeg"] = lambda b: simplejpeg.decode_jpeg(b, colorspace="RGB")
    except ImportError:
        pass
    try:
        import cv2
        cands["OpenCV"] = lambda b: cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR)
    except ImportError:
        pass
    times = {k: [] for k in cands}
    for _ in range(7):  # interleaved rounds
        for k, fn in cands.items():
            t0 = time.perf_counter()
            for b in blobs:
                fn(b)
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min((k for k in med if k != "PIL"), key=lambda k: med[k], default=None)
    if best is None:
        return None
    return {"best": best, "speedup": round(med["PIL"] / med[best], 3),
            "ms_per_image": {k: round(v / len(blobs) * 1e3, 4) for k, v in med.items()}}


def probe_datasets(probe, obs: dict, *, samples: int = 12) -> None:
    out = []
    seen = set()
    for loader in probe.loaders.values():
        ds = getattr(loader, "dataset", None)
        if ds is None or id(ds) in seen or not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            continue
        seen.add(id(ds))
        try:
            n = min(samples, len(ds))
        except TypeError:
            continue
        if n == 0:
            continue
        timers = _DatasetTimers()
        try:
            ds[0]  # untimed: first-call costs (imports, plugin registration, file caches)
            with timers:
                t0 = time.perf_counter()
                for i in range(n):
                    ds[i]
                total = time.perf_counter() - t0
        except Exception as e:
            obs["notes"].append(f"timing {type(ds).__name__}[i] failed: {type(e).__name__}: {e}")
            continue
        entry = {"dataset": type(ds).__name__, "getitem_ms": round(total / n * 1e3, 4),
                 "decode_ms": round(timers.decode / n * 1e3, 4), "transform_ms": round(timers.transform / n * 1e3, 4),
                 "decoders": timers.decoders, "batch_size": getattr(loader, "batch_size", None)}
        entry["other_ms"] = round(max(0.0, entry["getitem_ms"] - entry["decode_ms"] - entry["transform_ms"]), 4)
        c = timers.copies
        entry["tensor_copies"] = {"per_item": round(c["count"] / n, 3), "ms_per_item": round(c["ms"] / n, 4),
                                  "float64": c["float64"] > 0, "sites": sorted(c["sites"])[:3]}
        entry["decode_share"] = round(timers.decode / total, 4) if total > 0 else 0.0
        if timers.jpeg_files:
            entry["alt_decode"] = _alt_jpeg_speedup(timers.jpeg_files)
        out.append(entry)
    obs["datasets"] = out
