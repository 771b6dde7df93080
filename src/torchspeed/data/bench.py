"""Measure image pipelines side by side: torchvision vs torchspeed vs decode-only (T04, T11).

`bench_pipelines(root)` runs the same files, in one process on one thread, through
  (a) torchvision: `ImageFolder` + Pillow + RandomResizedCrop(size) + RandomHorizontalFlip + ToTensor,
  (b) torchspeed: `FastImageFolder(size, crop="random", flip=True)` -> uint8 tensor of the same size,
  (c) decode-only: read the file + `simplejpeg.decode_jpeg` at full size, nothing else,
  (d) nvjpeg (when a CUDA GPU is used): read the files, decode each batch of 64 on the GPU in one
      nvjpeg call (`decode_jpeg_batch`, torchvision's decoder), RandomResizedCrop + flip on the
      GPU, and stack: the batch is ready on the device. One CPU thread feeds it,
interleaved (round r runs every pipeline once over all files, the order rotating per round),
after an untimed warm-up pass that also loads the files into the page cache. Each row's
img/s is the median over rounds; ratios are medians of per-round ratios, so a machine that
slows down mid-run affects all pipelines alike.

Example:
    >>> r = bench_pipelines("photos/", size=224, rounds=5)
    >>> r.ratio("torchspeed", "torchvision")
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from torchspeed._extras import require
from torchspeed.env import sync
from torchspeed.train.rounds import paired_ratios, turns

__all__ = ["PipelineRow", "DataBenchResult", "bench_pipelines", "single_thread"]

PIPELINES = ("torchvision", "torchspeed", "decode-only")


@dataclass(frozen=True)
class PipelineRow:
    pipeline: str
    img_per_s: float
    samples: tuple[float, ...]


@dataclass(frozen=True)
class DataBenchResult:
    rows: tuple[PipelineRow, ...]
    ratios: dict
    files: int
    size: int
    rounds: int
    meta: dict = field(default_factory=dict)

    def row(self, name: str) -> PipelineRow:
        return next(r for r in self.rows if r.pipeline == name)

    def ratio(self, a: str, b: str) -> float:
        return self.ratios[f"{a}/{b}"]

    def to_dict(self) -> dict:
        return {"rows": [asdict(r) | {"samples": list(r.samples)} for r in self.rows], "ratios": self.ratios,
                "files": self.files, "size": self.size, "rounds": self.rounds, "meta": self.meta}


@contextlib.contextmanager
def single_thread():
    """torch and OpenCV on one thread (Pillow and simplejpeg are single-threaded anyway)."""
    cv2 = require("cv2", "data")
    t, c = torch.get_num_threads(), cv2.getNumThreads()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    try:
        yield
    finally:
        torch.set_num_threads(t)
        cv2.setNumThreads(c)


def _gpu_random_resized_crop(img: torch.Tensor, size: int) -> torch.Tensor:
    """torchvision's RandomResizedCrop + RandomHorizontalFlip on one CHW uint8 image on the GPU."""
    RandomResizedCrop = require("torchvision.transforms", "data").RandomResizedCrop
    from torchvision.transforms.v2 import functional as F

    top, left, h, w = RandomResizedCrop.get_params(img, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
    out = F.resized_crop(img, top, left, h, w, size=[size, size], antialias=True)
    return out.flip(-1) if torch.rand(()) < 0.5 else out


def _nvjpeg_pipeline(paths: list[str], size: int, device: torch.device, batch: int = 64):
    from torchspeed.data.decode import decode_jpeg_batch

    def run_nvjpeg():
        for i in range(0, len(paths), batch):
            datas = []
            for p in paths[i:i + batch]:
                with open(p, "rb") as f:
                    datas.append(f.read())
            imgs = decode_jpeg_batch(datas, device=device)
            torch.stack([_gpu_random_resized_crop(im, size) for im in imgs])
        sync(device)

    return run_nvjpeg


def _pipelines(root: str, size: int, limit: int | None, device: torch.device | None = None):
    simplejpeg = require("simplejpeg", "data")
    require("torchvision", "data", feature="the torchvision row of the data bench")
    from torchvision import datasets, transforms as T

    from torchspeed.data.folder import FastImageFolder

    tv = datasets.ImageFolder(root, transform=T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(),
                                                         T.ToTensor()]))
    ts = FastImageFolder(root, size=size, crop="random", flip=True)
    n = min(len(ts), limit) if limit else len(ts)
    if len(tv) != len(ts):
        raise ValueError(f"torchvision sees {len(tv)} images and torchspeed {len(ts)} under {root}: "
                         "the folder has files one of them skips")
    paths = [p for p, _ in ts.samples[:n]]

    def run_tv():
        for i in range(n):
            tv[i]

    def run_ts():
        for i in range(n):
            ts[i]

    def run_dec():
        for p in paths:
            with open(p, "rb") as f:
                simplejpeg.decode_jpeg(f.read())

    fns = {"torchvision": run_tv, "torchspeed": run_ts, "decode-only": run_dec}
    if device is not None and device.type == "cuda":
        fns["nvjpeg"] = _nvjpeg_pipeline(paths, size, device)
    return n, fns


def bench_pipelines(root: str | os.PathLike, *, size: int = 224, rounds: int = 5, limit: int | None = None,
                    progress: bool = False, device: str | torch.device | None = "auto") -> DataBenchResult:
    """img/s of the pipelines on the files under `root` (see the module docstring).

    `device="auto"` adds the nvjpeg row when torch sees a CUDA GPU; "cpu" leaves it out.
    """
    from torchspeed.train.loop.progress import track

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if device == "auto":
        from torchspeed.env import default_device

        device = default_device()
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: no CUDA GPU is visible to torch here; use --device cpu")
    root = str(root)
    with single_thread():
        n, fns = _pipelines(root, size, limit, device)
        rates: dict[str, list[float]] = {k: [] for k in fns}
        # one warm-up each (imports, page cache, the backend choice), then rounds, each starting one pipeline later
        for name, r in track(turns(list(fns), rounds=rounds, warmup=1, order="rotate"), description="measuring",
                             enabled=progress):
            t0 = time.perf_counter()
            fns[name]()
            if r:
                rates[name].append(n / (time.perf_counter() - t0))
    rows = tuple(PipelineRow(k, statistics.median(v), tuple(v)) for k, v in rates.items())
    ratios = {}
    pairs = [("torchspeed", "torchvision"), ("torchspeed", "decode-only"), ("decode-only", "torchvision")]
    if "nvjpeg" in rates:
        pairs += [("nvjpeg", "torchvision"), ("nvjpeg", "torchspeed")]
    for a, b in pairs:
        ratios[f"{a}/{b}"] = statistics.median(paired_ratios(rates[a], rates[b]))
    return DataBenchResult(rows=rows, ratios=ratios, files=n, size=size, rounds=rounds)
