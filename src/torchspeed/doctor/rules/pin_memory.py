"""`pin-memory`: host-to-device copies from pageable memory cannot overlap compute (T07)."""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, on_cuda, saving_gain, step_ms


@register("pin-memory", priority=30, techniques=("T07", "T12"), summary="CUDA copies from unpinned DataLoader batches", fix="pin_memory")
def check(obs: Observation):
    if not on_cuda(obs):
        return None  # pinned memory only matters for copies to an accelerator
    loaders = [ld for ld in obs.get("loaders", []) if not ld["pin_memory"]]
    if not loaders:
        return None
    b = obs["breakdown"]
    evidence = (f"DataLoader({loaders[0]['dataset']}) has pin_memory=False; host-to-device copies take "
                f"{b['copy_ms']:.2f} ms ({b['fractions']['copy']:.0%}) of each step, blocking")
    fix = ("DataLoader(..., pin_memory=True) and x.to(device, non_blocking=True) so copies overlap compute; "
           "or torchspeed.Prefetcher (side-stream prefetch)")
    est = saving_gain(step_ms(obs), 0.7 * b["copy_ms"])
    return finding("pin-memory", evidence=evidence, fix=fix, est_gain=est, obs=obs, verify_fix="pin_memory",
                   patch="workers", patch_args={"workers": loaders[0]["num_workers"], "pin_memory": True})
