"""`compile-graph-breaks`: `torch.compile` splits the model into pieces, or compiles it again and again (T25).

Dynamo's own graph-break and recompile records are collected while the script runs (`_compile_log`),
each with the user's file and line and the reason, so the fix can name the line.
"""

from __future__ import annotations

from torchspeed.doctor.observation import CompileEvent, Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding


def _fmt(events: list[CompileEvent], n: int = 3) -> str:
    return "; ".join(f"{e['site']} ({e['count']}x): {e['reason']}" for e in events[:n])


@register("compile-graph-breaks", priority=87, techniques=("T25",),
          summary="torch.compile graph breaks and recompiles in the script", per_step=False)
def check(obs: Observation):
    c = obs.get("compile") or {}
    breaks, recompiles = c.get("graph_breaks") or [], c.get("recompiles") or []
    if not breaks and not recompiles:
        return None
    parts = []
    if breaks:
        parts.append(f"{sum(e['count'] for e in breaks)} graph breaks at {len(breaks)} sites: {_fmt(breaks)}")
    if recompiles:
        parts.append(f"{sum(e['count'] for e in recompiles)} recompiles: {_fmt(recompiles)}")
    fix = ("remove the break at each line named: no print/.item()/.tolist() or Python `if` on tensor values inside "
           "the compiled code (log outside it; torch.where or torch.cond for branches); for recompiles on shapes, "
           "pad inputs to a few fixed shapes or compile with dynamic=True; check with "
           "TORCH_LOGS=graph_breaks,recompiles (T25)")
    sev = "medium" if breaks or sum(e["count"] for e in recompiles) >= 3 else "low"
    return finding("compile-graph-breaks", evidence="; ".join(parts), fix=fix, est_gain=None, obs=obs, severity=sev)
