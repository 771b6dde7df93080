"""`cpu-threads`: more intra-op threads than the cores the process may use, often after its CPU affinity
was narrowed (collapsed) to fewer cores than the machine has (T45).

torch starts one intra-op thread per core it sees at start-up. When the process's affinity is then narrowed
(`taskset`, a job scheduler's cpuset, `os.sched_setaffinity` in the script or a library it calls), or when the
script asks for more threads than it may use (`torch.set_num_threads(32)` in a 4-core container), the threads
take turns on the allowed cores: each parallel region waits for its slowest thread, which is waiting for a core.
Published reports put the cost at 10x for a collapsed affinity and 30x for threads beyond the allowed cores.

The rule reads the counts (threads, usable cores, the machine's cores); no timing. The fix is measured: the plain
run re-runs a few steps of the script with OMP_NUM_THREADS set to the usable cores (`_envfix`, "cores"),
interleaved with the original, and the finding is ranked on that interval; without it, it is at most low.
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, on_cuda


def excess(obs: Observation) -> tuple[int, int, int] | None:
    """(threads, usable cores, machine cores) when the intra-op threads exceed the usable cores, else None."""
    threads, usable = int(obs.get("threads") or 1), int(obs.get("cpu_cores") or 1)
    machine = int(obs.get("machine_cores") or usable)
    return (threads, usable, machine) if threads > usable else None


@register("cpu-threads", priority=17, techniques=("T45",), cause="cpu-contention", per_step=False,
          summary="more intra-op threads than the cores the process may use (a collapsed CPU affinity)")
def check(obs: Observation):
    got = excess(obs)
    if got is None or on_cuda(obs):
        return None
    threads, usable, machine = got
    evidence = f"{threads} intra-op threads on {usable} usable core{'s' * (usable != 1)}"
    if usable < machine:
        evidence += (f": the process's CPU affinity allows {usable} of the machine's {machine} cores (narrowed after "
                     "torch started its threads, or by taskset / the job's cpuset)")
    fix = (f"match the threads to the usable cores: torch.set_num_threads({usable}) after the affinity is set, or "
           f"OMP_NUM_THREADS={usable} python train.py"
           + (f"; or give the process its cores back (taskset -c 0-{machine - 1}, or the job's cpuset)"
              if usable < machine else "") + " (T45)")
    return finding("cpu-threads", evidence=evidence, fix=fix, est_gain=threads / usable, obs=obs, env_fix="cores",
                   patch="threads", patch_args={"threads": usable})
