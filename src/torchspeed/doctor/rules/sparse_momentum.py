"""`sparse-momentum`: torch's SGD with momentum on an embedding that makes sparse gradients (T51: the optimizer
step's cost).

torch's SGD keeps a sparse gradient's momentum buffer sparse and never coalesces it: `buf.mul_(momentum)
.add_(grad)` appends each step's rows to the buffer, so the optimizer's step costs more every step, for the whole
run. Measured with torchspeed's own SGD before it gave such weights no momentum (`benchmarks/bench_sparse_momentum.py`,
sparse_momentum_a7f5fd8.json, 2-core Zen 4): an `EmbeddingBag(sparse=True)` text classifier's 400 steps went
from 0.7-1.0 ms a step to 4.6-6.8 ms, 1.07-1.39 s in all against 0.16-0.18 s with the embedding's momentum at 0.

The doctor sees the run's first steps only. Its evidence is the growth it timed: the optimizer's time over the
last third of the kept steps against the first third. The estimate is what that growth cost on average over the
steps seen (half of it: the growth is steady), so a short look under-states it (each later step costs more); the
finding stands on the cause, which torch's code fixes: it appears whenever a sparse weight is stepped with
momentum, and stays low until measured. `--verify` measures the fix (`verify.py`, fix `sparse_momentum`): copies of
the model and optimizer, one with the sparse weights in a group without momentum, timed in interleaved rounds on the
captured batch; its interval sets the severity. A lower bound: that batch repeats its rows, which torch's sparse add
merges into the buffer in place, so the growth a run's changing batches cause is not in the figure (cycling two
captured batches was tried: the buffer stops growing once the batches repeat).
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, step_ms


@register("sparse-momentum", priority=66, techniques=("T51",), fix="sparse_momentum",
          summary="SGD momentum on a sparse embedding: the optimizer's step grows every step")
def check(obs: Observation):
    o = obs.get("optimizer") or {}
    n = int(o.get("sparse_momentum") or 0)
    if not n:
        return None
    b = obs.get("breakdown") or {}
    thirds = b.get("optimizer_ms_thirds")  # None: too few steps kept to split
    first, last = thirds or (0.0, 0.0)
    step, grew = step_ms(obs), max(0.0, last - first)
    timed = (f"; the optimizer took {first:.2f} ms a step over the first third of the {b.get('steps', '?')} steps "
             f"timed and {last:.2f} ms over the last" if thirds else "")
    evidence = (f"{o.get('class', 'SGD')} steps {n} weight(s) with sparse gradients (an embedding with sparse=True) "
                f"with momentum: torch keeps their momentum buffer sparse and never coalesces it, so each step "
                f"appends that step's rows and costs more than the last, to the end of the run{timed}")
    fix = ("the sparse weights in a parameter group of their own without momentum (`{'params': emb.parameters(), "
           "'momentum': 0.0}`), or torch.optim.SparseAdam for them; torchspeed's create_optimizer('sgd', ...) and "
           "fit(optimizer='sgd') do the first")
    gain = step / max(1e-9, step - grew / 2) if step and grew else None  # the mean step holds half the growth
    if (obs.get("verify") or {}).get("sparse_momentum", {}).get("speedup"):
        evidence += ("; --verify's figure leaves the growth out (its captured batch repeats its rows, which torch adds "
                     "into the buffer in place): a lower bound")
    return finding("sparse-momentum", evidence=evidence, fix=fix, est_gain=gain, obs=obs, verify_fix="sparse_momentum")
