"""`cpu-bf16-math`: fp32 matrix products and convolutions on a CPU that runs bf16 natively (T21).

On CPUs with AVX512-BF16 or AMX, oneDNN can run fp32 matmuls and convolutions with bf16 inputs
and fp32 accumulation (`torch.backends.mkldnn.matmul.fp32_precision = "bf16"`, same for `conv`),
keeping the model, optimizer and loss in fp32; or the whole forward can run under autocast. The
share of matrix-product time comes from the profiler (`_kernels`); `--verify` measures it. Products that take
under `MIN_CALL_US` a call on average (a small MLP's) are dispatch-bound: bf16 saves nothing there, and a share
near the line flipped the finding between runs of the same script, so they make no finding.
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import amdahl, finding, frac, on_cuda

SHARE = 0.30   # matmul/conv share of the kernel time worth reporting
MIN_CALL_US = 25.0  # a smaller matrix product is dispatch-bound: converting its inputs to bf16 costs what it saves
BF16 = 1.8     # typical bf16 / fp32 matmul throughput ratio on AVX512-BF16 (more with AMX)


@register("cpu-bf16-math", priority=75, techniques=("T21",),
          summary="fp32 matmuls/convolutions on a CPU with native bf16", fix="bf16_math",
          cause="fp32-math")
def check(obs: Observation):
    env = obs.get("env") or {}
    m, k, math = obs.get("model") or {}, obs.get("kernels") or {}, obs.get("math") or {}
    if on_cuda(obs) or not env.get("bf16_supported") or m.get("autocast"):
        return None
    if math.get("mkldnn_matmul") == "bf16" or k.get("matmul_share", 0.0) < SHARE:
        return None
    if (k.get("matmul_us_per_call") or MIN_CALL_US) < MIN_CALL_US:  # small products: bf16 does not pay
        return None
    share = k["matmul_share"]
    cpu = "AMX" if env.get("amx") else "AVX512-BF16"
    evidence = (f"matrix products and convolutions take {share:.0%} of the model's kernel time in fp32, on a CPU "
                f"with {cpu} (torch.backends.mkldnn.matmul.fp32_precision is {math.get('mkldnn_matmul', 'none')!r})")
    fix = ('torch.backends.mkldnn.matmul.fp32_precision = "bf16"; torch.backends.mkldnn.conv.fp32_precision = "bf16" '
           "(bf16 inputs, fp32 accumulation, fp32 weights) or torch.autocast('cpu', dtype=torch.bfloat16) around "
           "forward and loss (T21)")
    est = amdahl(frac(obs, "compute") * share, BF16)
    return finding("cpu-bf16-math", evidence=evidence, fix=fix, est_gain=est, obs=obs, verify_fix="bf16_math", patch="bf16_math")
