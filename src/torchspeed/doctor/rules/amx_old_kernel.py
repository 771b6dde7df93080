"""`amx-old-kernel`: a CPU with AMX under a Linux kernel before 5.16, where bf16 runs slower than fp32 (T21, T01).

AMX's tile registers are enabled per process by the kernel (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), which Linux
offers from 5.16. On an older kernel oneDNN cannot use AMX and bf16 matmuls and convolutions fall back to slower
code paths: published reports measure bf16 autocast slower than fp32 on such machines. The rule reads the CPU's
flags (`TORCHSPEED_CPU_PROFILE` injects them) and the kernel's release; no timing. `--verify` measures what bf16
autocast does here (the `autocast` fix): measured faster, the rule stays quiet; otherwise the finding names that
interval (its fix, a kernel upgrade, cannot be measured in place: at most low).
"""

from __future__ import annotations

import re

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, measured_text, on_cuda, verified

FIRST = (5, 16)  # the first kernel that grants the AMX tile state to a process


def kernel_version(release: str) -> tuple[int, int] | None:
    """(major, minor) of a kernel release string ("5.15.0-91-generic" -> (5, 15)); None when unreadable."""
    m = re.match(r"(\d+)\.(\d+)", release or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


@register("amx-old-kernel", priority=18, techniques=("T21", "T01"), per_step=False,
          summary="AMX CPU on a Linux kernel before 5.16: bf16 falls back and can run slower than fp32")
def check(obs: Observation):
    version = kernel_version(str(obs.get("kernel") or ""))
    if on_cuda(obs) or not (obs.get("env") or {}).get("amx") or version is None or version >= FIRST:
        return None
    evidence = (f"this CPU has AMX but runs Linux {obs['kernel']} (AMX needs {FIRST[0]}.{FIRST[1]}+ to grant a process "
                "its tile state): oneDNN's bf16 kernels fall back to slower paths, and bf16 can run slower than fp32")
    v = verified(obs, "autocast")
    if v is not None and v.get("verdict") == "faster":
        return None  # bf16 measured faster here all the same: the fallback costs this script nothing
    if v is not None:
        evidence += measured_text(v).replace("--verify measured", "--verify measured bf16 autocast at", 1)
    fix = ("upgrade the kernel to 5.16 or later to use AMX; until then keep fp32 here, or measure bf16 with "
           "`torchspeed doctor --verify` (T21)")
    return finding("amx-old-kernel", evidence=evidence, fix=fix, est_gain=None, obs=obs, severity="low")
