"""Data-parallel training on PyTorch's own engine: DistributedDataParallel under torchrun (T31, T17).

What it does: each process (one per GPU, or a few per CPU machine) holds a full replica of
the model and trains on its own shard of every epoch; `DistributedDataParallel` (DDP)
all-reduces the gradients in buckets while backward is still running, so communication
overlaps with computation. Processes are started by `torchrun` (`torchspeed launch` wraps
it), which sets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`; the
process group is built from those (NCCL on GPUs, gloo on CPU). Nothing here is home-made:
the collectives, the sampler and the wrapper are torch.distributed's.

When it helps: as soon as one device is busy and another is idle. DDP is the right tool even
on one machine with several GPUs: `nn.DataParallel` runs a single Python process that
scatters each batch from GPU 0, replicates the model every step and gathers the outputs
back on GPU 0 (GIL-bound, unbalanced), which is why `fit` unwraps it (T31).

What it costs: one all-reduce of the gradients per optimizer step (hidden behind backward
when the model is large enough), a copy of the model per device, and a global batch
`world_size` times larger, so the learning rate usually needs scaling (T17, linear rule,
`TrainConfig(scale_lr_world_size=True)`). Gradient accumulation skips the all-reduce on
all but the last micro-batch (`no_sync`), so accumulating costs no extra communication.

The pieces, each a plain function a hand-written loop can call too:
    >>> info = init_distributed()                 # process group from the torchrun environment
    >>> model = wrap_ddp(model.to(info.device), device=info.device)
    >>> loader = distributed_loader(loader)       # shard.py: DistributedSampler; call loader.sampler.set_epoch(e)
    >>> stats = reduce_metrics({"loss": 0.4}, weight=len(y))  # weighted mean over all ranks
    >>> if is_rank_zero(): save(...)              # logs, progress, metrics files, checkpoints
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torchspeed.train.decision import Decision
from torchspeed.train.schedule import scale_lr

__all__ = [
    "DistInfo", "launched_by_torchrun", "is_distributed", "get_rank", "get_local_rank", "get_world_size",
    "is_rank_zero", "rank_zero_only", "init_distributed", "maybe_init_distributed", "cleanup_distributed",
    "wrap_ddp", "wrap_for_training", "convert_sync_batchnorm", "reduce_metrics",
    "all_reduce_sum", "all_reduce_max", "broadcast_object", "barrier", "scale_lr_world_size", "world_size_lr",
    "scale_groups_world_size", "unwrap_data_parallel",
]

log = logging.getLogger("torchspeed")

_T = TypeVar("_T")
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0


# ---------------------------------------------------------------------- who am I
def launched_by_torchrun() -> bool:
    """True when this process was started by torchrun (or any launcher that sets its variables)."""
    return all(k in os.environ for k in _ENV)


def is_distributed() -> bool:
    """True once a process group with more than one process is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """Global rank: from the process group once initialised, else from `RANK` (0 when not launched)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def get_local_rank() -> int:
    """Rank on this machine (picks the GPU): `LOCAL_RANK`, 0 when not launched."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_world_size() -> int:
    """Number of processes in the job: 1 when not launched."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def is_rank_zero() -> bool:
    """True in the one process that writes: progress bars, logs, metrics files and checkpoints.

    True in a plain (not launched) process too, so callers need no special case.

    Example:
        >>> if is_rank_zero():
        ...     torch.save(model.state_dict(), "ckpt.pt")
    """
    return get_rank() == 0


def rank_zero_only(fn: Callable[..., _T]) -> Callable[..., _T | None]:
    """Decorator: run `fn` on rank 0 only (other ranks get None).

    Example:
        >>> @rank_zero_only
        ... def save(path): ...
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) if is_rank_zero() else None
    return wrapper


class _RankZeroLogFilter(logging.Filter):
    """On ranks other than 0, let only errors through (N copies of each warning help no one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or is_rank_zero()


# ---------------------------------------------------------------------- setup
def _default_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(*, backend: str | None = None, device: torch.device | str | None = None,
                     timeout_s: float | None = None) -> DistInfo:
    """Build the process group from the torchrun environment (idempotent) and pick this rank's device.

    The backend is NCCL when the device is a GPU, gloo otherwise. On GPUs each process binds
    to `cuda:LOCAL_RANK`. Ranks other than 0 only log errors from then on.

    Example:
        >>> info = init_distributed()   # under `torchspeed launch --nproc 2 -- python train.py`
        >>> info.rank, info.world_size, info.device
    """
    if not dist.is_available():
        raise RuntimeError("this PyTorch build has no torch.distributed; install a standard PyTorch wheel")
    if not (dist.is_initialized() or launched_by_torchrun()):
        missing = [k for k in _ENV if k not in os.environ]
        raise RuntimeError(f"distributed training needs the torchrun environment (missing {', '.join(missing)}); "
                           "start the script with `torchspeed launch --nproc N -- python train.py` "
                           "or `torchrun --nproc-per-node N train.py`")
    local_rank = get_local_rank()
    dev = torch.device(device) if device is not None else _default_device(local_rank)
    if dev.type == "cuda" and (device is None or torch.device(device).index is None):
        _check_one_gpu_per_process()
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(dev)  # NCCL and the caching allocator use the current device
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if dev.type == "cuda" and dist.is_nccl_available() else "gloo"
        kwargs: dict[str, Any] = {"backend": backend}
        if timeout_s is not None:
            kwargs["timeout"] = timedelta(seconds=timeout_s)
        dist.init_process_group(**kwargs)
        atexit.register(cleanup_distributed)
    if not any(isinstance(f, _RankZeroLogFilter) for f in log.filters):
        log.addFilter(_RankZeroLogFilter())
    return DistInfo(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(),
                    backend=str(dist.get_backend()), device=dev)


def _check_one_gpu_per_process() -> None:
    """NCCL needs a GPU of its own for every process on a machine: refuse more processes than GPUs."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count()
    if local_world > gpus:
        raise RuntimeError(
            f"{local_world} processes on this machine but {gpus} GPU(s) visible: NCCL needs one GPU per process "
            f"(two ranks on one GPU fail with 'Duplicate GPU detected'). Launch with --nproc {gpus} (torchrun "
            f"--nproc-per-node {gpus}), or train the processes on the CPU with device='cpu' (gloo)")


def maybe_init_distributed(mode: bool | str = "auto", *, device: torch.device | str | None = None) -> DistInfo | None:
    """The Trainer's switch: "auto" initialises when torchrun started more than one process,
    True insists (error outside torchrun), False never does. None means single-process.

    Example:
        >>> info = maybe_init_distributed("auto")   # None in a plain `python train.py`
    """
    if mode not in (True, False, "auto"):
        raise ValueError(f"distributed must be True, False or 'auto', got {mode!r}")
    if mode is False:
        return None
    if mode == "auto":
        if dist.is_available() and dist.is_initialized():
            return init_distributed(device=device) if dist.get_world_size() > 1 else None
        if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) < 2:
            return None
    return init_distributed(device=device)


def cleanup_distributed() -> None:
    """Destroy the process group (safe to call twice; registered at exit by `init_distributed`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------- the model
def wrap_for_training(module: nn.Module, *, dist: DistInfo, static_graph: bool = False, sync_batchnorm: bool = False,
                      grad_accum: int = 1) -> tuple[nn.Module, nn.Module, str]:
    """The trainer's DDP set-up: (the plain module, maybe with SyncBatchNorm; its DDP wrapper; the decision).
    Call it after .to(device) and channels_last: DDP broadcasts rank 0's weights when it is built."""
    if static_graph and grad_accum > 1:
        raise ValueError("static_graph=True cannot be combined with grad_accum > 1: DDP's static graph "
                         "does not support the no_sync() micro-steps; drop static_graph or grad_accum")
    module, synced = convert_sync_batchnorm(module, device=dist.device) if sync_batchnorm else (module, False)
    decision = (f"DDP, {dist.world_size} processes ({dist.backend}), gradient_as_bucket_view, "
                f"static_graph={static_graph}, sync_batchnorm={synced}")
    return module, wrap_ddp(module, device=dist.device, static_graph=static_graph), decision


def wrap_ddp(model: nn.Module, *, device: torch.device | str, gradient_as_bucket_view: bool = True,
             static_graph: bool = False, find_unused_parameters: bool = False,
             broadcast_buffers: bool = True, bucket_cap_mb: float | None = None) -> DDP:
    """Wrap a model (already on `device`, already channels_last) in DistributedDataParallel.

    - `gradient_as_bucket_view=True`: `.grad` tensors are views into DDP's communication
      buckets, which saves one copy of the gradients per step and their memory. Always valid
      for torchspeed's loop (it never replaces `.grad` tensors by hand).
    - `static_graph=True`: valid only when every step uses the same parameters in the same
      order (no data-dependent control flow); lets DDP skip its per-step unused-parameter
      search and supports activation checkpointing. Off by default because it cannot be
      checked before training.
    - `find_unused_parameters=True`: only for models whose forward skips some parameters
      (costs a graph traversal per step).

    Example:
        >>> ddp = wrap_ddp(model.to(info.device), device=info.device)
    """
    if not dist.is_initialized():
        raise RuntimeError("wrap_ddp needs a process group: call init_distributed() first (under torchrun)")
    device = torch.device(device)
    kwargs: dict[str, Any] = dict(gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
                                  find_unused_parameters=find_unused_parameters)
    if not broadcast_buffers:  # the default (True) re-sends rank 0's BatchNorm statistics every forward
        kwargs["broadcast_buffers"] = False
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    if device.type == "cuda":
        kwargs.update(device_ids=[device.index], output_device=device.index)
    # DDP broadcasts rank 0's parameters and buffers here: every replica starts identical.
    return DDP(model, **kwargs)


def convert_sync_batchnorm(model: nn.Module, *, device: torch.device | str) -> tuple[nn.Module, bool]:
    """Replace BatchNorm layers by SyncBatchNorm (statistics over the global batch).

    Helps when the per-GPU batch is small (under ~16 samples per BN layer the statistics
    get noisy); costs one all-reduce per BN layer in forward and backward. PyTorch supports
    it on GPUs only: on CPU the model is returned unchanged with a warning.
    Returns (model, converted).

    Example:
        >>> model, on = convert_sync_batchnorm(model, device="cuda:0")
    """
    if torch.device(device).type == "cpu":
        log.warning("sync_batchnorm: PyTorch's SyncBatchNorm runs on GPUs only; keeping per-process BatchNorm on CPU")
        return model, False
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return (nn.SyncBatchNorm.convert_sync_batchnorm(model), True) if has_bn else (model, False)



def unwrap_data_parallel(model: nn.Module) -> nn.Module:
    """The module inside `nn.DataParallel`, with a warning that names the faster replacement (T31)."""
    if isinstance(model, nn.DataParallel):
        log.warning("fit() got a DataParallel model: unwrapping it. DataParallel runs one process that "
                    "scatters every batch and gathers outputs through GPU 0 each step (T31); use "
                    "`torchspeed launch --nproc N` (DistributedDataParallel) for several GPUs instead.")
        return model.module
    return model


def scale_lr_world_size(lr: float, *, world_size: int | None = None) -> float:
    """The linear scaling rule (T17) for data parallelism: the global batch grows with the world size.

    Example:
        >>> scale_lr_world_size(0.1, world_size=4)
        0.4
    """
    return scale_lr(lr, batch=1, base_batch=1, world_size=world_size or get_world_size())


def scale_groups_world_size(optimizer: torch.optim.Optimizer, world_size: int) -> Decision:
    """Every param group's LR x the world size (T17), in place, before a schedule reads it as its peak; the record
    that refines decisions["lr"]."""
    for g in optimizer.param_groups:
        g["lr"] = scale_lr_world_size(g["lr"], world_size=world_size)
    return world_size_lr(optimizer.param_groups[0]["lr"], world_size)


def world_size_lr(lr: float, world_size: int) -> Decision:
    """The record that refines decisions["lr"] once the LR was scaled by the world size (T17)."""
    return Decision(lr, f"x{world_size} (world size, T17)")


# ---------------------------------------------------------------------- collectives
def _comm_device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo reduces CPU tensors.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """Sum each number over all ranks (one all-reduce; identity when not distributed)."""
    if not is_distributed():
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(flag: torch.Tensor) -> torch.Tensor:
    """The maximum of `flag` over all ranks, in place (identity when not distributed)."""
    if is_distributed():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def reduce_metrics(values: Mapping[str, float | None], *, weight: float = 1.0) -> dict[str, float | None]:
    """Weighted mean of each metric over all ranks, e.g. losses weighted by the samples each rank saw.

    None and NaN values stay None/NaN when every rank has them so; ranks without a value
    do not count. Every rank gets the same result (one all-reduce).

    Example:
        >>> reduce_metrics({"loss": 0.52, "acc": 0.81}, weight=1024)
    """
    keys = list(values)
    flat: list[float] = []
    for k in keys:
        v = values[k]
        ok = v is not None and v == v  # not None, not NaN
        flat += [float(v) * weight if ok else 0.0, float(weight) if ok else 0.0]  # type: ignore[arg-type]
    sums = all_reduce_sum(flat)
    out: dict[str, float | None] = {}
    for i, k in enumerate(keys):
        total, w = sums[2 * i], sums[2 * i + 1]
        if w > 0:
            out[k] = total / w
        else:
            out[k] = None if values[k] is None else float("nan")
    return out


def broadcast_object(obj: _T, *, src: int = 0) -> _T:
    """Rank `src`'s Python object on every rank (e.g. a decision every rank must share)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_comm_device())
    return box[0]


def barrier() -> None:
    """Wait for every rank (no-op when not distributed)."""
    if is_distributed():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
