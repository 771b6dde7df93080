"""Benchmark: fast image data (T04, T05, T09, T10, T11) against torchvision, on this machine.

Claim (docs/data.md): on JPEGs made from real photos (scikit-image's bundled photos, random
crops resized to a longer side of 450-530 px, quality 90), torchspeed's CPU pipeline
(DCT-domain-scaled libjpeg-turbo decode + OpenCV crop/resize to a uint8 tensor) reaches at
least 2x the img/s of torchvision's (ImageFolder + Pillow + RandomResizedCrop + flip +
ToTensor) per core and at least 80% of a bare full-size simplejpeg decode; with a cache
large enough for the dataset the second epoch is at least 3x the first.

Sections (each interleaved: every variant runs once per round, medians over rounds, after
an untimed warm-up):
  pipelines   one process, one thread: torchvision vs torchspeed vs decode-only (`torchspeed data bench`)
  workers     DataLoader(num_workers=2, batch 32), a whole epoch: torchvision vs torchspeed
  cache       CachedDataset(FastImageFolder(size=256, crop="center")): epoch 1 vs epoch 2, fresh cache each repeat
  packed      PackedDataset vs FastImageFolder, the same random-crop pipeline, one thread
  augment     a batch of 64 uint8 256x256 images -> 224, one thread: DeviceAugment vs kornia vs
              torchvision.transforms.v2 per sample (crop, flip, colour jitter, normalize)
  scales      simplejpeg full decode vs DCT-domain scales 1/2, 5/8, 3/4, 7/8 (why only powers of two are used)

`--sections a,b` runs a subset and updates those keys of an existing JSON (the rest is kept).

Run: python benchmarks/bench_data.py [--quick] [--json benchmarks/results/cpu/bench_data.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from torchspeed.bench.runner import provenance
from torchspeed.data import (CachedDataset, DeviceAugment, FastImageFolder, PackedDataset, make_jpeg_folder,
                             pack_folder, uint8_collate)
from torchspeed.data.bench import bench_pipelines, single_thread


def interleaved(fns: dict, rounds: int, *, warmup: bool = True) -> dict[str, list[float]]:
    """Seconds per call of each fn, `rounds` interleaved rounds (order rotating), after one warm-up call."""
    if warmup:
        for fn in fns.values():
            fn()
    out: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            out[name].append(time.perf_counter() - t0)
    return out


def summarize(times: dict[str, list[float]], n: int, base: str) -> dict:
    rows = {k: {"img_per_s": statistics.median(n / t for t in v), "samples_s": v} for k, v in times.items()}
    for k, v in times.items():
        rows[k]["vs_" + base] = statistics.median(b / t for t, b in zip(v, times[base]))
    return rows


def bench_workers(root: str, size: int, rounds: int, workers: int = 2) -> dict:
    from torchvision import datasets, transforms as T

    tv = datasets.ImageFolder(root, transform=T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(),
                                                         T.ToTensor()]))
    ts = FastImageFolder(root, size=size, crop="random", flip=True)
    kw = dict(batch_size=32, shuffle=True, num_workers=workers, persistent_workers=True, prefetch_factor=2)
    loaders = {"torchvision": DataLoader(tv, **kw), "torchspeed": DataLoader(ts, collate_fn=uint8_collate, **kw)}

    def epoch(loader):
        return lambda: sum(len(y) for _, y in loader)

    times = interleaved({k: epoch(v) for k, v in loaders.items()}, rounds)
    return {"workers": workers, "batch_size": 32, "rows": summarize(times, len(ts), "torchvision")}


def bench_cache(root: str, rounds: int, workers: int) -> dict:
    e1, e2 = [], []
    stats = None
    for _ in range(rounds):
        base = FastImageFolder(root, size=256, crop="center")
        ds = CachedDataset(base, budget_bytes=len(base) * 220_000)
        kw = dict(batch_size=32, shuffle=True, num_workers=workers, collate_fn=uint8_collate)
        if workers:
            kw.update(persistent_workers=True)
        loader = DataLoader(ds, **kw)
        if workers:
            next(iter(DataLoader(base, batch_size=1, num_workers=0)))  # imports/backend choice outside timing
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            sum(len(y) for _, y in loader)
            times.append(time.perf_counter() - t0)
        e1.append(len(ds) / times[0])
        e2.append(len(ds) / times[1])
        stats = ds.stats()
    return {"workers": workers, "epoch1_img_per_s": statistics.median(e1), "epoch2_img_per_s": statistics.median(e2),
            "epoch2_over_epoch1": statistics.median(b / a for a, b in zip(e1, e2)), "epoch1_samples": e1,
            "epoch2_samples": e2, "stats_last": {k: getattr(stats, k) for k in stats.__dataclass_fields__},
            "budget_held": stats.bytes_reserved <= stats.budget_bytes}


def bench_packed(root: str, size: int, rounds: int, tmp: str) -> dict:
    r = pack_folder(root, os.path.join(tmp, "photos.tspack"))
    folder = FastImageFolder(root, size=size, crop="random", flip=True)
    packed = PackedDataset(r.path, size=size, crop="random", flip=True)

    def run(ds):
        return lambda: [ds[i] for i in range(len(ds))]

    times = interleaved({"folder": run(folder), "packed": run(packed)}, rounds)
    return {"images": r.images, "bytes": r.bytes, "rows": summarize(times, len(folder), "folder")}


def bench_augment(rounds: int, batch: int = 64) -> dict:
    torch.manual_seed(0)
    x = torch.randint(0, 256, (batch, 3, 256, 256), dtype=torch.uint8)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    ours = DeviceAugment(size=224, brightness=0.2, contrast=0.2, saturation=0.2, channels_last=False)
    fns = {"torchspeed DeviceAugment": lambda: ours(x)}
    from torchvision.transforms import v2

    tv = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(),
                     v2.ColorJitter(0.2, 0.2, 0.2), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])
    fns["torchvision v2 (per sample)"] = lambda: torch.stack([tv(img) for img in x])
    kornia_version = None
    try:
        import kornia
        import kornia.augmentation as K

        kornia_version = kornia.__version__
        kaug = torch.nn.Sequential(K.RandomResizedCrop((224, 224)), K.RandomHorizontalFlip(),
                                   K.ColorJitter(0.2, 0.2, 0.2, p=1.0),
                                   K.Normalize(mean=torch.tensor(mean), std=torch.tensor(std)))
        fns["kornia (batched)"] = lambda: kaug(x.float() / 255)
    except ImportError:
        pass
    with torch.no_grad():
        times = interleaved(fns, rounds)
    rows = {k: {"ms_per_batch": 1000 * statistics.median(v), "samples_s": v} for k, v in times.items()}
    base = times["torchspeed DeviceAugment"]
    for k, v in times.items():
        rows[k]["time_vs_torchspeed"] = statistics.median(t / b for t, b in zip(v, base))
    return {"batch": batch, "input": [3, 256, 256], "output": [3, 224, 224], "kornia": kornia_version, "rows": rows}


def bench_scales(root: str, rounds: int) -> dict:
    import math

    import simplejpeg

    datas = [p.read_bytes() for p in sorted(Path(root).glob("*/*.jpg"))]
    heads = [simplejpeg.decode_jpeg_header(d)[:2] for d in datas]

    def run(num):
        def fn():
            for d, (h, w) in zip(datas, heads):
                if num == 8:
                    simplejpeg.decode_jpeg(d)
                else:  # ask for exactly num/8 of the size
                    simplejpeg.decode_jpeg(d, min_height=math.ceil(h * num / 8), min_width=math.ceil(w * num / 8))
        return fn

    fns = {f"{n}/8": run(n) for n in (8, 4, 5, 6, 7, 2)}
    times = interleaved(fns, rounds)
    return {"rows": summarize(times, len(datas), "8/8")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default="benchmarks/results/cpu/bench_data.json")
    ap.add_argument("--images-per-class", type=int, default=25)
    ap.add_argument("--sections", default="pipelines,workers,cache,packed,augment,scales")
    args = ap.parse_args()
    rounds = 3 if args.quick else 7
    sections = args.sections.split(",")
    result: dict = {}
    if os.path.exists(args.json) and args.sections != ap.get_default("sections"):
        with open(args.json) as f:
            result = json.load(f)  # keep the sections not re-run
        result.setdefault("meta_by_section", {})
        for sec in sections:
            result["meta_by_section"][sec] = provenance() | {"command": "python " + " ".join(sys.argv)}
    else:
        result["meta"] = provenance() | {"command": "python " + " ".join(sys.argv)}
    with tempfile.TemporaryDirectory() as tmp:
        root = str(make_jpeg_folder(os.path.join(tmp, "photos"), n_per_class=args.images_per_class, classes=8,
                                    max_side=(450, 530), quality=90))
        files = sorted(Path(root).glob("*/*.jpg"))
        sizes = [os.path.getsize(f) for f in files]
        result["dataset"] = {"images": len(files), "classes": 8, "max_side": [450, 530], "quality": 90,
                             "mean_kb": statistics.mean(sizes) / 1024,
                             "source": "torchspeed.data.make_jpeg_folder (scikit-image photos)"}
        if "pipelines" in sections:
            r = bench_pipelines(root, size=224, rounds=rounds, progress=True)
            result["pipelines"] = r.to_dict() | {"threads": 1}
            print("pipelines:", {row.pipeline: round(row.img_per_s) for row in r.rows}, r.ratios, flush=True)
        if "workers" in sections:
            result["workers"] = bench_workers(root, 224, max(2, rounds // 2))
            print("workers:", {k: round(v["img_per_s"]) for k, v in result["workers"]["rows"].items()}, flush=True)
        with single_thread():
            if "cache" in sections:
                result["cache"] = bench_cache(root, max(2, rounds // 2), workers=0)
                print("cache:", {k: v for k, v in result["cache"].items() if not k.endswith("samples")}, flush=True)
            if "packed" in sections:
                result["packed"] = bench_packed(root, 224, rounds, tmp)
                print("packed:", {k: round(v["img_per_s"]) for k, v in result["packed"]["rows"].items()}, flush=True)
            if "scales" in sections:
                result["scales"] = bench_scales(root, rounds)
                print("scales:", {k: round(v["img_per_s"]) for k, v in result["scales"]["rows"].items()}, flush=True)
            if "augment" in sections:
                result["augment"] = bench_augment(max(3, rounds // 2))
                print("augment:", {k: round(v["ms_per_batch"], 1) for k, v in result["augment"]["rows"].items()},
                      flush=True)
        if "cache" in sections and not args.quick:
            result["cache_workers"] = bench_cache(root, 2, workers=2)
            print("cache (2 workers):", {k: v for k, v in result["cache_workers"].items() if not k.endswith("samples")})
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    tmp_json = args.json + ".tmp"
    with open(tmp_json, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp_json, args.json)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
