"""`data-bound`: the step waits for data (T02, T03, T06, T10).

The share is read from the trimmed step records (`_summary`: start-up outliers such as worker
start-up at an epoch edge left out), so a loop that waits once per epoch is not called
data-bound. The fix follows what the data is: a TensorDataset already in memory is indexed in
whole batches; otherwise the worker count `--verify` measured with the tuner (fewer as well as more).
For a loop that loads in the main process the plain run re-runs the script with the workers patch
(`_envfix`, "workers") and the finding ranks on that measurement.
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import (finding, frac, in_memory_fix, loader_summary, robust_frac, step_ms,
                                             workers_verdict)

THRESHOLD = 0.10  # share of the step spent waiting for the next batch


def overlap_gain(obs: Observation) -> float:
    """Gain when loading overlaps compute in workers (cores - 1 of them, at least one)."""
    step = step_ms(obs)
    data = obs["breakdown"]["data_wait_ms"]
    ld = loader_summary(obs) or {}
    workers = max(1, int(obs.get("cpu_cores", 2)) - 1)
    if ld.get("in_memory"):
        return step / max(step - 0.9 * data, 1e-9)  # batched indexing removes nearly all of the wait
    if ld.get("num_workers", 0) > 0:
        return 1.0 / (1.0 - 0.5 * min(frac(obs, "data_wait"), 0.9))  # more workers / faster decode: half of it
    return step / max(step - data, data / workers, 1e-9)


@register("data-bound", priority=10, techniques=("T02", "T03"), summary="the training step waits for the input pipeline",
          fix="workers")
def check(obs: Observation):
    f = robust_frac(obs, "data_wait")
    if f < THRESHOLD:
        return None
    b = obs["breakdown"]
    ld = loader_summary(obs) or {}
    evidence = (f"data wait is {f:.0%} of each step ({b['data_wait_ms']:.2f} of {b['step_ms']:.2f} ms, trimmed mean "
                f"of {b.get('steps', '?')} steps; the median step's share and the trimmed mean's, whichever is "
                f"smaller) from DataLoader({ld.get('dataset', '?')}, "
                f"num_workers={ld.get('num_workers', '?')})")
    for ds in obs.get("datasets", []):
        evidence += (f"; {ds['dataset']}[i] takes {ds['getitem_ms']:.3f} ms (decode {ds['decode_ms']:.3f}, "
                     f"transforms {ds['transform_ms']:.3f}, other {ds['other_ms']:.3f})")
        break
    v = workers_verdict(obs)
    if ld.get("in_memory"):
        own = ld.get("own_batching") or []
        return finding("data-bound", evidence=evidence, fix=in_memory_fix(own), est_gain=overlap_gain(obs), obs=obs,
                       basis="timed", patch=None if own else "batched_index")
    patch_args = None
    if v and v.get("direction") == "fewer" and v["speedup"] > 1.0:
        patch_args = {"workers": int(v["candidate"].split("=")[1].split(",")[0])}
        fix = (f"use fewer workers: {v['candidate']} measured {v['speedup']:.2f}x faster than {v['current']} here "
               "(workers and the model's threads share the cores); `torchspeed tune` chooses the same (T06, T45)")
    elif ld.get("num_workers", 0) == 0:
        patch_args = {"workers": min(4, max(1, int(obs.get("cpu_cores", 2))))}
        fix = ("load in parallel: DataLoader(..., num_workers=N, persistent_workers=True) with N measured by "
               "`torchspeed tune`; then cache decoded samples in memory if the dataset fits (T06, T10)")
    else:
        fix = ("cache decoded samples (T10), decode faster (T04), move augmentation to the accelerator in batches "
               "(T05); more workers only if cores are free: `--verify` and `torchspeed tune` measure fewer and more (T06)")
    # the wait is timed; with no workers it is what loading ahead removes, with workers the share removed is a guess
    basis = "timed" if ld.get("num_workers", 0) == 0 else "estimated"
    return finding("data-bound", evidence=evidence, fix=fix, est_gain=overlap_gain(obs), obs=obs, verify_fix="workers",
                   basis=basis, patch="workers" if patch_args else None, patch_args=patch_args,
                   env_fix="workers" if ld.get("num_workers", 0) == 0 and v is None else None)
