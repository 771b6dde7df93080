"""Atomic file writes shared by the loop, the CLI commands and the benchmarks.

A result file is written to a temporary name in the same folder and renamed over the final
name (`os.replace` is atomic on POSIX), so a reader never sees half a file and a killed run
leaves the previous version intact. Checkpoints add fsync and a checksum on top
(`torchspeed.train.state.checkpoint.save_checkpoint`).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write_text", "write_json"]


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` atomically, creating its folder; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | os.PathLike, obj, *, indent: int = 2) -> Path:
    """`obj` as JSON at `path`, atomically (values JSON cannot hold are written with str())."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, default=str))
