"""`torchspeed train --data PATH`: train an image classifier on a folder of images, the fast way (T04-T11).

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

import os

from torchspeed._io import write_json
from torchspeed.cli.main import CLIError
from torchspeed.env import default_device


def register(sub) -> None:
    p = sub.add_parser("train", help="train an image classifier on an image folder or packed file")
    p.add_argument("--data", required=True, help="ImageFolder directory (root/<class>/<image>) or packed file")
    p.add_argument("--val", default=None, help="separate validation ImageFolder/packed file (default: hold out)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held out for validation when no --val (0.1)")
    p.add_argument("--model", default="resnet18", help="a torchvision or timm model name, or simple_cnn")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224, help="training image side in pixels (224)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 0.1 for sgd, 1e-3 for adamw)")
    p.add_argument("--optimizer", default="sgd", help="sgd | adamw | ... (see torchspeed.create_optimizer)")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--workers", default="auto", help="DataLoader workers: a number, or auto (measured)")
    p.add_argument("--cache-gb", type=float, default=0.0, help="keep decoded images in shared RAM up to this size")
    p.add_argument("--augment", default="auto", choices=["auto", "device", "cpu"],
                   help="where the random crop runs: device (batched), cpu (in the loader workers, at full "
                        "resolution); auto: device on CUDA or with --cache-gb, else cpu")
    p.add_argument("--jitter", type=float, default=0.0,
                   help="brightness/contrast/saturation jitter strength, applied on the device (default 0: off)")
    p.add_argument("--precision", default="auto", help="auto | fp32 | bf16 | fp16")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--out", default="runs/train", help="output folder (metrics, checkpoints, model.pt)")
    p.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in --out")
    p.add_argument("--on-error", default="skip", choices=["skip", "raise"],
                   help="bad image files: skip and report them (default) or stop with an error")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _check_args(args) -> None:
    for name in ("epochs", "batch_size", "size"):
        if getattr(args, name) <= 0:
            raise CLIError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.size < 16:
        raise CLIError(f"--size {args.size} is too small; use at least 16")
    if not os.path.exists(args.data):
        raise CLIError(f"--data {args.data} does not exist: pass an ImageFolder directory or a packed file")
    if args.workers != "auto" and not (args.workers.isdigit()):
        raise CLIError(f"--workers must be a number or auto, got {args.workers!r}")
    if args.cache_gb < 0:
        raise CLIError(f"--cache-gb must be >= 0, got {args.cache_gb}")


def run(args) -> int:
    _check_args(args)
    import torch
    from rich.console import Console

    import torchspeed
    from torchspeed.data.decode import ImageDecodeError
    from torchspeed.data.pipeline import build_loaders, create_classifier
    from torchspeed.train.distributed import get_world_size, is_distributed, is_rank_zero

    rank0, world = is_rank_zero(), get_world_size()  # from torchrun's RANK/WORLD_SIZE (1 and rank 0 otherwise)
    console = Console(quiet=args.no_progress or not rank0)
    device = default_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda asked for, but no CUDA GPU is visible; use --device cpu")
    if world > 1:
        from torchspeed.data.packed import is_packed

        if is_packed(args.data):  # its block-shuffle sampler has no distributed version (yet)
            raise CLIError("a packed file cannot be split between processes yet: under `torchspeed launch` "
                           "pass the ImageFolder it was packed from as --data")
    torch.manual_seed(args.seed)
    try:
        pipe = build_loaders(args.data, size=args.size, batch_size=args.batch_size, val_fraction=args.val_fraction,
                             val_path=args.val, workers=args.workers if args.workers == "auto" else int(args.workers),
                             cache_bytes=int(args.cache_gb * (1 << 30)), augment=args.augment, jitter=args.jitter,
                             device=device, on_error=args.on_error, seed=args.seed, progress=not args.no_progress)
        model = create_classifier(args.model, num_classes=len(pipe.classes))
    except ImageDecodeError as e:
        raise CLIError(str(e)) from None
    except ValueError as e:
        raise CLIError(str(e)) from None
    lr = args.lr if args.lr is not None else (0.1 if args.optimizer == "sgd" else 1e-3)
    n_train = len(pipe.train.dataset) if pipe.train.dataset is not None else "?"
    console.print(f"[bold]torchspeed train[/]: {args.model} on {args.data} ({len(pipe.classes)} classes, "
                  f"{n_train} training images), {args.epochs} epoch(s), batch {args.batch_size}, size {args.size}, "
                  f"{device}{f' x {world} processes' if world > 1 else ''}; {pipe.decisions['loader']}, "
                  f"random crop on the {pipe.decisions['augment']}")
    os.makedirs(args.out, exist_ok=True)
    compile_opt = {"auto": "auto", "on": True, "off": False}[args.compile]
    try:
        result = torchspeed.fit(model, pipe.train, val_loader=pipe.val, epochs=args.epochs, lr=lr,
                                optimizer=args.optimizer, weight_decay=args.weight_decay, device=device,
                                precision=args.precision, compile=compile_opt, max_steps=args.max_steps,
                                out_dir=args.out, checkpoint_dir=os.path.join(args.out, "checkpoints"),
                                resume="auto" if args.resume else None, seed=args.seed,
                                progress=not args.no_progress)
    except ImageDecodeError as e:
        raise CLIError(f"{e} (or run with --on-error skip)") from None
    bad = sorted({b for ds in pipe.datasets.values() for b in ds.summary().bad})
    if is_distributed():  # each process decoded only its part of the data: collect every rank's bad files
        every = [None] * world
        torch.distributed.all_gather_object(every, bad)
        bad = sorted(set().union(*every))
    if not rank0:  # the replicas are identical after DDP: one writer per file
        return 0
    summary = {k: str(ds.summary()) for k, ds in pipe.datasets.items()}
    _save_model(os.path.join(args.out, "model.pt"), model, args=args, classes=pipe.classes)
    run_info = {"args": vars(args) | {"func": None}, "classes": pipe.classes, "pipeline": pipe.decisions,
                "fit_decisions": result.decisions, "data": summary, "bad_files": bad, "final": result.final,
                "world_size": world}
    write_json(os.path.join(args.out, "run.json"), run_info)
    final = result.final
    msg = f"done: {result.steps} steps, train_loss {final.get('train_loss', float('nan')):.4f}"
    if final.get("val_acc") is not None:
        msg += f", val_acc {final['val_acc']:.4f} (chance {1 / len(pipe.classes):.3f})"
    console.print(msg)
    if bad:
        console.print(f"[yellow]skipped {len(bad)} bad image file(s)[/]: " + ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""))
    console.print(f"wrote {args.out}/model.pt, metrics.csv, metrics.json, run.json and checkpoints/")
    return 0


def _save_model(path: str, model, *, args, classes: list[str]) -> None:
    state = {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "classes": list(classes),
             "model_name": args.model, "size": args.size}
    from torchspeed.train.checkpoint import save_checkpoint  # atomic + fsync + checksum

    save_checkpoint(path, state)

