"""A rich progress bar for long data jobs (packing, checking, benchmarking); silent when disabled."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def track(it: Iterable, *, description: str, enabled: bool = True, total: int | None = None) -> Iterator:
    if not enabled:
        yield from it
        return
    from rich.progress import track as rich_track

    yield from rich_track(it, description=description, total=total, transient=True)
