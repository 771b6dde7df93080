"""Runs `torchspeed predict` (imported only when it runs): the images found, the run's model loaded, one line
(or a JSON entry) per image."""

from __future__ import annotations

import json
import os

import torch

from torchspeed.cli.main import CLIError
from torchspeed.data.decode import ImageDecodeError
from torchspeed.data.folder import IMG_EXTENSIONS
from torchspeed.inference import load_model
from torchspeed.train.state.checkpoint import CheckpointError


def _expand(paths: list[str]) -> list[str]:
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs
                           if f.lower().endswith(IMG_EXTENSIONS))
            if not found:
                raise CLIError(f"{p}: no image files in this folder")
            out += found
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise CLIError(f"{p}: no such image file or folder")
    return out


def run(args) -> int:
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be positive, got {args.batch_size}")
    images = _expand(args.images)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA GPU is visible; use --device cpu")
    try:
        m = load_model(args.run, device=args.device)
        preds = m.predict(images, batch_size=args.batch_size)
    except ImageDecodeError as e:
        raise CLIError(f"{e.path}: not a readable image ({e.reason}); pass image files only") from None
    except (CheckpointError, ValueError) as e:
        raise CLIError(f"{args.run}: {e}") from None
    if args.json:
        print(json.dumps([{"image": p.image, "class": p.label, "prob": p.prob, "probs": p.probs} for p in preds],
                         indent=2))
    else:
        for p in preds:
            print(f"{p.image}\t{p.label}\t{p.prob:.3f}")
    return 0
