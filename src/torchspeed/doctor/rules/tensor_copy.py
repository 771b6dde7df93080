"""`tensor-copy`: `torch.tensor(ndarray)` copies data that `torch.from_numpy` would share (T11).

Counted in the training loop by the probe (per measured step: a copy made once while loading the data, before
the first step, or fewer than one a step is no per-step cost, and no finding), and per `dataset[i]` by the
dataset timing (`_datasets`), which also sees the copies a Dataset makes inside DataLoader workers. A
per-sample float64 array is copied and usually converted again: storing the array as float32 once removes both.
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, saving_gain, step_ms

PER_STEP = 1.0  # copies per measured step below this (a one-off at load time: none) are no per-step cost
FIX = "torch.from_numpy(a) or torch.as_tensor(a) shares the array's memory instead of copying it (T11)"
FLOAT64 = ("; the arrays are float64: convert the whole array once at load (a = a.astype(np.float32)), then "
           "torch.from_numpy(a[i]) per sample")


def _from_datasets(obs: Observation):
    """(evidence, ms per step, float64) for copies a Dataset makes per item, scaled by the batch size."""
    for ds in obs.get("datasets") or []:
        c = ds.get("tensor_copies") or {}
        if c.get("per_item"):
            bs = ds.get("batch_size") or 1
            workers = max((ld.get("num_workers", 0) for ld in obs.get("loaders") or []), default=0)
            where = f"in {workers} DataLoader worker(s)" if workers else "in the loading process"
            ms = c["ms_per_item"] * bs
            ev = (f"torch.tensor(ndarray) in {ds['dataset']}[i] at {', '.join(c.get('sites') or []) or 'user code'}: "
                  f"{c['per_item']:.1f} copies per sample, {c['per_item'] * bs:.0f} per batch of {bs}, about "
                  f"{ms:.3f} ms of loading work per step {where}")
            return ev, ms, c.get("float64", False), workers
    return None


@register("tensor-copy", priority=50, techniques=("T11", "T12"), summary="torch.tensor() called on numpy arrays")
def check(obs: Observation):
    c = obs.get("tensor_copies", {})
    step = step_ms(obs)
    if c.get("count") and c.get("per_step", 0.0) >= PER_STEP:
        share = c["ms_per_step"] / step if step else 0.0
        sites = ", ".join(c.get("sites", [])) or "user code"
        evidence = (f"torch.tensor(ndarray) at {sites}: {c['per_step']:.1f} copies per step, {c['mib']:.2f} MiB in "
                    f"all, {c['ms_per_step']:.3f} ms per step ({share:.1%})")
        f64 = bool(c.get("float64"))
        return finding("tensor-copy", evidence=evidence, fix=FIX + (FLOAT64 if f64 else ""),
                       est_gain=saving_gain(step, 0.9 * c["ms_per_step"]), obs=obs, basis="timed")
    found = _from_datasets(obs)
    if found is None:
        return None
    evidence, ms, f64, workers = found
    # in workers the copies cost the loading side, not the step: no gain to claim, only the work removed
    gain = None if workers else saving_gain(step, 0.9 * ms)
    return finding("tensor-copy", evidence=evidence, fix=FIX + (FLOAT64 if f64 else ""), est_gain=gain, obs=obs,
                   basis="timed" if gain is not None else "estimated")
