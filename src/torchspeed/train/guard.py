"""Guards for the two ways a training step commonly dies: a NaN/inf loss and running out of memory.

**Non-finite loss (T21's skip, extended to bf16 and fp32).** With fp16 the GradScaler
already skips an optimizer step whose gradients overflowed. With bf16 or fp32 nothing
does: one NaN loss turns every weight into NaN and the rest of the run is wasted. The
trainer skips such a step instead (no weight, momentum or Adam-moment update), counts it,
and after `max_nonfinite` skipped steps in a row stops with `NonFiniteLossError`; the
checkpoints already written are untouched, so the last good one is intact.

Where the check runs, and what it costs:

- On CPU the loss is already in host memory: reading it is free, so every step is
  checked before its backward pass (a skipped step also saves the backward).
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

Example:
    >>> try:
    ...     trainer.step_batch(batch)
    ... except Exception as e:
    ...     if is_out_of_memory(e):
    ...         raise out_of_memory_error(e, batch_size=len(batch[1]), device=trainer.device) from e
    ...     raise
"""

from __future__ import annotations

import os

import torch

__all__ = ["NonFiniteLossError", "TrainingOutOfMemoryError", "is_out_of_memory", "out_of_memory_error",
           "memory_report", "supports_device_skip"]


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
    avail, total = _host_memory()
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


def _host_memory() -> tuple[int, int]:
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
        return info.get("MemAvailable", 0), info.get("MemTotal", 0)
    except (OSError, ValueError):
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        except (ValueError, OSError, AttributeError):
            return 0, 0
