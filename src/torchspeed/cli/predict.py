"""`torchspeed predict RUN_DIR IMAGES...`'s parser: the class and probability of each image, from a trained run
(T28; run by predict_run.py).

RUN_DIR is the `--out` folder of `torchspeed train` (or its model.pt). Each image gets the
validation preprocessing (see `torchspeed.inference`); a folder among IMAGES stands for
every image under it. Prints one line per image (`path<TAB>class<TAB>probability`), or
JSON with `--json` (every class's probability).
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("predict", help="classify images with a model trained by `torchspeed train`")
    p.add_argument("run", help="the --out folder of `torchspeed train`, or its model.pt")
    p.add_argument("images", nargs="+", help="image files, or folders of them")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print JSON: every class's probability per image")
