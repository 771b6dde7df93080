"""`torchspeed data pack SRC DST` (T09) and `torchspeed data bench PATH` (T04): pack an image folder, measure pipelines."""

from __future__ import annotations

import os

from torchspeed._io import write_json
from torchspeed.cli.main import CLIError


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


def run_pack(args) -> int:
    from rich.console import Console

    from torchspeed.data.decode import ImageDecodeError
    from torchspeed.data.packed import pack_folder

    if args.max_side is not None and args.max_side < 8:
        raise CLIError(f"--max-side must be at least 8, got {args.max_side}")
    if not 1 <= args.quality <= 100:
        raise CLIError(f"--quality must be in 1..100, got {args.quality}")
    if not os.path.isdir(args.src):
        raise CLIError(f"{args.src} is not a directory: expected an ImageFolder (src/<class>/<image>.jpg)")
    try:
        r = pack_folder(args.src, args.dst, max_side=args.max_side, quality=args.quality, on_error=args.on_error,
                        progress=True)
    except ImageDecodeError as e:
        raise CLIError(str(e)) from None
    console = Console()
    console.print(f"packed {r.images} images ({r.bytes / 1e6:,.1f} MB; source {r.source_bytes / 1e6:,.1f} MB) "
                  f"into {r.path} + {r.index}")
    console.print(str(r.summary))
    return 0


def run_bench(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from torchspeed.bench.runner import provenance
    from torchspeed.data.bench import bench_pipelines

    from torchspeed.cli._auto import auto_size, parse_size

    if args.rounds < 1:
        raise CLIError(f"--rounds must be at least 1, got {args.rounds}")
    try:
        args.size = parse_size(args.size, minimum=8)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if not os.path.isdir(args.path):
        raise CLIError(f"{args.path} is not a directory: expected an ImageFolder (path/<class>/<image>.jpg)")
    if args.size == "auto":
        try:
            args.size = auto_size(args.path)
        except FileNotFoundError as e:
            raise CLIError(str(e)) from None
    console = Console()
    console.print(f"[bold]torchspeed data bench[/]: {args.path}, size {args.size}, one process, one thread, "
                  f"{args.rounds} interleaved rounds after a warm-up pass")
    try:
        r = bench_pipelines(args.path, size=args.size, rounds=args.rounds, limit=args.limit, progress=True,
                            device=args.device)
    except (ValueError, FileNotFoundError) as e:
        raise CLIError(str(e)) from None
    table = Table(title=f"{r.files} images")
    for col in ("pipeline", "img/s (median)", "vs torchvision"):
        table.add_column(col, justify="left" if col == "pipeline" else "right")
    tv = r.row("torchvision").img_per_s
    for row in r.rows:
        table.add_row(row.pipeline, f"{row.img_per_s:,.0f}", f"{row.img_per_s / tv:.2f}x")
    console.print(table)
    console.print(f"torchspeed / torchvision: {r.ratio('torchspeed', 'torchvision'):.2f}x, torchspeed / decode-only: "
                  f"{r.ratio('torchspeed', 'decode-only'):.0%} (medians of per-round ratios)")
    if "nvjpeg/torchvision" in r.ratios:
        console.print(f"nvjpeg (GPU) / torchvision (one CPU thread): {r.ratio('nvjpeg', 'torchvision'):.1f}x")
    if args.json:
        out = r.to_dict()
        out["meta"] = provenance() | {"command": "torchspeed data bench", "path_images": r.files}
        write_json(args.json, out)
        console.print(f"wrote {args.json}")
    return 0
