"""Checkpoints that survive a kill: atomic writes, a checksum, safe loading, automatic resume.

A fast run that dies at 90% and cannot resume is the slowest run of all. This module
writes checkpoints so that whatever moment the process dies at, every checkpoint file on
disk is complete:

- **Atomic write.** The state is written to a hidden temporary file in the same folder,
  flushed and `fsync`ed, then renamed over the final name (`os.replace` is atomic on
  POSIX), and the folder is `fsync`ed so the rename itself is durable. A kill leaves
  either the old file or the new one, never half of one; stale temporary files are removed
  on the next start.
- **Checksum.** A SHA-256 of the archive is appended after it (torch's zip reader ignores
  trailing bytes, so `torch.load` still opens the file). A file damaged later (disk error,
  a copy cut short) fails the check and `resume="auto"` passes over it, with a message,
  for the previous one. Without the checksum a flipped byte inside a tensor loads silently.
- **Safe loading.** Every load uses `torch.load(..., weights_only=True)`, which refuses to
  run code stored in a checkpoint file; everything saved is tensors and plain Python values.
- **A clear mismatch error.** Loading a checkpoint of another model lists the missing,
  unexpected and wrongly shaped keys (`CheckpointMismatchError`) instead of torch's
  traceback.
- **Keep the last K and the best.** `CheckpointManager` names files `step-00000120.pt`,
  prunes all but the newest `keep_last`, and keeps `best.pt` for the best epoch metric (the
  folder itself: `store.StepStore`, shared with the sharded checkpoints of dcp.py).
- **One layout.** A training checkpoint holds each stateful part under its name (format 2,
  stateful.py); `nested_layout` reads the flat format 1 of older checkpoints the same way.

Cost: a checkpoint is a copy of the weights and optimizer state to disk (for a small model
a few milliseconds; see docs/reliability.md for measured numbers). `Trainer` writes one
every `checkpoint_every` optimizer steps and at each epoch end.

Example:
    >>> save_checkpoint("ckpt/model.pt", {"model": model.state_dict()})
    >>> state = load_checkpoint("ckpt/model.pt", model=model)   # raises CheckpointMismatchError if it does not fit
    >>> manager = CheckpointManager("ckpt", keep_last=3)
    >>> found = manager.latest()                                 # newest checkpoint that loads, or None
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from torchspeed.train.state.store import StepStore, atomic_file
from torchspeed.train.wrappers import strip_wrapper_prefixes, unwrap_model

__all__ = ["save_checkpoint", "load_checkpoint", "verify_checkpoint", "check_state_dict", "CheckpointManager",
           "nested_layout", "update_best",
           "CheckpointError", "CorruptCheckpointError", "CheckpointMismatchError", "ResumeMismatchError",
           "FoundCheckpoint"]

log = logging.getLogger("torchspeed")

FORMAT = "torchspeed-checkpoint/2"        # each stateful part under its name (stateful.py)
FLAT_FORMAT = "torchspeed-checkpoint/1"   # before: some parts flattened to the top level (read by nested_layout)
_FLAT_PARTS = {"position": ("epoch", "batch_in_epoch", "epoch_rng", "loader_state"), "guard": ("skipped", "bad_run"),
               "run": ("step", "total_steps", "steps_per_epoch", "history", "best", "stopped")}
_MAGIC = b"TSCKSUM1"          # trailer: magic + 32-byte SHA-256 of everything before it
_TRAILER = len(_MAGIC) + 32


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says why and what to do."""


class CorruptCheckpointError(CheckpointError):
    """The file is truncated, damaged, or not a checkpoint."""


class ResumeMismatchError(CheckpointError, ValueError):
    """The checkpoint belongs to a run with other data, batch size, schedule length or optimizer."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint's weights do not fit the model: lists missing, unexpected and misshaped keys."""

    def __init__(self, message: str, *, missing: list[str], unexpected: list[str],
                 shapes: list[tuple[str, tuple, tuple]]):
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected
        self.shapes = shapes


# ---------------------------------------------------------------------- writing
def save_checkpoint(path: str | os.PathLike, state: Mapping) -> Path:
    """Write `state` to `path` atomically (temp file, fsync, rename, fsync folder) with a checksum.

    Example:
        >>> save_checkpoint("run/last.pt", {"model": model.state_dict(), "step": 100})
    """
    return atomic_file(path, lambda f: _write_checksummed(f, state))


def _write_checksummed(f, state: Mapping) -> None:
    torch.save(dict(state), f)
    f.flush()
    f.seek(0)
    digest = _sha256(f)
    f.seek(0, os.SEEK_END)
    f.write(_MAGIC + digest)


# ---------------------------------------------------------------------- reading
def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise `CorruptCheckpointError` if the file's checksum does not match (files without one pass)."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise CorruptCheckpointError(f"checkpoint {path} is empty (0 bytes)")
    with open(path, "rb") as f:
        if size > _TRAILER:
            f.seek(size - _TRAILER)
            tail = f.read(_TRAILER)
            if tail.startswith(_MAGIC):
                f.seek(0)
                if _sha256(f, limit=size - _TRAILER) != tail[len(_MAGIC):]:
                    raise CorruptCheckpointError(
                        f"checkpoint {path} is damaged: its SHA-256 checksum does not match its contents "
                        "(a disk error or an incomplete copy); use an earlier checkpoint")


def load_checkpoint(path: str | os.PathLike, *, model: nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, scheduler=None,
                    scaler: torch.amp.GradScaler | None = None, map_location: str | torch.device = "cpu",
                    strict: bool = True) -> dict:
    """Load a checkpoint safely (`weights_only=True`), checking it fits `model` before touching it.

    Accepts files from `save_checkpoint` and plain `torch.save(model.state_dict())` files.
    With `model`, the weights are loaded into it; a mismatch raises `CheckpointMismatchError`
    listing the keys and shapes (with `strict=False`, only the matching tensors are loaded).
    `optimizer`, `scheduler` and `scaler` are restored when given and present in the file.

    Example:
        >>> state = load_checkpoint("run/step-00000100.pt", model=model, optimizer=opt)
        >>> state["step"]
        100
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise IsADirectoryError(f"checkpoint {path} is a folder; pass a .pt file, or resume='auto' with "
                                "checkpoint_dir set to the folder")
    verify_checkpoint(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read means the file is unusable
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise CorruptCheckpointError(
                f"checkpoint {path} holds Python objects that weights_only loading refuses to run ({msg}); "
                "torchspeed only loads tensors and plain values. Re-save it as a state_dict") from e
        raise CorruptCheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: {msg}); "
                                     "it is truncated or not a torch checkpoint") from e
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a dict of tensors")
    if model is not None:
        # A training state keeps the weights under "model"; a plain state_dict is the weights itself.
        nested = isinstance(state.get("model"), Mapping)
        weights = state["model"] if state.get("format") in (FORMAT, FLAT_FORMAT) or nested else state
        _load_model(model, weights, strict=strict, source=path)
        if optimizer is not None and state.get("optimizer") is not None:
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state.get("scheduler") is not None:
            scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])
    return state


def check_state_dict(model: nn.Module | Mapping, weights: Mapping, *, source: str = "the checkpoint") -> None:
    """Raise `CheckpointMismatchError` unless `weights` has exactly `model`'s keys and shapes."""
    expected = strip_wrapper_prefixes(model.state_dict() if isinstance(model, nn.Module) else model)
    got = strip_wrapper_prefixes(weights)
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    shapes = [(k, tuple(_shape(got[k])), tuple(_shape(v))) for k, v in expected.items()
              if k in got and tuple(_shape(got[k])) != tuple(_shape(v))]
    if not (missing or unexpected or shapes):
        return
    parts = []
    if shapes:
        parts.append(f"{len(shapes)} with a different shape: " + ", ".join(
            f"{k} is {list(a)} in the checkpoint but {list(b)} in the model" for k, a, b in shapes[:8])
            + (" ..." if len(shapes) > 8 else ""))
    if missing:
        parts.append(f"{len(missing)} missing from the checkpoint: {_names(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} in the checkpoint but not in the model: {_names(unexpected)}")
    raise CheckpointMismatchError(
        f"{source} was written by a different model: " + "; ".join(parts)
        + ". Build the same model (architecture and sizes) that wrote it, or load it with strict=False "
          "to take only the matching tensors", missing=missing, unexpected=unexpected, shapes=shapes)


def _load_model(model: nn.Module, weights: Mapping, *, strict: bool, source) -> None:
    target = unwrap_model(model)
    weights = strip_wrapper_prefixes(weights)
    if strict:
        check_state_dict(target, weights, source=f"checkpoint {source}")
        target.load_state_dict(weights, strict=True)
        return
    own = target.state_dict()
    fitting = {k: v for k, v in weights.items() if k in own and _shape(own[k]) == _shape(v)}
    target.load_state_dict(fitting, strict=False)


# ---------------------------------------------------------------------- a folder of checkpoints
@dataclass(frozen=True)
class FoundCheckpoint:
    """A checkpoint that loaded and passed its checksum, and the ones passed over on the way."""

    path: Path
    state: dict
    skipped: tuple[str, ...] = ()


class CheckpointManager(StepStore):
    """`step-XXXXXXXX.pt` files in one folder: save, keep the newest `keep_last`, find the newest good one
    (the folder itself, names, pruning and stale-file cleanup: `store.StepStore`).

    Example:
        >>> manager = CheckpointManager("ckpt", keep_last=3)
        >>> manager.save(state, step=120)          # writes ckpt/step-00000120.pt, prunes older ones
        >>> manager.save_best(state)               # ckpt/best.pt
        >>> found = manager.latest()               # FoundCheckpoint or None
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int = 3):
        super().__init__(directory, suffix=".pt", keep_last=keep_last)

    def save(self, state: Mapping, *, step: int) -> Path:
        path = self.atomic_file(self.path_for(step), lambda f: _write_checksummed(f, state))
        self.prune()  # only after the new one is safely on disk
        return path

    def save_best(self, state: Mapping) -> Path:
        return self.atomic_file(self.best_path, lambda f: _write_checksummed(f, state))

    def latest(self, *, map_location: str | torch.device = "cpu") -> FoundCheckpoint | None:
        """The newest step checkpoint that loads (then best.pt); damaged ones are passed over with a warning."""
        found = self.first_readable(lambda p: load_checkpoint(p, map_location=map_location),
                                    errors=(CheckpointError,), with_best=True)
        return None if found is None else FoundCheckpoint(*found)


# ---------------------------------------------------------------------- helpers
def nested_layout(state: dict) -> dict:
    """A training state with each part under its name: a checkpoint of the flat format 1 (the data
    position, the guard's counts and the run's progress at the top level) is regrouped."""
    if state.get("format") != FLAT_FORMAT:
        return state
    flat = {k for keys in _FLAT_PARTS.values() for k in keys}
    out = {k: v for k, v in state.items() if k not in flat}
    out.update({part: {k: state.get(k) for k in keys} for part, keys in _FLAT_PARTS.items()})
    out["format"] = FORMAT
    return out


def update_best(best: dict | None, row: dict, metric: str | None, *, step: int) -> tuple[dict | None, bool]:
    """(new best record, improved?) after an epoch's `row`; metric "auto" is val_acc when the task has an
    accuracy, else val_loss, else train_loss (regression and language models get the loss)."""
    if metric is None:
        return best, False
    if metric == "auto":
        metric = next((k for k in ("val_acc", "val_loss", "train_loss") if row.get(k) is not None), None)
    value = row.get(metric) if metric else None
    if value is None or not math.isfinite(value):
        return best, False
    higher = "acc" in metric
    if best is not None and best["metric"] == metric:
        old = best["value"]
        if (value <= old) if higher else (value >= old):
            return best, False
    return {"metric": metric, "value": float(value), "epoch": row["epoch"], "step": step,
            **({"mid_epoch": True} if row.get("mid_epoch") else {})}, True


def _sha256(f, *, limit: int | None = None) -> bytes:
    h = hashlib.sha256()
    remaining = limit
    while True:
        n = 1 << 20 if remaining is None else min(1 << 20, remaining)
        if n == 0:
            break
        chunk = f.read(n)
        if not chunk:
            break
        h.update(chunk)
        if remaining is not None:
            remaining -= len(chunk)
    return h.digest()


def _shape(v) -> tuple:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _names(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f" ... (+{len(keys) - n} more)" if len(keys) > n else "")
