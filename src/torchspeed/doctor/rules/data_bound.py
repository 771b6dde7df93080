"""`data-bound`: the step waits for data (T02, T03)."""

from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, frac, loader_summary, step_ms

THRESHOLD = 0.10  # share of the step spent waiting for the next batch


def overlap_gain(obs: dict) -> float:
    """Gain when loading overlaps compute in workers (cores - 1 of them, at least one)."""
    step = step_ms(obs)
    data = obs["breakdown"]["data_wait_ms"]
    ld = loader_summary(obs) or {}
    workers = max(1, int(obs.get("cpu_cores", 2)) - 1)
    if ld.get("num_workers", 0) > 0:
        return 1.0 / (1.0 - 0.5 * min(frac(obs, "data_wait"), 0.9))  # more workers / faster decode: half of it
    return step / max(step - data, data / workers, 1e-9)


@register("data-bound", techniques=("T02", "T03"), summary="the training step waits for the input pipeline")
def check(obs: dict):
    f = frac(obs, "data_wait")
    if f < THRESHOLD:
        return None
    b = obs["breakdown"]
    ld = loader_summary(obs) or {}
    evidence = (f"data wait is {f:.0%} of each step ({b['data_wait_ms']:.2f} of {b['step_ms']:.2f} ms) from "
                f"DataLoader({ld.get('dataset', '?')}, num_workers={ld.get('num_workers', '?')})")
    for ds in obs.get("datasets", []):
        evidence += (f"; {ds['dataset']}[i] takes {ds['getitem_ms']:.3f} ms (decode {ds['decode_ms']:.3f}, "
                     f"transforms {ds['transform_ms']:.3f}, other {ds['other_ms']:.3f})")
        break
    if ld.get("num_workers", 0) == 0:
        fix = ("load in parallel: DataLoader(..., num_workers=N, persistent_workers=True) with N measured by "
               "`torchspeed tune`; then cache decoded samples in memory if the dataset fits (T06, T10)")
    else:
        fix = ("the workers cannot keep up: cache decoded samples (T10), decode faster (T04), move augmentation "
               "to the accelerator in batches (T05), or add workers if cores are free (T06)")
    return finding("data-bound", evidence=evidence, fix=fix, est_gain=overlap_gain(obs), obs=obs, verify_fix="workers")
