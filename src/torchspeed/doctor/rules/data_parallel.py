"""`data-parallel`: `nn.DataParallel` (one process, GIL-bound, scatters every step) (T31)."""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, on_cuda


@register("data-parallel", priority=130, techniques=("T31",), summary="nn.DataParallel instead of DistributedDataParallel",
          per_step=False)
def check(obs: Observation):
    if not obs.get("model", {}).get("data_parallel"):
        return None
    gpus = int(obs.get("cuda_devices", 0) or 0)
    fix = ("DistributedDataParallel, one process per GPU: `torchrun --nproc_per_node=N train.py` with "
           "torchspeed.fit (process group, DistributedSampler and no_sync handled) (T31)")
    if on_cuda(obs):
        evidence = ("the model is wrapped in nn.DataParallel: one Python process replicates the model and "
                    "scatters every batch from GPU 0 each step")
        return finding("data-parallel", evidence=evidence, fix=fix, est_gain=1.5 if gpus > 1 else 1.0, obs=obs,
                       severity="high" if gpus > 1 else "low")
    evidence = ("the model is wrapped in nn.DataParallel; without GPUs it only forwards to the module (no cost "
                "here), but on several GPUs it is much slower than DDP")
    return finding("data-parallel", evidence=evidence, fix=fix, est_gain=1.0, obs=obs, severity="low")
