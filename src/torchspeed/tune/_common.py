"""Shared machinery of the tuners: exact state snapshots, one training step, OOM handling, DDP broadcast.

- `StateSnapshot` saves model weights and buffers, gradients, train/eval mode, optimizer,
  scheduler and GradScaler state, and every RNG (torch CPU/CUDA, numpy, random), and puts
  them back bit for bit. Restores copy *into* the existing tensors, so an optimizer that
  holds references to the parameters stays valid.
- `decide_once(fn)`: under torch.distributed, rank 0 runs `fn` and broadcasts the result to
  every rank (`broadcast_object_list`), so all ranks act on one decision.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import random
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from torchspeed.env import sync
from torchspeed.train.loop.batch import forward_loss
from torchspeed.train.losses import default_loss
from torchspeed.train.optim import is_schedule_free, train_mode
from torchspeed.train.loop.step import backward, optimizer_step

T = TypeVar("T")

__all__ = ["StateSnapshot", "decide_once", "release_memory", "model_device", "make_batch", "TrainStep"]


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")




class StateSnapshot:
    """Everything a tuner may touch, saved so it can be restored exactly."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler=None,
                 scaler=None):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.tensors = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
        self.grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}
        self.modes = {n: m.training for n, m in model.named_modules()}
        self.opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
        self.sched_state = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
        self.scaler_state = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.py_rng = random.getstate()
        try:
            import numpy as np

            self.np_rng = np.random.get_state()
        except ImportError:  # pragma: no cover
            self.np_rng = None

    def restore(self) -> None:
        with torch.no_grad():
            live = self.model.state_dict(keep_vars=True)
            for k, saved in self.tensors.items():
                live[k].copy_(saved)
        for n, p in self.model.named_parameters():
            g = self.grads[n]
            if g is None:
                p.grad = None
            elif p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        for n, m in self.model.named_modules():
            m.training = self.modes.get(n, m.training)
        if self.optimizer is not None:
            self.optimizer.state.clear()
            self.optimizer.load_state_dict(copy.deepcopy(self.opt_state))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(self.sched_state))
            # the scheduler wrote the lr into param_groups when it was built/stepped: the optimizer
            # state restored above already holds the lr it had, so nothing else to undo.
        if self.scaler is not None:
            self.scaler.load_state_dict(copy.deepcopy(self.scaler_state))
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)
        if self.np_rng is not None:
            import numpy as np

            np.random.set_state(self.np_rng)


def decide_once(fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 only and broadcast its result; without torch.distributed just run it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    box: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except BaseException as e:  # every rank must leave the broadcast, so ship the error too
            error = e
            box[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    status, value = box[0]
    if status == "error":
        raise RuntimeError(f"the tuner failed on rank 0: {value}")
    return value


def release_memory(device: torch.device) -> None:
    """After an OOM: drop the failed step's tensors and give cached blocks back to the driver."""
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()


def make_batch(dataset, batch_size: int, *, collate_fn=None, offset: int = 0):
    """A batch of `batch_size` samples taken from `dataset` (cycled when it is shorter)."""
    from torch.utils.data import default_collate

    n = len(dataset)
    if n == 0:
        raise ValueError("the dataset is empty: nothing to tune on")
    samples = [dataset[(offset + i) % n] for i in range(batch_size)]
    return (collate_fn or default_collate)(samples)


class TrainStep:
    """One plain training step (forward in `precision`, backward, optimizer step, zero_grad): the one home of
    stepping a candidate optimizer for every tuner and recipe part (batch timing, LR range test, optimizer and
    loader trials).

    Batches and losses follow `torchspeed.train.loop.batch` (tuples, dicts, models returning their
    loss, `step_fn`), as in the trainer. An optimizer with modes (Schedule-Free's `train()`/`eval()`) is put
    in train mode before each step it takes, whoever built it and whatever evaluated it last.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, loss_fn=None, precision=None,
                 scaler=None, step_fn=None):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.loss_fn, self.step_fn = loss_fn or default_loss(), step_fn
        self.precision = precision
        self._moded = is_schedule_free(optimizer)

    def loss(self, batch) -> torch.Tensor:
        ctx = self.precision.autocast() if self.precision is not None else contextlib.nullcontext()
        with ctx:
            return forward_loss(self.model, batch, loss_fn=self.loss_fn, step_fn=self.step_fn).loss

    def __call__(self, batch) -> torch.Tensor:
        if self._moded:
            train_mode(self.optimizer)  # Schedule-Free steps only in train mode (its weights are swapped back too)
        loss = self.loss(batch)
        backward(loss, scaler=self.scaler)        # the loop's own functions (train/loop/step.py):
        optimizer_step(self.optimizer, scaler=self.scaler)  # scale, step, update in one place
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
