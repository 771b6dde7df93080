"""`torchspeed env`: what this machine can accelerate (T01), as a table or JSON."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("env", help="show what this machine can accelerate (T01)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    from rich.console import Console

    from torchspeed.env import detect, format_env

    info = detect()
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return 0
    console = Console()
    console.print(format_env(info))
    for note in info.notes:
        console.print(f"[yellow]note:[/] {note}")
    return 0
