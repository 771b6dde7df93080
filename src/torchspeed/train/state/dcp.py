"""Sharded checkpoints with torch.distributed.checkpoint (DCP) for FSDP2 runs, and any launcher's hook (T31).

A sharded model has no process that holds all of it, so each process writes its own shards
of the weights and optimizer state (`get_state_dict` -> `dcp.save`) into one folder, with a
`.metadata` file saying which process wrote which piece. Loading (`dcp.load` ->
`set_state_dict`) reads the pieces each process needs now, so a checkpoint written by 2
processes loads into 1 or 4: DCP re-shards it. Everything else an exact resume needs
(schedule, RNG, data position, meters, history) is small and goes into one checksummed
`trainer-rankN.pt` per process, written with `checkpoint.save_checkpoint`.

Atomic, as the single-file checkpoints are: every process writes into a hidden
`.step-XXXXXXXX.tmp` folder, all wait for each other, and rank 0 renames it to
`step-XXXXXXXX`. A kill -9 leaves either a finished folder or a temporary one (removed at the
next save); `resume="auto"` takes the newest finished one.

A different world size on resume: DCP re-shards the weights, and the data position is
recomputed from the samples already trained on (`rescale_position`): 2 processes x 5
batches become 1 process x 10 batches, and the epoch continues with the same next sample
(a `ResumableSampler` and `DistributedSampler` share their (seed, epoch) order).

`export_checkpoint(dir, path)` turns a DCP folder into a plain state dict file, without a
process group, loadable with `torch.load(path, weights_only=True)`.

Example:
    >>> torchspeed.fit(model, loader, parallel="fsdp2", checkpoint_dir="ckpt", resume="auto")
    >>> torchspeed.export_checkpoint("ckpt", "model.pt")   # the newest step, all shards joined
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from torchspeed.train.state.checkpoint import (CheckpointError, FoundCheckpoint, ResumeMismatchError, load_checkpoint,
                                               nested_layout, save_checkpoint)
from torchspeed.train.parallel.distributed import barrier, get_rank, get_world_size, is_rank_zero
from torchspeed.train.state.store import StepStore

__all__ = ["ShardedCheckpoints", "export_checkpoint", "rescale_position", "notify_checkpoint"]

log = logging.getLogger("torchspeed")

def _trainer_file(folder: Path, rank: int) -> Path:
    return folder / f"trainer-rank{rank}.pt"


class ShardedCheckpoints(StepStore):
    """`step-XXXXXXXX/` DCP folders in `directory`: save (every rank), keep the newest `keep_last`, resume
    (the folder itself, names, pruning and stale-file cleanup: `store.StepStore`).

    Example:
        >>> manager = ShardedCheckpoints("ckpt", keep_last=3)
        >>> manager.save(model, optimizer, extra_state, step=120)   # collective: every rank calls it
        >>> found = manager.latest(); manager.load(found.path, model, optimizer)
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int = 3):
        super().__init__(directory, suffix="", keep_last=keep_last, finished=lambda p: (p / ".metadata").exists())

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict, *, step: int,
             best: bool = False) -> Path:
        """Write this rank's shards and `extra` state (collective); returns the finished folder."""
        path = self._write(self.path_for(step), model, optimizer, extra)
        if best:
            self._write(self.best_path, model, optimizer, extra)
        if is_rank_zero():
            self.prune()  # only after the new one is renamed into place
        return path

    def _write(self, final: Path, model: nn.Module, optimizer, extra: dict) -> Path:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        tmp = self.directory / f".{final.name}.tmp"
        if is_rank_zero():
            self.clean_stale()
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
        save_checkpoint(_trainer_file(tmp, get_rank()), {**extra, "world_size": get_world_size()})
        barrier()  # every rank's files are on disk
        if is_rank_zero():
            self.publish_folder(tmp, final)
        barrier()  # no rank reads or reports the folder before it has its final name
        return final

    def read(self, folder: str | os.PathLike) -> FoundCheckpoint:
        """This rank's trainer state in `folder` (rank 0's when this rank did not exist in that run)."""
        folder = Path(folder)
        if not (folder / ".metadata").exists():
            raise CheckpointError(f"{folder} is not a finished sharded checkpoint (no .metadata): pass a "
                                  f"step-XXXXXXXX folder, or resume='auto' with checkpoint_dir")
        own = _trainer_file(folder, get_rank())
        return FoundCheckpoint(path=folder, state=load_checkpoint(own if own.exists() else _trainer_file(folder, 0)))

    def latest(self) -> FoundCheckpoint | None:
        """The newest finished folder whose trainer state loads (damaged ones are passed over)."""
        found = self.first_readable(lambda p: self.read(p).state, errors=(CheckpointError,))
        return None if found is None else FoundCheckpoint(*found)

    @staticmethod
    def find(resume: str | os.PathLike, manager: "ShardedCheckpoints | None", *, world_size: int,
             steps_per_epoch: int | None) -> FoundCheckpoint | None:
        """What `resume` points at: "auto" (the newest under `manager`), a checkpoint folder, or a step
        folder; its data position recomputed for `world_size` processes (`rescale_position`)."""
        if resume == "auto":
            found = manager.latest() if manager is not None else None
        elif (Path(resume) / ".metadata").exists():
            found = ShardedCheckpoints(Path(resume).parent).read(resume)
        else:
            found = ShardedCheckpoints(resume).latest()
        if found is None:
            return None
        return replace(found, state=_rescaled(nested_layout(found.state), world_size=world_size,
                                              steps_per_epoch=steps_per_epoch))

    @staticmethod
    def load(folder: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Load the weights and optimizer state in `folder` into the (sharded) model, re-sharding as needed."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=Path(folder))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def rescale_position(state: dict, *, world_size: int, steps_per_epoch: int | None) -> dict:
    """`state` with its data position recomputed for `world_size` processes (same samples trained on).

    The batch in the epoch counts per-process batches: x old/new world size. It must come out whole
    (a checkpoint at the epoch's end always does)."""
    old = int(state.get("world_size", world_size))
    if old == world_size:
        return state
    done = int(state["batch_in_epoch"]) * old  # batches of all processes together
    if done % world_size:
        raise ResumeMismatchError(
            f"the checkpoint was written by {old} processes after {state['batch_in_epoch']} batches each "
            f"({done} in all), which {world_size} processes cannot split evenly: resume with {old} processes, "
            f"or from a checkpoint at an epoch end (checkpoint_every a multiple of {world_size})")
    log.warning("resuming a %d-process checkpoint with %d processes: batch %d of the epoch becomes %d", old,
                world_size, state["batch_in_epoch"], done // world_size)
    return {**state, "batch_in_epoch": done // world_size, "steps_per_epoch": steps_per_epoch,
            "world_size": world_size}


def _rescaled(state: dict, *, world_size: int, steps_per_epoch: int | None) -> dict:
    """A training state (parts nested) with its "position" part recomputed for `world_size` processes."""
    view = {"batch_in_epoch": state["position"]["batch_in_epoch"], "world_size": state.get("world_size", world_size)}
    new = rescale_position(view, world_size=world_size, steps_per_epoch=steps_per_epoch)
    if new is view:
        return state
    return {**state, "position": {**state["position"], "batch_in_epoch": new["batch_in_epoch"]},
            "run": {**state["run"], "steps_per_epoch": steps_per_epoch}, "world_size": world_size}


def notify_checkpoint(hook: Callable[[str, int], object] | None, path: Path | None, step: int) -> None:
    """Run the user's `on_checkpoint(path, step)` on every rank once the checkpoint is complete
    (Ray Train: call `ray.train.report` from it)."""
    if hook is None or path is None:
        return
    barrier()  # rank 0 has finished writing before any rank reports the path
    hook(str(path), step)


def export_checkpoint(directory: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Join the shards of a DCP checkpoint into one plain state dict file (no process group needed).

    `directory` is a step folder, or a checkpoint_dir (its newest step). The file holds the model's
    full state dict, written atomically with a checksum; load it with `torch.load(path, weights_only=True)`
    or `load_checkpoint(path, model=model)`.

    Example:
        >>> export_checkpoint("ckpt", "model.pt")
        >>> model.load_state_dict(torch.load("model.pt", weights_only=True))
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = Path(directory)
    if not (folder / ".metadata").exists():
        newest = ShardedCheckpoints(folder).checkpoints()
        if not newest:
            raise FileNotFoundError(f"{folder} holds no sharded checkpoint (no step-XXXXXXXX folder with a "
                                    ".metadata file); pass the checkpoint_dir of a parallel='fsdp2' run")
        folder = newest[0]
    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    weights = {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    return save_checkpoint(path, weights)
