"""`tensor-copy`: `torch.tensor(ndarray)` copies data that `torch.from_numpy` would share (T11)."""

from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, saving_gain, step_ms


@register("tensor-copy", priority=50, techniques=("T11", "T12"), summary="torch.tensor() called on numpy arrays")
def check(obs: dict):
    c = obs.get("tensor_copies", {})
    if not c.get("count"):
        return None
    step = step_ms(obs)
    share = c["ms_per_step"] / step if step else 0.0
    sites = ", ".join(c.get("sites", [])) or "user code"
    evidence = (f"torch.tensor(ndarray) at {sites}: {c['per_step']:.1f} copies per step, {c['mib']:.2f} MiB in all, "
                f"{c['ms_per_step']:.3f} ms per step ({share:.1%})")
    fix = "torch.from_numpy(a) or torch.as_tensor(a) shares the array's memory instead of copying it (T11)"
    return finding("tensor-copy", evidence=evidence, fix=fix, est_gain=saving_gain(step, 0.9 * c["ms_per_step"]),
                   obs=obs, basis="timed")
