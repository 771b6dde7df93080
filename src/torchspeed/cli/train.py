"""`torchspeed train --data PATH`'s parser: train an image classifier on a folder of images, the fast way
(T04-T11, T15, T18; run by train_run.py).

The defaults (each `auto` is in docs/train.md): `--size auto` is the images' median side
(capped at 224); `--lr auto` is the peak LR from the range test run with the chosen
optimizer and precision (`find_lr`, T15); the weight decay is the optimizer's default; the
best epoch's weights are restored at the end when there is a validation set.
`--resume` continues the run in `--out` (a finished run given more `--epochs` gets a new
schedule segment over the added epochs); `--init-from` starts a new run from saved weights.
`--model` takes a built-in name or your own `module:factory` (model/spec.py).
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("train", help="train an image classifier on an image folder or packed file")
    p.add_argument("--data", required=True, help="ImageFolder directory (root/<class>/<image>) or packed file")
    p.add_argument("--val", default=None, help="separate validation ImageFolder/packed file (default: hold out)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held out for validation when no --val (0.1)")
    p.add_argument("--model", default="resnet18",
                   help="a torchvision or timm model name, simple_cnn, or your own: package.module:function or "
                        "path/to/file.py:function (called with num_classes=N)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", default="auto",
                   help="training image side in pixels, or auto: the images' median side, at most 224 (auto)")
    p.add_argument("--crop-scale", default="0.08,1",
                   help="random crop's share of the image area, LO,HI (0.08,1), or off: no random crop")
    p.add_argument("--lr", default="auto",
                   help="peak learning rate, or auto: the LR range test on this model, optimizer and precision")
    p.add_argument("--optimizer", default="sgd",
                   help="sgd | adamw | lamb | lars | muon (Muon for hidden matrices + AdamW) | schedulefree | adam | "
                        "nadam | radam (one row each: torchspeed.train.optim_info)")
    p.add_argument("--weight-decay", type=float, default=None,
                   help="default per optimizer: 5e-4 sgd/lars, 0.05 adamw, 0.02 lamb (never on biases and norms)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD/LARS momentum (0.9, Nesterov)")
    p.add_argument("--betas", default="0.9,0.999", help="AdamW/LAMB betas B1,B2 (0.9,0.999)")
    p.add_argument("--workers", default="auto", help="DataLoader workers: a number, or auto (measured)")
    p.add_argument("--cache-gb", type=float, default=0.0, help="keep decoded images in shared RAM up to this size")
    p.add_argument("--augment", default="auto", choices=["auto", "device", "cpu"],
                   help="where the random crop runs: device (batched), cpu (in the loader workers, at full "
                        "resolution); auto: device on CUDA or with --cache-gb, else cpu")
    p.add_argument("--jitter", type=float, default=0.0,
                   help="brightness/contrast/saturation jitter strength, applied on the device (default 0: off)")
    p.add_argument("--precision", default="auto", help="auto | fp32 | bf16 | fp16")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="auto: a measured trial keeps torch.compile only if faster, and only for runs of at "
                        "least 300 s of eager time (shorter runs stay eager)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--out", default="runs/train", help="output folder (metrics, checkpoints, model.pt)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out; with more --epochs than it had, extend it (a new schedule "
                        "segment over the added epochs)")
    p.add_argument("--init-from", default=None, metavar="PATH",
                   help="start a new run from these weights: a run folder (its model.pt) or a .pt file")
    p.add_argument("--no-restore-best", action="store_true",
                   help="keep the last epoch's weights (default: the best validation epoch's, restored at the end)")
    p.add_argument("--on-error", default="skip", choices=["skip", "raise"],
                   help="bad image files: skip and report them (default) or stop with an error")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars (the summary is still printed)")
