"""`elementwise-bound`: a large share of forward and backward time in element-wise kernels (T25).

Each element-wise operator (activation, add, multiply, their backward) reads and writes the whole
tensor: a chain of them is bound by memory, not arithmetic. `torch.compile` fuses such chains into
one pass. The share comes from the profiler (`_kernels`); `--verify` measures compile on the model.
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import amdahl, finding, frac

SHARE = 0.50     # element-wise share of the aten time worth reporting
FUSED = 2.0      # assumed speed-up of the element-wise part once fused (several passes become one)


@register("elementwise-bound", priority=85, techniques=("T25",),
          summary="element-wise kernels take a large share of forward/backward time", fix="compile")
def check(obs: Observation):
    k = obs.get("kernels") or {}
    m = obs.get("model") or {}
    share = k.get("elementwise_share", 0.0)
    if share < SHARE or m.get("compiled"):
        return None
    evidence = (f"element-wise kernels take {share:.0%} of the model's forward + backward kernel time (matrix "
                f"products and convolutions {k.get('matmul_share', 0.0):.0%}; top: {', '.join(k.get('top', [])[:4])}): "
                "each one is a full pass over memory")
    fix = ("model = torch.compile(model) fuses chains of element-wise ops into one kernel; compile time is paid once "
           "(`torchspeed doctor --verify` measures it on this model) (T25)")
    est = amdahl(frac(obs, "compute") * share, FUSED)
    return finding("elementwise-bound", evidence=evidence, fix=fix, est_gain=est, obs=obs, verify_fix="compile", patch="compile")
