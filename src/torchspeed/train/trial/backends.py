"""Backend switches a hand-written loop forgets (T22, TF32, CPU threads).

- cudnn.benchmark (T22): with fixed input shapes, cuDNN times its algorithms once and keeps
  the fastest (1.27x-1.70x forward+backward in NVIDIA's numbers). With shapes that change
  every step it re-tunes every step, so it is off for variable shapes.
- TF32 matmuls/convolutions on Ampere+ GPUs: fp32 code gets Tensor Cores. Set through the
  legacy `allow_tf32` flags, which keep `torch.get_float32_matmul_precision()` readable for the
  libraries that read it (Lightning); through the per-backend `fp32_precision` settings only in
  a process that already uses them (`enable_tf32`).
- CPU threads: torch uses one thread per usable core; oversubscription (more threads than
  cores, e.g. inherited from a container's visible CPU count) is corrected. (With DataLoader
  workers on the same cores, `fit` measures fewer threads too: `switches.py`.)
- glibc malloc (CPU): by default each step's activation blocks above glibc's mmap threshold
  are mapped afresh and unmapped on free, so the kernel faults in and zeroes new pages every
  step (about 10,000 page faults per ResNet-20 step at batch 64). `tune_malloc()` sets the
  same thresholds the bench's processes get from the environment (`env.GLIBC_MALLOC_ENV`), in
  this process, through glibc's `mallopt`: blocks are reused, faults drop under 1,000 per
  step. The process keeps its peak heap, as tcmalloc and jemalloc do.

Example:
    >>> configure_backends(torch.device("cuda"), fixed_shapes=True)
    {'cudnn_benchmark': Decision(True, ...), 'tf32': Decision(True, ...)}
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator
import os
import platform

import torch

from torchspeed.env import GLIBC_MALLOC_ENV, usable_cores
from torchspeed._allocator import allocator_in_use
from torchspeed.train.decision import Decision

__all__ = ["no_autotune", "configure_backends", "backend_decisions", "decide_backends", "apply_backends",
           "BACKEND_KEYS", "enable_tf32", "tune_malloc"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
_malloc_tuned: Decision | None = None


def configure_backends(device: torch.device | str, *, fixed_shapes: bool = True, tf32: bool = True,
                       cudnn_benchmark: bool | None = None) -> dict[str, object]:
    """Set the process-wide switches for `device`; return a `Decision` per switch set
    (`backend_decisions`, then `apply_backends`)."""
    decisions = backend_decisions(device, fixed_shapes=fixed_shapes, tf32=tf32, cudnn_benchmark=cudnn_benchmark)
    apply_backends(device, decisions)
    return decisions


def backend_decisions(device: torch.device | str, *, fixed_shapes: bool = True, tf32: bool = True,
                      cudnn_benchmark: bool | None = None) -> dict[str, Decision]:
    """What `apply_backends` should set for `device`, and why: cudnn.benchmark and TF32 on CUDA; the intra-op
    threads on a CPU (no more than its usable cores). Sets nothing (the plan decides, the Trainer applies)."""
    device = torch.device(device)
    if device.type == "cuda":
        bench = fixed_shapes if cudnn_benchmark is None else cudnn_benchmark
        how = (_TF32_LEGACY if _legacy_readable(torch.backends.cuda.matmul) else _TF32_PER_BACKEND) if tf32 else "off"
        return {"cudnn_benchmark": Decision(bool(bench), "asked for" if cudnn_benchmark is not None else (
                    "fixed input shapes: cuDNN times its algorithms once" if fixed_shapes else "input shapes vary")),
                "tf32": Decision(bool(tf32), f"fp32 matmuls and convolutions on Tensor Cores (Ampere+): {how}")}
    if device.type != "cpu":
        return {}
    cores, before = usable_cores(), torch.get_num_threads()
    return {"threads": Decision(min(before, cores), f"{cores} usable cores" + (
        f" (was {before}: oversubscribed)" if before > cores else ""))}


def apply_backends(device: torch.device | str, decisions) -> None:
    """Put `decisions` (`backend_decisions`' keys) into effect, process-wide; a key not there is left as it is."""
    device = torch.device(device)
    if device.type == "cuda":
        if "cudnn_benchmark" in decisions:
            torch.backends.cudnn.benchmark = bool(decisions["cudnn_benchmark"].value)
        if "tf32" in decisions and decisions["tf32"].value:
            enable_tf32()
    elif "threads" in decisions and decisions["threads"].value != torch.get_num_threads():
        torch.set_num_threads(int(decisions["threads"].value))


BACKEND_KEYS = ("cudnn_benchmark", "tf32", "threads", "malloc")  # what `decide_backends` decides


def decide_backends(device: torch.device | str, config) -> dict[str, Decision]:
    """`backend_decisions` from a TrainConfig's settings (`cudnn_benchmark`, `deterministic`, `malloc`), with glibc
    malloc's training settings on a CPU (`tune_malloc`: process-wide, once). The plan's "backends" stage calls it;
    a Trainer built without a plan calls it itself."""
    bench = None if config.cudnn_benchmark == "auto" else bool(config.cudnn_benchmark)
    out = backend_decisions(device, cudnn_benchmark=False if config.deterministic else bench)
    if torch.device(device).type == "cpu" and config.malloc:
        out["malloc"] = tune_malloc()
    return out


_TF32_LEGACY = "allow_tf32 on cuda.matmul and cudnn (torch.get_float32_matmul_precision() stays readable)"
_TF32_PER_BACKEND = ("fp32_precision = 'tf32' on cuda.matmul, cudnn.conv, cudnn.rnn (this process already sets "
                     "precision per backend)")


def _legacy_readable(matmul) -> bool:
    """Whether torch still reads the legacy TF32 flag: it raises once this process has written a per-backend
    fp32_precision."""
    try:
        matmul.allow_tf32
    except RuntimeError:
        return False
    return True


def enable_tf32(backends=None) -> str:
    """TF32 for CUDA's fp32 matmuls (cuBLAS) and convolutions/RNNs (cuDNN); say which API set it.

    torch >= 2.9 has two APIs for this: the legacy flags (`allow_tf32`, the switch behind
    `set_float32_matmul_precision("high")`) and one `fp32_precision` setting per backend. Once the
    per-backend setting is written, torch refuses to read the legacy state: every later
    `torch.get_float32_matmul_precision()` raises ("mix of the legacy and new APIs"), and libraries
    read it (Lightning's Fabric and Trainer do when they start). So the legacy flags, which torch maps
    onto the per-backend settings and which both readers can read; the per-backend settings only where
    the process already uses them (the legacy state no longer reads). `backends` replaces
    `torch.backends` (tests inject it)."""
    b = backends if backends is not None else torch.backends
    matmul, cudnn = b.cuda.matmul, b.cudnn
    if not _legacy_readable(matmul):
        for t in (matmul, cudnn.conv, cudnn.rnn):
            t.fp32_precision = "tf32"
        return _TF32_PER_BACKEND
    matmul.allow_tf32 = True
    cudnn.allow_tf32 = True
    return _TF32_LEGACY


def tune_malloc(*, mallopt: Callable[[int, int], int] | None = None) -> Decision:
    """Give glibc malloc the training settings in this process (once); say what was done and why not.

    `mallopt` replaces glibc's function (tests inject it). Nothing changes where the allocator is
    tcmalloc/jemalloc, the C library is not glibc, or the process already started with the settings.
    """
    global _malloc_tuned
    if _malloc_tuned is not None and mallopt is None:
        return _malloc_tuned
    env = dict(GLIBC_MALLOC_ENV)
    alloc = allocator_in_use()
    if alloc not in ("glibc", "glibc (tuned)"):
        return Decision(False, f"allocator is {alloc}: nothing to tune")
    if all(os.environ.get(k) == v for k, v in env.items()):
        return Decision(True, "set at process start (" + ", ".join(f"{k}={v}" for k, v in env.items()) + ")")
    if mallopt is None:
        if platform.libc_ver()[0] != "glibc":
            return Decision(False, "not glibc: no mallopt")
        try:
            mallopt = ctypes.CDLL("libc.so.6").mallopt
        except (OSError, AttributeError):
            return Decision(False, "glibc's mallopt could not be loaded")
    ok = (mallopt(_M_MMAP_THRESHOLD, int(env["MALLOC_MMAP_THRESHOLD_"])) == 1
          and mallopt(_M_TRIM_THRESHOLD, int(env["MALLOC_TRIM_THRESHOLD_"])) == 1)
    d = Decision(ok, ("mallopt: mmap threshold 32 MiB, trim threshold 1 GiB (activation blocks reused, not "
                      "faulted in afresh each step)") if ok else "mallopt refused the settings")
    _malloc_tuned = d
    return d


@contextlib.contextmanager
def no_autotune() -> Iterator[None]:
    """cuDNN's autotuning (`cudnn.benchmark`) off inside the block, as it was after. For forward passes at a shape
    the run never trains at (the plan's probes on a few samples, the switch trial's numerics guard, the halves of a
    noise-scale batch): autotuning times every algorithm of every convolution once per new shape, seconds in a
    fresh process, and a shape that runs once never pays it back; cuDNN's heuristics choose instead."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before
