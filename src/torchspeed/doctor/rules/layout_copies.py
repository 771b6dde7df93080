"""`layout-copies`: the model copies permuted tensors to make them contiguous, a large share of its time (T39, T25).

`x.permute(...)` and `x.transpose(...)` are views; the `contiguous()`, `reshape` or `flatten` after one copies
the whole tensor (so does an eager `einops.rearrange` that permutes, then merges axes). The share is the self time
of those copies in the model's forward and backward, from the profiler (`_kernels.layout_copy_times`). The fixes,
cheapest first: drop a `contiguous()` the next operator does not need (`nn.Linear`, `matmul`, `softmax` and
element-wise operators take strided input); or compile the block, where inductor folds the permute into the kernel
that reads it (einops traces natively under `torch.compile` from torch 2.8: `einops.layers.torch.Rearrange`
inside the compiled module keeps one graph). `--verify` measures compile on the script's model.
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import amdahl, finding, frac

SHARE = 0.10    # the copies' share of the model's aten time worth ranking
NEAR = 0.75     # a share from NEAR x SHARE up to SHARE is listed low, near the line: one profiled window of the
# transformer encoder script read 10.4% one run and under 10% the next, so the finding came and went between runs
FOLDED = 5.0    # assumed speed-up of the copies once compiled: most fold into the kernel that reads them
FIX = ("drop the .contiguous() where the next operator takes strided input (Linear, matmul, softmax and element-wise "
       "ops do); else compile the block: model = torch.compile(model) folds the permute into the kernel that reads "
       "it, and einops (einops.rearrange, einops.layers.torch.Rearrange) traces into the same graph (T39, T25; "
       "`torchspeed doctor --verify` measures compile on this model)")


@register("layout-copies", priority=86, techniques=("T39", "T25"), fix="compile",
          summary="contiguous/reshape copies of permuted tensors take a large share of forward/backward time")
def check(obs: Observation):
    k = obs.get("kernels") or {}
    m = obs.get("model") or {}
    share = k.get("layout_share", 0.0)
    if share < NEAR * SHARE or m.get("compiled"):
        return None
    near = share < SHARE
    evidence = (f"copies made by contiguous()/reshape/flatten of permuted or transposed tensors take {share:.0%} of "
                f"the model's forward + backward kernel time ({k.get('ms_per_step', 0.0) * share:.2f} ms a step; "
                f"top kernels: {', '.join(k.get('top', [])[:4])}): each one a full pass over the tensor's memory"
                + (f"; near the {SHARE:.0%} share where it is ranked, so listed low: `--verify` measures compile on "
                   "this model and settles it" if near else ""))
    est = amdahl(frac(obs, "compute") * share, FOLDED)
    return finding("layout-copies", evidence=evidence, fix=FIX, est_gain=est, obs=obs, verify_fix="compile",
                   patch="compile", severity="low" if near else None)
