"""`torchspeed predict RUN_DIR IMAGES...`: the class and probability of each image, from a trained run (T28).

RUN_DIR is the `--out` folder of `torchspeed train` (or its model.pt). Each image gets the
validation preprocessing (see `torchspeed.inference`); a folder among IMAGES stands for
every image under it. Prints one line per image (`path<TAB>class<TAB>probability`), or
JSON with `--json` (every class's probability).
"""

from __future__ import annotations

import json
import os

from torchspeed.cli.main import CLIError


def register(sub) -> None:
    p = sub.add_parser("predict", help="classify images with a model trained by `torchspeed train`")
    p.add_argument("run", help="the --out folder of `torchspeed train`, or its model.pt")
    p.add_argument("images", nargs="+", help="image files, or folders of them")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print JSON: every class's probability per image")


def _expand(paths: list[str]) -> list[str]:
    from torchspeed.data.folder import IMG_EXTENSIONS

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
    import torch

    from torchspeed.data.decode import ImageDecodeError
    from torchspeed.inference import load_model
    from torchspeed.train.state.checkpoint import CheckpointError

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
