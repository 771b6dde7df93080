"""Runs `torchspeed data pack` and `torchspeed data bench` (imported only when one of them runs): an image folder
packed into one file, the decoding pipelines measured side by side."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from torchspeed._io import write_json
from torchspeed.bench.runner import provenance
from torchspeed.cli._auto import auto_size, parse_size
from torchspeed.cli.main import CLIError
from torchspeed.data.bench import bench_pipelines
from torchspeed.data.decode import ImageDecodeError
from torchspeed.data.packed import pack_folder


def run_pack(args) -> int:
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
