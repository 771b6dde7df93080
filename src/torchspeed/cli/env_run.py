"""Runs `torchspeed env` (imported only when it runs): what this machine can accelerate (T01), as a table or
JSON."""

from __future__ import annotations

import json

from rich.console import Console

from torchspeed.env import detect, format_env


def run(args) -> int:
    info = detect()
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return 0
    console = Console()
    console.print(format_env(info))
    for note in info.notes:
        console.print(f"[yellow]note:[/] {note}")
    return 0
