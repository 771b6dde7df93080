"""Runs `torchspeed train` (imported only when it runs): an image classifier trained on `--data`, the fast way.

PATH is an ImageFolder (one subfolder per class) or a file made by `torchspeed data pack`.
The whole pipeline: fast JPEG decoding to uint8, optional shared RAM cache, a measured
DataLoader, random-resized-crop/flip/jitter/normalize on the device, and `torchspeed.fit`
(precision, channels_last, compile, schedule, checkpoints). Writes to `--out`:
metrics.csv / metrics.json (per epoch), checkpoints/ (resumable), model.pt (final weights,
classes and settings; atomic write, load with `torch.load(..., weights_only=True)`) and
run.json (the settings actually used and what the pipeline decided).

Under `torchspeed launch --nproc N -- torchspeed train ...` every process builds the same
loaders, `fit` sets up the process group and gives each process its part of the data
(T31), and only rank 0 prints and writes the outputs.
"""

from __future__ import annotations

import json
import os

import torch
from rich.console import Console

import torchspeed
from torchspeed._io import write_json
from torchspeed.cli._auto import auto_size, parse_crop_scale, parse_size, small_val_warning
from torchspeed.cli.main import CLIError
from torchspeed.data.augment import IMAGENET_MEAN, IMAGENET_STD
from torchspeed.data.decode import ImageDecodeError
from torchspeed.data.packed import is_packed
from torchspeed.data.pipeline import build_loaders
from torchspeed.env import default_device
from torchspeed.model.spec import build_model, portable_spec
from torchspeed.train.parallel.distributed import get_world_size, is_distributed, is_rank_zero
from torchspeed.train.state.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from torchspeed.tune.loader import tune_loader


def _check_args(args) -> None:
    for name in ("epochs", "batch_size"):
        if getattr(args, name) <= 0:
            raise CLIError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    try:
        args.size = parse_size(args.size)
        args.crop_scale = parse_crop_scale(args.crop_scale)
        args.betas = _floats(args.betas, "--betas", 2)
        if args.lr != "auto":
            args.lr = _floats(args.lr, "--lr", 1)[0]
    except ValueError as e:
        raise CLIError(str(e)) from None
    if args.lr != "auto" and args.lr <= 0:
        raise CLIError(f"--lr must be positive or auto, got {args.lr}")
    if not os.path.exists(args.data):
        raise CLIError(f"--data {args.data} does not exist: pass an ImageFolder directory or a packed file")
    if args.workers != "auto" and not (args.workers.isdigit()):
        raise CLIError(f"--workers must be a number or auto, got {args.workers!r}")
    if args.cache_gb < 0:
        raise CLIError(f"--cache-gb must be >= 0, got {args.cache_gb}")
    if args.resume and args.init_from:
        raise CLIError("--resume continues the run in --out and --init-from starts a new one: pass one of them")
    if args.init_from and not os.path.exists(args.init_from):
        raise CLIError(f"--init-from {args.init_from} does not exist: pass a run folder or a .pt file")


def _floats(text: str, flag: str, n: int) -> tuple[float, ...]:
    try:
        vals = tuple(float(v) for v in str(text).split(","))
    except ValueError:
        vals = ()
    if len(vals) != n:
        raise ValueError(f"{flag} must be {n} number{'s' if n > 1 else ''}" + (" separated by a comma" if n > 1 else "")
                         + f", got {text!r}")
    return vals


def _previous_lr(out: str):
    """On --resume, the LR the run in `out` trained with (so an extension keeps its peak)."""
    try:
        with open(os.path.join(out, "run.json")) as f:
            return float(json.load(f)["lr"])
    except (OSError, ValueError, KeyError, TypeError):
        return "auto"


def _init_from(model, path: str) -> str:
    file = os.path.join(path, "model.pt") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise CLIError(f"--init-from {path}: no model.pt in this folder; pass a run folder or a .pt file")
    try:
        load_checkpoint(file, model=model)
    except CheckpointError as e:
        raise CLIError(f"--init-from {path}: {e}") from None
    return file


def run(args) -> int:
    """Train on --data: the loaders and the model built, `torchspeed.fit` run, and (on rank 0 alone) model.pt,
    run.json and the summary written."""
    _check_args(args)
    rank0, world = is_rank_zero(), get_world_size()  # from torchrun's RANK/WORLD_SIZE (1 and rank 0 otherwise)
    console = Console(quiet=not rank0, soft_wrap=True)  # --no-progress drops the bars, never the summary
    device = default_device(args.device)
    _check_device(device, args.data, world)
    torch.manual_seed(args.seed)
    try:
        size_note = ""
        if args.size == "auto":
            args.size = auto_size(args.data)
            size_note = " (auto: the images' median side)"
        pipe = build_loaders(args.data, size=args.size, batch_size=args.batch_size, val_fraction=args.val_fraction,
                             val_path=args.val, workers=args.workers if args.workers == "auto" else int(args.workers),
                             cache_bytes=int(args.cache_gb * (1 << 30)), augment=args.augment, jitter=args.jitter,
                             scale=args.crop_scale, device=device, on_error=args.on_error, seed=args.seed,
                             progress=not args.no_progress, tune_workers=tune_loader)
        model = build_model(args.model, num_classes=len(pipe.classes))
    except (ImageDecodeError, ValueError) as e:
        raise CLIError(str(e)) from None
    init = _init_from(model, args.init_from) if args.init_from else None
    lr = _previous_lr(args.out) if args.resume and args.lr == "auto" else args.lr
    n_train = len(pipe.train.dataset) if pipe.train.dataset is not None else "?"
    n_val = len(pipe.val.dataset) if pipe.val is not None else 0
    console.print(_headline(args, pipe, n_train=n_train, n_val=n_val, device=device, world=world,
                            size_note=size_note, init=init))
    warning = small_val_warning(n_val)
    if warning:
        console.print(f"[yellow]warning[/]: {warning}")
    os.makedirs(args.out, exist_ok=True)
    try:
        result = torchspeed.fit(model, pipe.train, val_loader=pipe.val, lr=lr, device=device, **_fit_options(args))
    except ImageDecodeError as e:
        raise CLIError(f"{e} (or run with --on-error skip)") from None
    except CheckpointError as e:
        raise CLIError(f"--resume: {e}") from None
    bad = _bad_files(pipe, world, distributed=is_distributed())
    if not rank0:  # the replicas are identical after DDP: one writer per file
        return 0
    _write_outputs(args, console, model, result, pipe, lr=lr, bad=bad, world=world, n_train=n_train, n_val=n_val)
    return 0


def _bad_files(pipe, world: int, *, distributed: bool) -> list:
    """The files that failed to decode, sorted; under a process group, every rank's (each process decoded only
    its part of the data)."""
    bad = sorted({b for ds in pipe.datasets.values() for b in ds.summary().bad})
    if distributed:  # each process decoded only its part of the data: collect every rank's bad files
        every = [None] * world
        torch.distributed.all_gather_object(every, bad)
        bad = sorted(set().union(*every))
    return bad


def _write_outputs(args, console, model, result, pipe, *, lr, bad: list, world: int, n_train, n_val: int) -> None:
    """Rank 0's outputs: model.pt, run.json (with the peak learning rate the run used) and the summary."""
    _save_model(os.path.join(args.out, "model.pt"), model, args=args, classes=pipe.classes)
    peak = result.decisions.get("peak_lr")
    used_lr = float(peak.value if peak is not None else lr)
    write_json(os.path.join(args.out, "run.json"), _run_info(args, result, pipe, lr=used_lr, bad=bad, world=world,
                                                             n_train=n_train, n_val=n_val))
    _print_summary(console, result, classes=pipe.classes, lr=used_lr, bad=bad, out=args.out)


def _check_device(device, data: str, world: int) -> None:
    """The device and the process count can train on `data`: a CUDA device asked for is visible, and a packed
    file is not split between processes (its block-shuffle sampler has no distributed version yet)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda asked for, but no CUDA GPU is visible; use --device cpu")
    if world > 1 and is_packed(data):
        raise CLIError("a packed file cannot be split between processes yet: under `torchspeed launch` "
                       "pass the ImageFolder it was packed from as --data")


def _headline(args, pipe, *, n_train, n_val: int, device, world: int, size_note: str, init: str | None) -> str:
    """The line printed before training: model, data, split sizes, epochs, batch, size (and where it came from),
    device and processes, what the pipeline decided (loader, where the random crop runs), the weights' origin."""
    return (f"[bold]torchspeed train[/]: {args.model} on {args.data} ({len(pipe.classes)} classes, "
            f"{n_train} training / {n_val} validation images), {args.epochs} epoch(s), batch {args.batch_size}, "
            f"size {args.size}{size_note}, {device}{f' x {world} processes' if world > 1 else ''}; "
            f"{pipe.decisions['loader']}, random crop on the {pipe.decisions['augment']}"
            + (f"; weights from {init}" if init else ""))


def _fit_options(args) -> dict:
    """The flags as `torchspeed.fit`'s options (besides the model, loaders, LR and device; one-cycle around the LR,
    measured or given, as --lr says): --compile on/off as
    True/False, checkpoints under --out, --resume as resume="auto", the best epoch restored unless told not to."""
    return dict(epochs=args.epochs, optimizer=args.optimizer, weight_decay=args.weight_decay,
                momentum=args.momentum, betas=args.betas, precision=args.precision,
                compile={"auto": "auto", "on": True, "off": False}[args.compile], max_steps=args.max_steps,
                out_dir=args.out, checkpoint_dir=os.path.join(args.out, "checkpoints"),
                resume="auto" if args.resume else None, seed=args.seed,
                restore_best=False if args.no_restore_best else "auto", progress=not args.no_progress,
                schedule="onecycle")  # --lr is the peak of a one-cycle schedule (measured, or given)


def _run_info(args, result, pipe, *, lr: float, bad: list[str], world: int, n_train, n_val: int) -> dict:
    """run.json: the settings used (the flags, the peak LR trained with), the classes, what the pipeline and fit
    decided, the data's sizes and files (bad ones listed), the final metrics and the process count."""
    data = {"train_images": n_train, "val_images": n_val,
            "val_from": args.val or (f"{args.val_fraction:.0%} held out of --data" if n_val else "none"),
            **{f"{k}_files": str(ds.summary()) for k, ds in pipe.datasets.items()
               if k == "train" or args.val}}
    # "func": null keeps run.json's args as they were when the parser set the runner function
    return {"args": vars(args) | {"func": None}, "lr": lr, "classes": pipe.classes,
            "pipeline": pipe.decisions, "fit_decisions": result.decisions, "data": data, "bad_files": bad,
            "final": result.final, "world_size": world}


def _print_summary(console, result, *, classes, lr, bad, out) -> None:
    d, final = result.decisions, result.final
    for key, what in (("lr_find", "lr"), ("extended", "extended"), ("restored_best", "restored the best weights")):
        if key in d:
            console.print(f"{what}: {d[key]}")
    msg = f"done: {result.steps} steps, peak lr {lr:.3g}, train_loss {final.get('train_loss', float('nan')):.4f}"
    if final.get("val_acc") is not None:
        msg += f", val_acc {final['val_acc']:.4f} (last epoch; chance {1 / len(classes):.3f})"
    console.print(msg)
    if bad:
        console.print(f"[yellow]skipped {len(bad)} bad image file(s)[/]: " + ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""))
    console.print(f"wrote {out}/model.pt, metrics.csv, metrics.json, run.json and checkpoints/")


def _save_model(path: str, model, *, args, classes: list[str]) -> None:
    """model.pt: weights, classes and how to rebuild and feed the model (`torchspeed.load_model`); written
    atomically (`save_checkpoint`: fsync and checksum)."""
    state = {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "classes": list(classes),
             "model_name": portable_spec(args.model), "size": args.size, "crop": "center",
             "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}
    save_checkpoint(path, state)
