"""One folder of step checkpoints: names, listing, pruning, stale-file cleanup and atomic writes.

`CheckpointManager` (one `step-XXXXXXXX.pt` file per checkpoint, checkpoint.py) and
`ShardedCheckpoints` (one `step-XXXXXXXX/` DCP folder per checkpoint, dcp.py) keep their
checkpoints the same way, so both are a `StepStore`:

- **Names.** `path_for(step)` is `step-XXXXXXXX` plus the store's suffix (".pt" or none);
  `best_path` is `best` plus the suffix.
- **Listing.** `checkpoints()` lists the finished step entries, newest first (a sharded
  folder is finished when its `.metadata` is there).
- **Atomic writes.** `atomic_file(path, write)` writes into a hidden temporary file in the
  same folder, flushes and `fsync`s it, renames it over the final name (`os.replace` is
  atomic on POSIX) and `fsync`s the folder; `publish_folder(tmp, final)` renames a finished
  temporary folder into place, moving an older one of the same name aside first. A kill
  leaves the old entry or the new one, never half of one.
- **Pruning.** `prune()` removes all but the newest `keep_last` step entries, only after the
  new one is in place; a folder is renamed aside before it is deleted, so a kill mid-delete
  never leaves a half folder under a step name.
- **Stale-file cleanup.** The first write removes the hidden `.*.tmp` / `.*.old` entries a
  killed process left behind (never this process's own temporary file).
- **The newest good one.** `first_readable(read)` returns the first entry, newest first, that
  `read` accepts, passing over damaged ones with a message.

Example:
    >>> store = StepStore("ckpt", suffix=".pt", keep_last=3)
    >>> store.atomic_file(store.path_for(120), lambda f: torch.save(state, f))
    >>> store.prune()
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

__all__ = ["StepStore", "atomic_file", "fsync_dir"]

log = logging.getLogger("torchspeed")

T = TypeVar("T")


def atomic_file(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Create `path` atomically: `write(f)` into a temporary file beside it, fsync, rename, fsync the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w+b") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some filesystems (and Windows) do not open folders; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir():
        gone = path.with_name(f".{path.name}.old")
        shutil.rmtree(gone, ignore_errors=True)
        os.replace(path, gone)  # atomic: the step name is gone before any of its files is
        shutil.rmtree(gone, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class StepStore:
    """`step-XXXXXXXX<suffix>` entries in `directory`, newest `keep_last` kept; `finished(path)` says whether
    an entry is complete (a file always is: it is renamed into place whole)."""

    def __init__(self, directory: str | os.PathLike, *, suffix: str, keep_last: int = 3,
                 finished: Callable[[Path], bool] | None = None):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.suffix = suffix
        self._pattern = re.compile(r"^step-(\d+)" + re.escape(suffix) + "$")
        self._finished = finished or (lambda p: True)
        self._cleaned = False

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}{self.suffix}"

    @property
    def best_path(self) -> Path:
        return self.directory / f"best{self.suffix}"

    def checkpoints(self) -> list[Path]:
        """Finished step entries, newest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir()
                 if (m := self._pattern.match(p.name)) and self._finished(p)]
        return [p for _, p in sorted(found, reverse=True)]

    def atomic_file(self, path: Path, write: Callable[[IO[bytes]], None]) -> Path:
        self.clean_stale()
        return atomic_file(path, write)

    def publish_folder(self, tmp: Path, final: Path) -> Path:
        """Rename the finished folder `tmp` to `final` (an older `final` is moved aside, then deleted)."""
        old = None
        if final.exists():  # best/ again: move the previous one aside, then swap
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(self.directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def prune(self) -> None:
        """Remove all but the newest `keep_last` step entries (call it after the new one is in place)."""
        for old in self.checkpoints()[self.keep_last:]:
            _remove(old)

    def clean_stale(self) -> None:
        """Remove what a process killed mid-write left (hidden .tmp/.old entries), once per store."""
        if self._cleaned or not self.directory.is_dir():
            return
        self._cleaned = True
        own = f".{os.getpid()}.tmp"
        for p in [*self.directory.glob(".*.tmp"), *self.directory.glob(".*.old")]:
            if p.name.endswith(own):
                continue
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def first_readable(self, read: Callable[[Path], T], *, errors: tuple[type[BaseException], ...],
                       with_best: bool = False) -> tuple[Path, T, tuple[str, ...]] | None:
        """(path, read(path), passed over) for the newest entry `read` accepts (then best, with `with_best`);
        an entry whose read raises one of `errors` is passed over with a warning."""
        skipped: list[str] = []
        candidates = self.checkpoints() + ([self.best_path] if with_best and self.best_path.exists() else [])
        for path in candidates:
            try:
                value = read(path)
            except errors as e:
                log.warning("passing over %s: %s", path.name, e)
                skipped.append(f"{path.name}: {e}")
                continue
            return path, value, tuple(skipped)
        if skipped:
            log.warning("no usable checkpoint in %s: %d damaged entries passed over", self.directory, len(skipped))
        return None
