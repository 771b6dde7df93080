"""`torchspeed data`'s parser: `data pack SRC DST` (T09) packs an image folder, `data bench PATH` (T04) measures
decoding pipelines (run by data_run.py)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("data", help="image data tools: pack a folder into one file, benchmark decoding pipelines")
    dsub = p.add_subparsers(dest="data_command", metavar="{pack,bench}")

    pk = dsub.add_parser("pack", help="write an ImageFolder into one file + index (read memory-mapped)")
    pk.add_argument("src", help="ImageFolder directory (src/<class>/<image>)")
    pk.add_argument("dst", help="output file (its index is written next to it as DST.index.npz)")
    pk.add_argument("--max-side", type=int, default=None, help="resize so the longer side is at most this")
    pk.add_argument("--quality", type=int, default=90, help="JPEG quality when re-encoding (with --max-side)")
    pk.add_argument("--on-error", default="raise", choices=["raise", "skip"],
                    help="bad image files: stop with an error naming the file (default), or skip and list them")
    pk.set_defaults(entry="run_pack")

    b = dsub.add_parser("bench", help="img/s of torchvision vs torchspeed vs decode-only, one thread")
    b.add_argument("path", help="ImageFolder directory (one subfolder per class)")
    b.add_argument("--size", default="auto",
                   help="crop size in pixels, or auto: the images' median side, at most 224 (auto)")
    b.add_argument("--rounds", type=int, default=5, help="interleaved measuring rounds (5)")
    b.add_argument("--limit", type=int, default=None, help="use only the first N images")
    b.add_argument("--json", default=None, help="write the results JSON here")
    b.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="cuda adds the nvjpeg row (GPU batch decode + crop); auto: cuda when a GPU is visible")
    b.set_defaults(entry="run_bench")
    p.set_defaults(entry=None)  # `torchspeed data` alone: its help, exit 2
