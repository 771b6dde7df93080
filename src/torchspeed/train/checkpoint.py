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
  prunes all but the newest `keep_last`, and keeps `best.pt` for the best epoch metric.

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
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from torchspeed.train.wrappers import strip_wrapper_prefixes, unwrap_model

__all__ = ["save_checkpoint", "load_checkpoint", "verify_checkpoint", "check_state_dict", "CheckpointManager",
           "find_resume", "check_resumable", "is_extension", "update_best",
           "CheckpointError", "CorruptCheckpointError", "CheckpointMismatchError", "ResumeMismatchError",
           "FoundCheckpoint"]

log = logging.getLogger("torchspeed")

FORMAT = "torchspeed-checkpoint/1"
_MAGIC = b"TSCKSUM1"          # trailer: magic + 32-byte SHA-256 of everything before it
_TRAILER = len(_MAGIC) + 32
_STEP_RE = re.compile(r"^step-(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says why and what to do."""


class CorruptCheckpointError(CheckpointError):
    """The file is truncated, damaged, or not a checkpoint."""


class ResumeMismatchError(CheckpointError, ValueError):
    """The checkpoint belongs to a run with other data, batch size or schedule length."""


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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w+b") as f:
            torch.save(dict(state), f)
            f.flush()
            f.seek(0)
            digest = _sha256(f)
            f.seek(0, os.SEEK_END)
            f.write(_MAGIC + digest)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


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
        weights = state["model"] if state.get("format") == FORMAT or nested else state
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


class CheckpointManager:
    """`step-XXXXXXXX.pt` files in one folder: save, keep the newest `keep_last`, find the newest good one.

    Example:
        >>> manager = CheckpointManager("ckpt", keep_last=3)
        >>> manager.save(state, step=120)          # writes ckpt/step-00000120.pt, prunes older ones
        >>> manager.save_best(state)               # ckpt/best.pt
        >>> found = manager.latest()               # FoundCheckpoint or None
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int = 3):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self._cleaned = False

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}.pt"

    @property
    def best_path(self) -> Path:
        return self.directory / "best.pt"

    def checkpoints(self) -> list[Path]:
        """Step checkpoints, newest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _STEP_RE.match(p.name))]
        return [p for _, p in sorted(found, reverse=True)]

    def save(self, state: Mapping, *, step: int) -> Path:
        self._clean_stale_tmp()
        path = save_checkpoint(self.path_for(step), state)
        for old in self.checkpoints()[self.keep_last:]:
            old.unlink(missing_ok=True)  # only after the new one is safely on disk
        return path

    def save_best(self, state: Mapping) -> Path:
        self._clean_stale_tmp()
        return save_checkpoint(self.best_path, state)

    def latest(self, *, map_location: str | torch.device = "cpu") -> FoundCheckpoint | None:
        """The newest step checkpoint that loads (then best.pt); damaged ones are passed over with a warning."""
        skipped: list[str] = []
        candidates = self.checkpoints() + ([self.best_path] if self.best_path.exists() else [])
        for path in candidates:
            try:
                state = load_checkpoint(path, map_location=map_location)
            except CheckpointError as e:
                log.warning("passing over %s: %s", path.name, e)
                skipped.append(f"{path.name}: {e}")
                continue
            return FoundCheckpoint(path=path, state=state, skipped=tuple(skipped))
        if skipped:
            log.warning("no usable checkpoint in %s: %d damaged file(s) passed over", self.directory, len(skipped))
        return None

    def _clean_stale_tmp(self) -> None:
        # Temporary files of a process that was killed mid-write (never a finished checkpoint).
        if self._cleaned or not self.directory.is_dir():
            return
        self._cleaned = True
        for p in self.directory.glob(".*.tmp"):
            if not p.name.endswith(f".{os.getpid()}.tmp"):
                p.unlink(missing_ok=True)


# ---------------------------------------------------------------------- helpers
def find_resume(resume: str | os.PathLike, manager: "CheckpointManager | None") -> FoundCheckpoint | None:
    """The checkpoint `resume` points at: "auto" (the newest good one under `manager`), a folder, or a file.

    Returns None when a folder holds no checkpoint yet (a first run with resume="auto").
    """
    if resume == "auto" or Path(resume).is_dir():
        manager = manager if resume == "auto" else CheckpointManager(resume)
        found = manager.latest() if manager is not None else None
        if found is None:
            log.info("resume: no checkpoint in %s yet; starting from the beginning",
                     manager.directory if manager else resume)
        return found
    return FoundCheckpoint(path=Path(resume), state=load_checkpoint(resume))


def check_resumable(found: FoundCheckpoint, *, steps_per_epoch: int | None, total_steps: int | None,
                    has_scheduler: bool) -> dict:
    """The training state in `found`, after checking that this run can continue it exactly."""
    state = found.state
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{found.path} holds only weights, not a training state; load it with "
                              "torchspeed.train.checkpoint.load_checkpoint(path, model=model) before fit, "
                              "and leave resume unset")
    if state["steps_per_epoch"] not in (None, steps_per_epoch):
        raise ResumeMismatchError(
            f"{found.path} was written with {state['steps_per_epoch']} batches per epoch, but this loader has "
            f"{steps_per_epoch}: resume with the same data and batch size, or use a new checkpoint_dir")
    if is_extension(state, total_steps):  # a finished run given more steps: a new schedule segment
        if total_steps is not None and total_steps <= state["step"]:
            raise ResumeMismatchError(
                f"{found.path} is the end of a run of {state['step']} optimizer steps and this run asks for "
                f"{total_steps}: nothing to add; ask for more epochs to extend it")
        return state
    if has_scheduler and state.get("scheduler") is not None and state.get("total_steps") != total_steps:
        raise ResumeMismatchError(
            f"{found.path} was written by a run of {state.get('total_steps')} optimizer steps, but this run's "
            f"learning-rate schedule spans {total_steps} (epochs or max_steps changed): resume with the same epochs "
            "and max_steps, or start a new run from its weights with load_checkpoint(path, model=model) "
            "(torchspeed train: --init-from PATH)")
    return state


def is_extension(state: Mapping, total_steps: int | None) -> bool:
    """True when `state` is the last checkpoint of a finished run and this run's length differs:
    resuming it continues with a new learning-rate schedule over the added steps."""
    done = state.get("total_steps")
    return bool(done and total_steps and done != total_steps and state.get("step", 0) >= done)


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
    return {"metric": metric, "value": float(value), "epoch": row["epoch"], "step": step}, True


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


def _fsync_dir(directory: Path) -> None:
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




def _shape(v) -> tuple:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _names(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f" ... (+{len(keys) - n} more)" if len(keys) > n else "")
