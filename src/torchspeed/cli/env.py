"""`torchspeed env`'s parser: what this machine can accelerate (T01), as a table or JSON (run by env_run.py)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("env", help="show what this machine can accelerate (T01)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
