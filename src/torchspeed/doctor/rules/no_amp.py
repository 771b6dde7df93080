"""`no-amp`: the model runs in fp32 (T21).

The estimate uses what this machine runs fast (`torchspeed env`): bf16/fp16 on CUDA Tensor
Cores and on CPUs with AVX512-BF16/AMX; on other CPUs bf16 is emulated and slower, so the
advice there is to stay in fp32. `--verify` measures it on the script's model. A script that trains through
Lightning or Hugging Face's `Trainer` (`obs["loop"]`) is told that framework's precision setting first.
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import amdahl, finding, frac, on_cuda, verified


FRAMEWORK_FIX = {  # (bf16, fp16) in the setting of the framework whose loop trains the model
    "lightning": ('precision="bf16-mixed" in L.Trainer(...) or L.Fabric(...)',
                  'precision="16-mixed" in L.Trainer(...) or L.Fabric(...)'),
    "transformers": ("TrainingArguments(..., bf16=True)", "TrainingArguments(..., fp16=True)"),
}


def precision_speedup(obs: Observation) -> float:
    env = obs.get("env", {})
    if on_cuda(obs):
        cc = env.get("compute_capability") or (0, 0)
        return 2.0 if tuple(cc) >= (7, 0) else 1.1
    return 1.5 if env.get("bf16_supported") else 0.5


@register("no-amp", priority=70, techniques=("T21",), summary="no autocast (mixed precision)", fix="autocast",
          cause="fp32-math")
def check(obs: Observation):
    m = obs.get("model", {})
    if not m.get("found") or m.get("autocast", True):
        return None
    s = precision_speedup(obs)
    est = amdahl(frac(obs, "compute"), s)
    env = obs.get("env", {})
    dtype = "torch.float16" if on_cuda(obs) and tuple(env.get("compute_capability") or (0, 0)) < (8, 0) else "torch.bfloat16"
    dev = "cuda" if on_cuda(obs) else "cpu"
    evidence = f"the model's forward runs in fp32 ({frac(obs, 'compute'):.0%} of the step is compute)"
    v = verified(obs, "autocast")
    slower = (v["speedup"] < 0.97) if v else s < 1.0
    if slower and s >= 1.0:  # the machine runs half precision fast; this model measured slower in it
        evidence += (f"; this {dev.upper()} runs bf16 natively, but this model's step measured slower in it (small "
                     "products gain less than the casts cost)")
        fix = ("keep fp32 for this model; a larger model or batch on this machine may gain from torch.autocast("
               f"{dev!r}, dtype={dtype}): measure it with --verify, or let torchspeed.resolve_precision('auto') "
               "decide (T21)")
    elif slower:
        evidence += (f"; this {dev.upper()} has no fast bf16 ({'no AVX512-BF16/AMX' if dev == 'cpu' else 'no Tensor Cores'}), "
                     "so autocast would be emulated and slower")
        fix = ("keep fp32 on this machine; where bf16 is native (CUDA sm80+, CPUs with AVX512-BF16/AMX) wrap the "
               "forward and loss in torch.autocast(device_type, dtype=torch.bfloat16), or let "
               "torchspeed.resolve_precision('auto') decide (T21)")
    else:
        fix = (f"with torch.autocast({dev!r}, dtype={dtype}): out = model(x); loss = loss_fn(out, y)"
               + ("  (+ torch.amp.GradScaler for fp16)" if dtype == "torch.float16" else "")
               + "; a forward already inside torch.cuda.amp.autocast(enabled=flag) or torch.amp.autocast('cuda', ...) "
               f"does nothing on {dev}: point it at torch.autocast(device_type={dev!r}, dtype={dtype}, enabled=True) "
               "(--fix does); torchspeed.resolve_precision('auto') picks the dtype (T21)")
    loop = obs.get("loop")
    if not slower and loop in FRAMEWORK_FIX:  # the framework's own setting: it puts forward and loss under autocast
        fix = FRAMEWORK_FIX[loop][dtype == "torch.float16"] + "; in a loop of your own: " + fix
    # --fix writes bf16 autocast only: fp16 also needs a GradScaler around backward and step; a framework's loop
    # takes its precision setting, not an edit of the script's forward
    patch = None if slower or dtype == "torch.float16" or loop in FRAMEWORK_FIX else "autocast"
    return finding("no-amp", evidence=evidence, fix=fix, est_gain=est, obs=obs, verify_fix="autocast", patch=patch)
