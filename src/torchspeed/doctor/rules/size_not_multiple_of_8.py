"""`size-not-multiple-of-8`: hidden sizes, a language model's vocabulary or the batch leave Tensor Cores partly
idle (T24). The sizes come from `_model_checks.examine_model`: Linear/Conv widths between layers, and the last
Linear's out_features when it is an LM head (as wide as an nn.Embedding's vocabulary)."""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import amdahl, finding, frac, on_cuda


@register("size-not-multiple-of-8", priority=140, techniques=("T24",), summary="channel/feature sizes or batch not multiples of 8")
def check(obs: Observation):
    m = obs.get("model", {})
    odd = list(m.get("odd_sizes") or [])
    bs = m.get("batch_size")
    if bs and bs % 8 and bs > 8:
        odd.append(f"batch={bs}")
    if not odd:
        return None
    evidence = f"sizes that are not multiples of 8: {', '.join(odd[:6])}" + (f" (+{len(odd) - 6} more)" if len(odd) > 6 else "")
    fix = ("round hidden sizes, the vocabulary (an LM head's out_features) and the batch up to multiples of 8 "
           "(64 on A100+); torchspeed.pad_to_multiple(model) pads nn.Sequential chains exactly with zero weights (T24)")
    if on_cuda(obs) and m.get("autocast"):
        return finding("size-not-multiple-of-8", evidence=evidence + "; Tensor Cores need them for fp16/bf16",
                       fix=fix, est_gain=amdahl(frac(obs, "compute"), 1.15), obs=obs)
    evidence += "; matters for Tensor Cores (CUDA fp16/bf16), hardly on this device"
    return finding("size-not-multiple-of-8", evidence=evidence, fix=fix, est_gain=None, obs=obs, severity="low")
