"""`TrainConfig`: every switch of the fast loop, and the checks of options that cannot work together.

Defaults are torchspeed's automatic choice for this machine; `TrainConfig.naive()` turns
every technique off (the bench's `naive` row). The technique IDs are in the comments
(T13 host reads, T14/T16 schedules, T18 fused kernels, T19 accumulation, T20 clipping, T21
precision, T22 backends, T23 channels_last, T25 compile, T26 set_to_none, T31 DDP and FSDP2, T32
label smoothing, T33 test-time augmentation); docs/techniques.md maps each to its module.
"""

from __future__ import annotations

import numbers
import os

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torchspeed.train.trial.compile import MIN_RUN_S

__all__ = ["TrainConfig", "check_reliability_options", "parse_eval_every"]


@dataclass
class TrainConfig:
    """Every switch of the loop. Defaults are torchspeed's automatic choice."""

    epochs: int = 1
    precision: str = "auto"             # T21: "auto" | "fp32" | "bf16" | "fp16"
    channels_last: bool | str = "auto"  # T23: "auto" = on when the model has 2D convolutions
    compile: bool | str = "auto"        # T25: "auto" = keep compiled only if a measured trial is faster
    compile_mode: str | None = None     # None (inductor default) | "reduce-overhead" (CUDA graphs) | ...
    compile_min_run_s: float = MIN_RUN_S  # compile="auto" leaves runs with less eager time than this eager
    cudnn_benchmark: bool | str = "auto"  # T22: "auto" = on for CUDA (fixed shapes)
    set_to_none: bool = True            # T26
    fused_optimizer: bool | str = "auto"  # T18: True/False; "auto": the fused kernel where torch has one, except
                                        # on a run given its own LR (the plan's kernel rule: "default", torch's own)
    lean_step: bool = True              # T51: Adam/AdamW/SGD updated on kept lists, no per-step wrapper (same bits)
    trial: bool | str = "auto"          # measure precision x channels_last x fused x threads on the run's own first
                                        # steps (switches.py, autoswitch.py): "auto"/True = measure; False = rules
    min_gain: float = 1.02              # the trial takes a change only this much faster a step (the plan: 1.1 on a
                                        # run given its LR, whose numbers a change of layout or precision moves)
    trial_share: float | None = None    # the most of the run's seconds the trial may cost where it finds nothing
                                        # (None: autoswitch.PRICE_SHARE; the plan: PORTED_TRIAL_SHARE on a run given
                                        # its LR, never slower than its own loop)
    malloc: bool = True                 # CPU: glibc malloc's training settings in-process (backends.tune_malloc)
    prefetch: bool = True               # T07/T12: side-stream copies on CUDA
    grad_accum: int = 1                 # T19
    clip_grad_norm: float | None = None  # T20: the model's gradient norm clipped to this (clip_grad_norm_)
    clip_grad_value: float | None = None  # T20: each gradient value clamped to [-v, v] (clip_grad_value_)
    label_smoothing: float = 0.0        # T32
    schedule: str | Callable | None = "onecycle"  # T14/T16: one of schedule.SCHEDULES ("onecycle", "wsd", ...),
                                        # None, or a function of the optimizer that builds your own LR scheduler
    schedule_interval: str = "epoch"    # your own scheduler: stepped after each "epoch" or each optimizer "step"
    warmup_steps: int | None = None
    min_lr: float | None = None
    noise_scale_every: int | None = None  # T17: estimate the gradient noise scale every N steps (train/noise.py)
    log_every: int = 50                 # T13: host reads the loss every N steps (1 = .item() each step)
    max_steps: int | None = None        # stop after this many optimizer steps in total
    eval_every: int | str | None = None  # validation: None = every epoch; N = at the first epoch end N optimizer
                                        # steps after the last one (N under an epoch: every N steps inside the epoch
                                        # too, and each epoch end); "30s" = after 30 s of training (inside an
                                        # epoch longer than that too); the last epoch always evaluates
                                        # (docs/train.md: when it pays)
    train_acc: bool | str = "auto"      # the epoch row's train_acc: "auto" = counted only without a val_loader
                                        # (metrics.train_accuracy: val_acc is the accuracy then); True / False
    tta: str | None = None              # T33: None | "flip"
    tta_scales: tuple[float, ...] = ()
    progress: bool = True
    out_dir: str | None = None          # per-epoch metrics.csv / metrics.json
    seed: int | None = None
    distributed: bool | str = "auto"    # T31: "auto" = DDP when torchrun started more than one process
    sync_batchnorm: bool = False        # SyncBatchNorm over all ranks (GPUs only; for small per-GPU batches)
    static_graph: bool = False          # DDP static_graph: only if every step uses the same parameters
    scale_lr_world_size: bool = False   # T17: lr x world_size (the global batch is world_size times larger)
    parallel: str = "auto"              # T31: "ddp" | "fsdp2" (sharded, fsdp.py) | "auto" = DDP while a replica fits
    reshard_after_forward: bool = True  # FSDP2: free gathered weights after forward (one more all-gather)
    activation_checkpointing: tuple[str, ...] = ()  # FSDP2: recompute these block classes' activations
    cpu_offload: bool = False           # FSDP2: weights, gradients and optimizer state in host memory
    # Reliability (docs/reliability.md): checkpoints, exact resume, guards.
    checkpoint_dir: str | None = None   # write checkpoints here (atomic, checksummed)
    checkpoint_every: int | None = None  # optimizer steps between checkpoints (None: at each epoch end only)
    keep_last: int = 3                  # step checkpoints kept (best.pt is kept besides)
    best_metric: str | None = "auto"    # best.pt by this epoch metric: "auto" = val_acc, else val_loss/train_loss
    resume: str | bool | None = None    # None | "auto" (newest good checkpoint in checkpoint_dir; True says the
                                        # same) | a .pt path or checkpoint folder
    restore_best: bool | str = "auto"   # load the best epoch's weights at the end; "auto" = when validating
    max_nonfinite: int | None = 20      # stop after this many NaN/inf-loss steps in a row (each one is skipped)
    deterministic: bool = False         # deterministic kernels + seeded RNGs: bit-identical reruns (slower)

    def __post_init__(self):
        """The run's length, checked where it is given: a count that cannot be is a clear error, not a division
        by zero in the plan."""
        for name, low in (("epochs", 0), ("grad_accum", 1), ("max_steps", 1), ("log_every", 1)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low):
                raise ValueError(f"{name} must be an int >= {low}" + (" (or None)" if name == "max_steps" else "")
                                 + f", got {v!r}")
        if isinstance(self.resume, bool):  # resume=True, as other trainers spell it: the newest good checkpoint
            self.resume = "auto" if self.resume else None
        elif self.resume is not None and not isinstance(self.resume, (str, os.PathLike)):
            raise TypeError(f"resume must be None, True/'auto' (the newest good checkpoint in checkpoint_dir) or a "
                            f"checkpoint's path, got {type(self.resume).__name__} {self.resume!r}")

    @classmethod
    def naive(cls, **overrides) -> "TrainConfig":
        """The loop the seeds call "before": fp32, NCHW, memset zero_grad, .item() every step, no compile."""
        base = dict(precision="fp32", channels_last=False, compile=False, cudnn_benchmark=False,
                    set_to_none=False, fused_optimizer=False, lean_step=False, prefetch=False, log_every=1,
                    trial=False, malloc=False)
        base.update(overrides)
        return cls(**base)


def check_reliability_options(cfg: TrainConfig) -> None:
    """Clear errors for checkpoint, resume and guard options that cannot work together."""
    if cfg.checkpoint_every is not None and cfg.checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1 optimizer steps, got {cfg.checkpoint_every}")
    if cfg.checkpoint_every is not None and not cfg.checkpoint_dir:
        raise ValueError("checkpoint_every needs checkpoint_dir: the folder to write checkpoints to")
    if cfg.keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {cfg.keep_last}")
    if cfg.max_nonfinite is not None and cfg.max_nonfinite < 1:
        raise ValueError(f"max_nonfinite must be >= 1 (or None to switch the check off), got {cfg.max_nonfinite}")
    parse_eval_every(cfg.eval_every)
    for name in ("clip_grad_norm", "clip_grad_value"):
        v = getattr(cfg, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not v > 0):
            raise ValueError(f"{name} must be a number > 0 (or None: no clipping), got {v!r}")
    if cfg.train_acc not in (True, False, "auto"):
        raise ValueError(f"train_acc must be 'auto', True or False, got {cfg.train_acc!r}")
    if cfg.schedule_interval not in ("epoch", "step"):
        raise ValueError(f"schedule_interval must be 'epoch' or 'step' (when your own scheduler steps), "
                         f"got {cfg.schedule_interval!r}")
    if cfg.parallel not in ("auto", "ddp", "fsdp2"):
        raise ValueError(f"parallel must be 'auto', 'ddp' or 'fsdp2', got {cfg.parallel!r}")
    if cfg.resume == "auto" and not cfg.checkpoint_dir:
        raise ValueError("resume='auto' (or True) needs checkpoint_dir: the folder the run writes its checkpoints "
                         "to and looks for them in")
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).exists():
        raise FileNotFoundError(f"resume={cfg.resume!r}: no such checkpoint file or folder; pass an existing "
                                ".pt file, a checkpoint folder, or resume='auto' with checkpoint_dir")


def parse_eval_every(value: int | str | None) -> tuple[str, float] | None:
    """`eval_every` as ("steps", N) or ("seconds", S), None for every epoch; a clear error for anything else."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"eval_every must be None, a number of optimizer steps or a duration like '30s', got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"eval_every must be >= 1 optimizer steps, got {value}")
        return ("steps", float(value))
    text = str(value).strip().lower()
    try:
        seconds = float(text[:-1]) if text.endswith("s") else None
    except ValueError:
        seconds = None
    if seconds is None or seconds <= 0:
        raise ValueError(f"eval_every={value!r}: pass a number of optimizer steps (eval_every=500) or a duration "
                         "of training in seconds (eval_every='30s'), or None to evaluate after every epoch")
    return ("seconds", seconds)
