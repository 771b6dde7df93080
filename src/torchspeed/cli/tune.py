"""`torchspeed tune [batch|lr|loader|noise|all]`'s parser: measure the batch size, LR, DataLoader settings and
gradient noise (T06-T08, T15, T17, T41; run by tune_run.py).

Runs on a built-in workload (synthetic CIFAR-shaped images, scikit-learn digits, or
JPEG-encoded photos decoded per sample) or an image folder (`--data PATH`, one
sub-folder per class), prints each tuner's table, and writes `tune.json` (and `lr.png`)
to `--out`.

`--model` also takes your own model (`package.module:function` or `file.py:function`,
called with `num_classes=N`; model/spec.py). `--image-size auto` (the default) is 32
for the built-in data and the images' median side (at most 224) for a folder. The batch
finder is capped so an epoch keeps at least `--min-steps` (16) steps: on 400 samples the
largest batch it reports is 24, not 400 (`--min-steps 1` lifts the cap).
"""

from __future__ import annotations

WHAT = ("batch", "lr", "loader", "noise", "all")
BUILTIN = ("synthetic", "digits", "jpeg")


def register(sub) -> None:
    p = sub.add_parser("tune", help="find the batch size, learning rate and DataLoader settings by measuring")
    p.add_argument("what", nargs="?", default="all", choices=WHAT, help="which tuner to run (default: all)")
    p.add_argument("--data", default="synthetic",
                   help="synthetic | digits | jpeg (built in, no download) or PATH to an image folder (class/img.jpg)")
    p.add_argument("--model", default="mlp", help="mlp | resnet18 | resnet34 | resnet50 (default mlp), or your own: "
                                                  "package.module:function or path/to/file.py:function")
    p.add_argument("--batch-size", type=int, default=64, help="batch for the LR and loader tuners (default 64)")
    p.add_argument("--image-size", default="auto",
                   help="images are resized to this size; auto: 32 for the built-in data, the images' median side "
                        "(at most 224) for a folder")
    p.add_argument("--max-batch", type=int, default=1024, help="largest batch the batch finder tries (default 1024)")
    p.add_argument("--min-steps", type=int, default=16,
                   help="the batch finder stops at a batch that leaves an epoch this many steps (16; 1: no cap)")
    p.add_argument("--memory-budget-mb", type=float, default=None,
                   help="CPU: the memory a step may use (default: half of what the OS reports available)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--quick", action="store_true", help="fewer steps and batches (about a minute on 2 CPU cores)")
    p.add_argument("--out", default="tune_out", help="folder for tune.json and lr.png (default tune_out)")
