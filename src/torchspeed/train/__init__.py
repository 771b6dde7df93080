"""The fast training loop (`Trainer`) and the techniques it composes, each public (`torchspeed.fit` is above it).

The modules live in rooms that name the architecture: `loop/` (the step and the loop), `trial/` (the switch trial
and what it switches), `state/` (state and checkpoints), `parallel/` (DDP and FSDP2); the techniques that stand
alone stay at this level (optimizers, schedules, data order and transfer, evaluation, BatchNorm statistics, ...).
"""

import sys

from torchspeed.train.trial.backends import configure_backends, tune_malloc
from torchspeed.train.loop.callbacks import EMA, Callback, EarlyStopping
from torchspeed.train.batch_ramp import BatchRamp, BatchRampLR
from torchspeed.train.decision import Decision, TrialCache
from torchspeed.train.trial.compile import CompileDecision, compile_model
from torchspeed.train.state.checkpoint import (CheckpointError, CheckpointManager, CheckpointMismatchError,
                                               CorruptCheckpointError, load_checkpoint, save_checkpoint)
from torchspeed.train.loggers import TensorBoardLogger
from torchspeed.train.loop.guard import NonFiniteLossError, TrainingOutOfMemoryError
from torchspeed.train.state.rng import capture_rng_state, enable_determinism, restore_rng_state, seed_everything
from torchspeed.train.sampler import ResumableSampler
from torchspeed.train.parallel.distributed import init_distributed, is_rank_zero, reduce_metrics, wrap_ddp
from torchspeed.train.parallel.shard import distributed_loader
from torchspeed.train.trial.switch_choice import Switches, candidate_grid
from torchspeed.train.trial.switches import LiveTrial
from torchspeed.train.wrappers import unwrap_model
from torchspeed.train.evaluate import evaluate, tta_views
from torchspeed.train.trial.memory_format import apply_channels_last, has_conv2d, is_channels_last, to_channels_last
from torchspeed.train.loop.metrics import DeviceMeter
from torchspeed.train.optim import create_optimizer, hidden_matrices, mostly_matrices
from torchspeed.train.muon import MuonAdamW
from torchspeed.train.optim_kernel import zero_grad
from torchspeed.train.optim_info import OPTIMIZERS
from torchspeed.train.trial.precision import Precision, make_grad_scaler, resolve_precision
from torchspeed.train.schedule import SCHEDULES, create_scheduler, scale_lr
from torchspeed.train.loop.step import backward, optimizer_step
from torchspeed.train.config import TrainConfig
from torchspeed.train.result import FitResult
from torchspeed.train.loop.trainer import Trainer
from torchspeed.train.transfer import Prefetcher, loader_kwargs, to_device

from torchspeed.train.loop import callbacks
from torchspeed.train.parallel import distributed
from torchspeed.train.trial import memory_format, switches

# Public modules that lived at train/'s top level before train/ had rooms, and that users' code names by that
# path (`import torchspeed.train.switches`, `from torchspeed.train.distributed import wrap_ddp`): registered
# under it too, they stay importable as the same module objects. The project's own code and docs name them in
# their rooms (tests/test_homes.py); tests/train/test_public_paths.py holds each old path to its module.
for _old, _module in {"callbacks": callbacks, "distributed": distributed, "memory_format": memory_format,
                      "switches": switches}.items():
    sys.modules[f"{__name__}.{_old}"] = _module
del _old, _module

__all__ = [
    "save_checkpoint", "load_checkpoint", "CheckpointManager", "CheckpointError", "CheckpointMismatchError",
    "CorruptCheckpointError", "NonFiniteLossError", "TrainingOutOfMemoryError", "capture_rng_state",
    "restore_rng_state", "seed_everything", "enable_determinism", "ResumableSampler",
    "configure_backends", "CompileDecision", "compile_model", "evaluate", "tta_views",
    "apply_channels_last", "has_conv2d", "is_channels_last", "to_channels_last", "DeviceMeter",
    "OPTIMIZERS", "create_optimizer", "zero_grad", "MuonAdamW", "hidden_matrices", "mostly_matrices",
    "Precision", "make_grad_scaler", "resolve_precision",
    "SCHEDULES", "create_scheduler", "scale_lr", "backward", "optimizer_step", "FitResult", "Trainer",
    "TrainConfig", "Prefetcher", "loader_kwargs", "to_device",
    "Callback", "EarlyStopping", "EMA", "BatchRamp", "BatchRampLR", "TensorBoardLogger",
    "init_distributed", "wrap_ddp", "distributed_loader", "reduce_metrics", "is_rank_zero", "unwrap_model",
    "Decision", "TrialCache", "Switches", "LiveTrial", "candidate_grid", "tune_malloc",
]
