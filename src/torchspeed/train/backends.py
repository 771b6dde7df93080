"""Backend switches a hand-written loop forgets (T22, TF32, CPU threads).

- cudnn.benchmark (T22): with fixed input shapes, cuDNN times its algorithms once and keeps
  the fastest (1.27x-1.70x forward+backward in NVIDIA's numbers). With shapes that change
  every step it re-tunes every step, so it is off for variable shapes.
- TF32 matmuls/convolutions on Ampere+ GPUs: fp32 code gets Tensor Cores.
- CPU threads: torch uses one thread per usable core; oversubscription (more threads than
  cores, e.g. inherited from a container's visible CPU count) is corrected.

Example:
    >>> configure_backends(torch.device("cuda"), fixed_shapes=True)
    {'cudnn_benchmark': True, 'tf32': True}
"""

from __future__ import annotations

import torch

from torchspeed.env import usable_cores

__all__ = ["configure_backends"]


def configure_backends(device: torch.device | str, *, fixed_shapes: bool = True, tf32: bool = True,
                       cudnn_benchmark: bool | None = None) -> dict[str, object]:
    """Set the process-wide switches for `device`; return what was set."""
    device = torch.device(device)
    applied: dict[str, object] = {}
    if device.type == "cuda":
        bench = fixed_shapes if cudnn_benchmark is None else cudnn_benchmark
        torch.backends.cudnn.benchmark = bool(bench)
        applied["cudnn_benchmark"] = bool(bench)
        if tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            torch.set_float32_matmul_precision("high")
        applied["tf32"] = bool(tf32)
    else:
        cores = usable_cores()
        if torch.get_num_threads() > cores:
            torch.set_num_threads(cores)
        applied["threads"] = torch.get_num_threads()
    return applied
