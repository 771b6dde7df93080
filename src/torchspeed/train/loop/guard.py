"""Guards for the two ways a training step commonly dies: a NaN/inf loss and running out of memory.

**Non-finite loss (T21's skip, extended to bf16 and fp32).** With fp16 the GradScaler
already skips an optimizer step whose gradients overflowed. With bf16 or fp32 nothing
does: one NaN loss turns every weight into NaN and the rest of the run is wasted. The
trainer skips such a step instead (no weight, momentum or Adam-moment update), counts it,
and after `max_nonfinite` skipped steps in a row stops with `NonFiniteLossError`; the
checkpoints already written are untouched, so the last good one is intact.

Where the check runs, and what it costs:

- On CPU the loss is already in host memory: reading it is free, so every step is
  checked.
- On CUDA, reading the loss each step would be a host-device sync that empties the GPU's
  queue (T13). For fused optimizers (torchspeed's default there) the check stays on the
  device: the flag `~isfinite(loss)` is handed to the fused kernel as `found_inf`, which
  skips the update on the GPU exactly as GradScaler does for fp16, and the run of skipped
  steps is counted on the device and read at the `log_every` sync the loop already has,
  so the stop comes at most `log_every` steps late (and those steps changed nothing).
  Unfused optimizers cannot skip on the device, so there the loss is read each step: one
  sync per step, the price of not losing the run.

**Out of memory.** `torch.cuda.OutOfMemoryError` (or the CPU allocator's "can't allocate
memory") inside a step becomes `TrainingOutOfMemoryError`, whose message names the batch
size, the memory numbers and the fixes: a smaller batch, the same batch through gradient
accumulation (T19), activation checkpointing (T29), half precision (T21).

**A last batch of one sample** that BatchNorm cannot train on ("Expected more than 1 value per channel": a
dataset one more than a multiple of the batch size, without `drop_last`) is left out of the epoch, said once,
where a plain loop would die at the end of its first epoch (`step_failed`).

Example:
    >>> try:
    ...     trainer.step_batch(batch)
    ... except Exception as e:
    ...     if is_out_of_memory(e):
    ...         raise out_of_memory_error(e, batch_size=len(batch[1]), device=trainer.device) from e
    ...     raise

(the trainer's `step_batch` hands its errors to `step_failed`, which does that and the rest)

`NonFiniteGuard` is the state machine the trainer runs: `observe` each micro-batch's loss,
`step` in place of the optimizer step, `check` where the loop may read the device.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

import torch

from torchspeed.env import host_memory
from torchspeed.train.loop.batch import batch_size as batch_len
from torchspeed.train.trial.half_fallback import grads_nonfinite

log = logging.getLogger("torchspeed")

__all__ = ["NonFiniteLossError", "TrainingOutOfMemoryError", "step_failed", "one_sample_batchnorm", "is_out_of_memory",
           "out_of_memory_error", "memory_report", "supports_device_skip", "NonFiniteGuard"]


class NonFiniteLossError(RuntimeError):
    """The loss was NaN or inf for too many optimizer steps in a row."""


class TrainingOutOfMemoryError(RuntimeError):
    """A training step ran out of memory; the message gives the batch size, memory numbers and fixes."""


_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate")


def is_out_of_memory(e: BaseException) -> bool:
    """True for CUDA's OutOfMemoryError, CPU allocation failures and MemoryError."""
    if isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _OOM_MARKERS)


def memory_report(device: torch.device | str) -> str:
    """The memory numbers that matter for `device`, in GiB, as one line."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        return (f"{_gib(torch.cuda.memory_allocated(device))} allocated by tensors, "
                f"{_gib(torch.cuda.memory_reserved(device))} reserved by the caching allocator, "
                f"peak {_gib(torch.cuda.max_memory_allocated(device))}; the GPU has {_gib(total)} "
                f"with {_gib(free)} free")
    rss = _rss_bytes()
    avail, total = host_memory()
    parts = [f"this process uses {_gib(rss)}" if rss else "process memory unknown"]
    if total:
        parts.append(f"the machine has {_gib(total)} with {_gib(avail)} available")
    return ", ".join(parts)


def out_of_memory_error(e: BaseException, *, batch_size: int | None, device: torch.device | str,
                        grad_accum: int = 1, precision: str | None = None) -> TrainingOutOfMemoryError:
    """The error to raise for an out-of-memory failure in a step: what did not fit and what to try."""
    device = torch.device(device)
    what = f"a batch of {batch_size}" if batch_size else "the batch"
    fixes = []
    if batch_size and batch_size > 1:
        half = max(1, batch_size // 2)
        fixes.append(f"a smaller batch (batch_size={half})")
        fixes.append(f"the same effective batch through accumulation (batch_size={half}, "
                     f"grad_accum={grad_accum * 2})")
    else:
        fixes.append("a smaller model or input size (the batch is already 1)")
    fixes.append("activation checkpointing (torch.utils.checkpoint on the largest blocks: "
                 "recomputes activations in backward instead of storing them)")
    if precision in (None, "fp32"):
        fixes.append("bf16/fp16 precision (halves activation memory)")
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return TrainingOutOfMemoryError(
        f"out of memory training {what} on {device} (grad_accum={grad_accum}): {memory_report(device)}. "
        f"Try {'; or '.join(fixes)}. Checkpoints already written are untouched. [{type(e).__name__}: {first}]")


def one_sample_batchnorm(e: BaseException, batch_size: int | None) -> bool:
    """`e` is BatchNorm refusing a batch of one sample in training: the batch's fault, not the step's settings."""
    return isinstance(e, ValueError) and batch_size == 1 and "more than 1 value per channel" in str(e)


def step_failed(trainer, e: BaseException, batch) -> None:
    """A training step on `batch` raised `e`: return having trained it again (right after a switch-trial
    candidate's turn, in settings that work: `SwitchStage.recover`) or skipped it, else raise what says why.
    Out of memory becomes
    `TrainingOutOfMemoryError` (what the failed step holds freed first, so the caller can save or retry). An
    epoch's remainder batch of one sample that BatchNorm cannot train on (a dataset one more than a multiple of
    the batch size) is left out, said once: the run goes on; a run whose every batch holds one sample stops with
    the fix (drop_last=True, another batch size)."""
    if trainer.switcher.recover(e, batch, trainer.train_step):
        return
    batch_size = batch_len(batch)
    if is_out_of_memory(e) and not isinstance(e, TrainingOutOfMemoryError):
        trainer.reset_micro()
        if trainer.device.type == "cuda":
            torch.cuda.empty_cache()
        raise out_of_memory_error(e, batch_size=batch_size or None, device=trainer.device,
                                  grad_accum=trainer.config.grad_accum, precision=trainer.precision.name) from e
    if not one_sample_batchnorm(e, batch_size):
        raise e
    if trainer._seen == 0:  # the epoch's first batch holds one sample: every batch may
        e.add_note("torchspeed: this batch holds 1 sample and BatchNorm cannot train on one: use a batch size over "
                   "1 (and drop_last=True on the DataLoader where the dataset's length leaves 1 over)")
        raise e
    trainer.reset_micro()
    if not trainer._left_out_one:
        trainer._left_out_one = True
        log.warning("torchspeed: an epoch's last batch holds 1 sample and BatchNorm cannot train on one: it is left "
                    "out (pass drop_last=True to the DataLoader to leave it out yourself, or another batch size)")


def supports_device_skip(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """True if `optimizer` can skip an update on the device (fused kernels read `found_inf`)."""
    return device.type == "cuda" and bool(optimizer.defaults.get("fused"))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource  # Unix only

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak, in KiB on Linux


_NOT_SKIPPED, _SKIPPED = torch.zeros((), dtype=torch.int64), torch.ones((), dtype=torch.int64)  # read-only


class NonFiniteGuard:
    """Skip optimizer steps whose loss was NaN/inf; stop after `max_nonfinite` in a row.

    Modes: "scaler" (`precision_skips`: fp16's GradScaler already skips), "device" (CUDA + fused optimizer:
    skipped on the GPU, no sync), "host" (the loss is read each step; free on CPU), "off". The mode is read
    at each use, so a precision or optimizer-kernel switch during the run only sets `precision_skips` (no new
    guard). `all_ranks_max(flag)` reduces the skip flag over DDP ranks so every replica skips together.
    """

    def __init__(self, max_nonfinite: int | None, *, optimizer: torch.optim.Optimizer, device: torch.device,
                 precision_skips: bool = False, all_ranks_max: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.limit, self.device, self.optimizer = max_nonfinite, device, optimizer
        self.precision_skips = precision_skips  # the precision's own step skips non-finite gradients (fp16)
        self._all_ranks_max = all_ranks_max
        self._window_bad: torch.Tensor | bool = False  # any NaN/inf loss since the last optimizer step
        self.bad_run = torch.zeros((), dtype=torch.int64, device=device)  # skipped steps in a row
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # skipped steps in total
        self._host_run = 0  # "host" mode: the run of skips, known on the host (no kernel on a good step)
        self.host_reads = device.type == "cpu"  # a tensor's value is read without a sync (the CPU): a float read
        self._half = None  # (whether to check the gradients now, what to do when they break): `watch_half`
        self.grad_skips = 0  # of the skipped steps, those whose gradients a chosen half precision broke

    @property
    def mode(self) -> str:
        if self.limit is None:
            return "off"
        if self.precision_skips:
            return "scaler"
        return "device" if not self.host_reads and supports_device_skip(self.optimizer, self.device) else "host"

    def observe(self, loss: torch.Tensor) -> torch.Tensor | None:
        """A micro-batch's detached loss: the value to add to the metrics, or None to leave it out."""
        mode = self.mode
        if mode == "host":
            # a host read: free on CPU (a float read, not a kernel), one sync on CUDA (unfused)
            bad = not (math.isfinite(loss.item()) if self.host_reads and loss.numel() == 1 else
                       bool(torch.isfinite(loss).all()))
            self._window_bad = self._window_bad or bad
            return None if bad else loss
        if mode == "device":
            bad_t = ~torch.isfinite(loss)  # stays on the device: no sync
            self._window_bad = bad_t | self._window_bad
            return torch.where(bad_t, torch.zeros_like(loss), loss)
        return loss

    def reset_window(self) -> None:
        self._window_bad = False

    def watch_half(self, now: Callable[[], bool], broke: Callable[[], None]) -> None:
        """In "host" mode, check the gradients before each update while `now()` (a half precision the run was not
        asked for: `half_fallback`); non-finite ones skip the step, as a bad loss does, and call `broke()`."""
        self._half = (now, broke)

    def _grads_broke(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._half is None or not self._half[0]() or not grads_nonfinite(optimizer):
            return False
        self._half[1]()
        self.grad_skips += 1
        return True

    def step(self, optimizer: torch.optim.Optimizer, update: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run `update()` (the optimizer step; returns 1 if it skipped, as fp16's scaler does) unless the
        loss was bad; return 1 if the step was skipped, else 0, as a device tensor."""
        mode = self.mode
        if mode in ("off", "scaler"):
            skip = update().to(self.device)
        elif mode == "host":  # the flag is on the host: a good step costs no kernel besides the update
            bad = bool(self._window_bad)
            if self._all_ranks_max is not None:
                bad = bool(self._all_ranks_max(torch.tensor(float(bad), device=self.device)) > 0)
            self._window_bad = False
            if not bad and not self._grads_broke(optimizer):
                update()  # no scaler in this mode: the update never skips
                if self._host_run:
                    self._host_run = 0
                    self.bad_run.zero_()
                return _NOT_SKIPPED
            self._host_run += 1
            self.bad_run.fill_(self._host_run)
            self.skipped += 1
            return _SKIPPED
        else:  # "device": fused kernels read `found_inf` and skip the update on the GPU, as for fp16
            flag = torch.as_tensor(self._window_bad, device=self.device).float()
            if self._all_ranks_max is not None:
                flag = self._all_ranks_max(flag)
            optimizer.found_inf = flag
            try:
                update()
            finally:
                del optimizer.found_inf
            skip = (flag > 0).to(torch.int64)
        self._window_bad = False
        self.bad_run = (self.bad_run + skip) * skip  # count of skipped steps in a row, on the device
        self.skipped += skip
        return skip

    def due(self, step: int, log_every: int) -> bool:
        """Whether to read the run counter now: every step where that is free, else at the log sync."""
        mode = self.mode
        if mode == "host":  # the run of skips is a host count: read it when there is one
            return self._host_run > 0
        return mode != "off" and (self.device.type != "cuda" or step % log_every == 0)

    def check(self, *, where: str, last_checkpoint=None) -> None:
        run = self._host_run if self.mode == "host" else int(self.bad_run)
        if self.limit is not None and run >= self.limit:
            last = f"the last checkpoint, {last_checkpoint}, is intact" if last_checkpoint else \
                "no checkpoint was written (set checkpoint_dir to keep one)"
            raise NonFiniteLossError(
                f"the loss was NaN or inf in {run} optimizer steps in a row (up to {where}); each was skipped, and "
                f"training stopped; {last}. Try a lower learning rate, gradient clipping (clip_grad_norm=1.0), "
                "checking the inputs and labels for NaN/inf, or fp32/bf16 instead of fp16; max_nonfinite sets how "
                "many bad steps in a row are tolerated")

    def state_dict(self) -> dict:
        """The counts (the skips in all, the run of skips in a row): a checkpoint's "guard" part."""
        return {"skipped": int(self.skipped), "bad_run": int(self.bad_run)}

    def load_state_dict(self, state: dict) -> None:
        self.skipped.fill_(int(state["skipped"]))
        self.bad_run.fill_(int(state["bad_run"]))
        self._host_run = int(state["bad_run"])
