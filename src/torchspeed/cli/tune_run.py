"""Runs `torchspeed tune` (imported only when it runs): the data set and model built, each tuner asked for run in
turn, its table printed, its result in tune.json (and the LR curve in lr.png)."""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

from torchspeed._extras import require
from torchspeed._io import write_json
from torchspeed.bench.runner import provenance
from torchspeed.bench.workloads import MODELS, TEXT_MODELS, SyntheticImages, create_model, digits
from torchspeed.cli._auto import auto_size, parse_size
from torchspeed.cli.main import CLIError
from torchspeed.cli.tune import BUILTIN
from torchspeed.env import default_device
from torchspeed.model.spec import build_model, is_custom
from torchspeed.tune import (BatchSizeResult, LoaderSettings, LRFinderResult, NoiseScaleResult, find_batch_size,
                             find_lr, measure_noise_scale, tune_loader)
from torchspeed.tune._jpeg import JpegImages


def _dataset(args):
    n = 1024 if args.quick else 4096
    if args.data == "synthetic":
        return SyntheticImages(n, size=args.image_size)
    if args.data == "digits":
        return digits(size=args.image_size)[0]
    if args.data == "jpeg":
        return JpegImages(n // 4, size=256, out_size=args.image_size)
    path = Path(args.data)
    if not path.exists():
        raise CLIError(f"--data {args.data}: no such folder, and not one of {', '.join(BUILTIN)}")
    if not path.is_dir():
        raise CLIError(f"--data {args.data}: expected a folder of class sub-folders with images")
    torchvision = require("torchvision", "data", feature=f"--data {args.data} (an image folder)")
    from torchvision import transforms

    tf = transforms.Compose([transforms.Resize(args.image_size), transforms.CenterCrop(args.image_size),
                             transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.25] * 3)])
    try:
        ds = torchvision.datasets.ImageFolder(str(path), transform=tf)
    except (FileNotFoundError, RuntimeError) as e:
        raise CLIError(f"--data {args.data}: {e}") from e
    return ds


def _num_classes(ds) -> int:
    if hasattr(ds, "classes"):
        return len(ds.classes)
    if hasattr(ds, "num_classes"):
        return ds.num_classes
    return 10


def _image_size(args) -> int:
    try:
        size = parse_size(args.image_size, "--image-size", minimum=4)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if size != "auto":
        return size
    if args.data in BUILTIN:
        return 32
    if not Path(args.data).is_dir():
        raise CLIError(f"--data {args.data}: no such folder, and not one of {', '.join(BUILTIN)}")
    try:
        return auto_size(args.data)
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(f"--data {args.data}: {e}") from None


def _model(args, num_classes: int):
    image_models = [m for m in MODELS if m not in TEXT_MODELS]  # tune's data are images
    try:
        if is_custom(args.model):
            return build_model(args.model, num_classes=num_classes)
        if args.model not in image_models:
            raise CLIError(f"--model {args.model}: not one of {', '.join(image_models)}, nor module:function")
        return create_model(args.model, num_classes=num_classes, image_size=args.image_size)
    except ValueError as e:
        raise CLIError(str(e)) from None


def _check_args(args) -> None:
    """The numeric options' expected mistakes as one-line errors, before the data load."""
    args.image_size = _image_size(args)
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be positive, got {args.batch_size}")
    if args.min_steps < 1:
        raise CLIError(f"--min-steps must be at least 1, got {args.min_steps}")
    if args.max_batch < 8:
        raise CLIError(f"--max-batch must be at least 8, got {args.max_batch}")


def run(args) -> int:
    """Each tuner asked for, in turn, on one model and data set: its table printed, its result in tune.json."""
    _check_args(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA GPU is visible to torch here; use --device cpu")
    device = default_device(args.device)
    console = Console()
    ds = _dataset(args)
    if len(ds) < args.batch_size:
        raise CLIError(f"--data {args.data} has {len(ds)} samples, fewer than one batch of {args.batch_size}")
    torch.manual_seed(0)
    model = _model(args, _num_classes(ds)).to(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"workload": {"model": args.model, "data": args.data, "samples": len(ds),
                                 "image_size": args.image_size, "device": str(device)},
                    "provenance": provenance()}
    console.print(f"[bold]torchspeed tune {args.what}[/]: {args.model} on {args.data} ({len(ds)} samples, "
                  f"{args.image_size} px) on {device}")

    if args.what in ("batch", "all"):
        budget = int(args.memory_budget_mb * 2 ** 20) if args.memory_budget_mb else None
        cap = max(8, len(ds) // args.min_steps // 8 * 8)
        res = find_batch_size(model, ds, max_batch=min(args.max_batch, cap), memory_budget=budget,
                              rounds=2 if args.quick else 3)
        console.print(_batch_table(res, samples=len(ds), cap=cap, args=args))
        report["batch"] = res.to_dict()

    if args.what in ("lr", "all"):
        loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
        res_lr = find_lr(model, loader, num_steps=60 if args.quick else 100, plot=out / "lr.png")
        _print_lr(console, res_lr)
        report["lr"] = res_lr.to_dict()

    if args.what in ("loader", "all"):
        s = tune_loader(ds, batch_size=args.batch_size, model=model, device=device, batches=8 if args.quick else 16)
        console.print(_loader_table(s))
        console.print(s.reason)
        report["loader"] = s.to_dict()

    if args.what in ("noise", "all"):
        loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
        ns = measure_noise_scale(model, loader, batches=4 if args.quick else 8)
        _print_noise(console, ns)
        report["noise"] = {"noise_scale": ns.noise_scale, "critical_batch_size": ns.critical_batch_size,
                           "batches": ns.batches, "batch_size": ns.batch_size, "suggestion": ns.suggestion}

    write_json(out / "tune.json", report)
    console.print(f"wrote {out / 'tune.json'}" + (f" and {out / 'lr.png'}" if "lr" in report else ""))
    return 0


def _batch_table(res: BatchSizeResult, *, samples: int, cap: int, args) -> Table:
    """The batch finder's table, titled with what limited the largest batch: the --min-steps cap (when it, not
    memory, stopped the search) or the finder's own limit."""
    limit = (f"an epoch of {samples} samples keeps {args.min_steps}+ steps" if cap < args.max_batch
             and res.limited_by != "memory" else f"limited by {res.limited_by}")
    t = Table(title=f"batch size: largest {res.largest} ({limit}), fastest {res.fastest}")
    for col in ("batch", "fits", "samples/s", "memory", "note"):
        t.add_column(col, justify="left" if col == "note" else "right")
    for r in res.table:
        t.add_row(str(r.batch_size), "yes" if r.fits else "no",
                  "-" if r.samples_per_s is None else f"{r.samples_per_s:,.0f}",
                  "-" if r.peak_bytes is None else f"{r.peak_bytes / 2 ** 20:,.1f} MiB", r.note)
    return t


def _print_lr(console: Console, res_lr: LRFinderResult) -> None:
    """The LR range test's table (every rule's LR, and the measured trials when the curve could not be read),
    then the rule that made the suggestion and its confidence."""
    t = Table(title="learning rate (range test)")
    t.add_column("rule")
    t.add_column("lr", justify="right")
    for name, v in (("suggestion", res_lr.suggestion), ("steepest (smoothed)", res_lr.steepest_lr),
                    ("valley", res_lr.valley_lr), ("loss minimum", res_lr.min_loss_lr),
                    ("bottom of the fall (90%)", res_lr.bottom_lr),
                    ("one-cycle max_lr", res_lr.max_lr), ("one-cycle min_lr", res_lr.min_lr)):
        t.add_row(name, f"{v:.3g}")
    for lr, score in res_lr.trial:  # the measured fallback, when the curve could not be read
        t.add_row(f"trial: mean loss {score:.4g}", f"{lr:.3g}")
    console.print(t)
    console.print(f"suggestion by: {res_lr.rule}" + ("; stopped when the loss diverged" if res_lr.diverged else ""))
    console.print(f"confidence: {res_lr.confidence}" + (f" ({res_lr.warning})" if res_lr.warning else ""))


def _loader_table(s: LoaderSettings) -> Table:
    """The loader tuner's trials, titled with the settings it chose; its medians in bold."""
    t = Table(title=f"DataLoader: num_workers={s.num_workers}, prefetch_factor={s.prefetch_factor}, "
                    f"pin_memory={s.pin_memory}, persistent_workers={s.persistent_workers}")
    for col in ("trial", "workers", "pin", "prefetch", "samples/s", "start-up s", "measured"):
        t.add_column(col, justify="left" if col == "trial" else "right")
    for r in s.table:
        t.add_row(r.note or "-", str(r.num_workers), str(r.pin_memory), str(r.prefetch_factor or "-"),
                  f"{r.samples_per_s:,.0f}", f"{r.startup_s:.2f}" if not r.end_to_end else "-",
                  "load + step" if r.end_to_end else "loader",
                  style="bold" if r.note.startswith("median") else None)
    return t


def _print_noise(console: Console, ns: NoiseScaleResult) -> None:
    """The gradient noise scale, the critical batch size it implies (when measurable), and its suggestion."""
    crit = ns.critical_batch_size
    console.print(f"[bold]gradient noise scale[/] B_simple ~{ns.noise_scale:,.0f} samples at the current weights "
                  f"({ns.batches} batches of {ns.batch_size}, two halves each): critical batch size "
                  f"{crit if crit else 'not measurable yet'}")
    console.print(ns.suggestion)
