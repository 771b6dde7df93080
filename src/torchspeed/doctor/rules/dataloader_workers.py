"""`dataloader-workers`: batches are loaded in the training process (num_workers=0) (T06).

Ranked on a measurement of the fix: `--verify`'s tuner, or the plain run's re-run of the script with
the workers patch (`_envfix`, "workers"); the timed data wait alone cannot say whether workers overlap
it on this machine's cores. Not for a TensorDataset: its rows are already in memory, and the fix there is indexing whole
batches (`data-bound` says so), never workers.
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, frac, verified
from torchspeed.doctor.rules.data_bound import overlap_gain

THRESHOLD = 0.05


@register("dataloader-workers", priority=20, techniques=("T06", "T08"),
          summary="DataLoader(num_workers=0) with a visible data wait", fix="workers")
def check(obs: Observation):
    loaders = [ld for ld in obs.get("loaders", []) if ld["num_workers"] == 0 and ld.get("map_style", True)
               and not ld.get("in_memory")]
    if not loaders:
        return None
    f = frac(obs, "data_wait")
    v = verified(obs, "workers")
    if v is not None and v.get("direction") != "more":
        return None  # the tuner measured fewer and more workers and keeps loading in the main process
    if f < THRESHOLD and v is None:
        return None  # loading in the main process costs almost nothing here
    ld = loaders[0]
    cores = int(obs.get("cpu_cores", 2))
    n = min(4, max(1, cores))
    evidence = (f"DataLoader({ld['dataset']}, batch_size={ld['batch_size']}) has num_workers=0: the step waits "
                f"{f:.0%} of its time ({obs['breakdown']['data_wait_ms']:.2f} ms) while nothing loads ahead")
    if v is not None:
        n = int(v["candidate"].split("=")[1].split(",")[0])
    fix = (f"DataLoader(..., num_workers={n}, persistent_workers=True, prefetch_factor=2); on {cores} cores "
           "workers share the CPU with compute, so measure it (`torchspeed doctor --verify`, `torchspeed tune`)")
    return finding("dataloader-workers", evidence=evidence, fix=fix, est_gain=overlap_gain(obs), obs=obs,
                   verify_fix="workers", basis="timed", patch="workers", patch_args={"workers": n},
                   env_fix="workers" if v is None else None)
