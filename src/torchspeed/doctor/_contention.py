"""How busy the DataLoader workers are while the doctor times the model alone (T45, T06).

`cpu-oversubscribed` compares the model's compute per step in the script with the same step on the
captured batch "alone". At the stop the script's workers are still alive: they keep decoding until
their prefetch queue is full. A model timed while they do is not alone, so the doctor waits until
the workers' CPU time stops growing (`wait_children_idle`) and records how busy they still were
during the timing (`children_cpu_s`): the rule reads a contaminated "alone" as no evidence.

The worker processes are this process's children; their CPU time is read from `/proc/<pid>/stat`
(Linux). Elsewhere the functions return None and the doctor times at once, as before.
"""

from __future__ import annotations

import os
import statistics
import time

__all__ = ["children_cpu_s", "wait_children_idle", "quartiles"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def children_cpu_s(pid: int | None = None, proc: str = "/proc") -> float | None:
    """User + system CPU seconds of the direct children of `pid` (this process), None without /proc."""
    pid = os.getpid() if pid is None else pid
    try:
        names = os.listdir(proc)
    except OSError:
        return None
    total = 0.0
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we read
        if int(fields[1]) == pid:  # fields after "(comm)": state, ppid, ..., utime (12), stime (13)
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def wait_children_idle(*, timeout: float = 5.0, poll: float = 0.1, busy: float = 0.1,
                       read=children_cpu_s, clock=time.monotonic, sleep=time.sleep) -> dict:
    """Wait until the children use under `busy` of a core for two polls in a row, at most `timeout` s.

    Returns {"idle": bool, "waited_s": float}; {"idle": None, ...} when their CPU time cannot be read."""
    t0 = clock()
    last = read()
    if last is None:
        return {"idle": None, "waited_s": 0.0}
    quiet = 0
    while clock() - t0 < timeout:
        sleep(poll)
        now = read()
        if now is None:
            return {"idle": None, "waited_s": round(clock() - t0, 3)}
        quiet = quiet + 1 if now - last < busy * poll else 0
        last = now
        if quiet >= 2:
            return {"idle": True, "waited_s": round(clock() - t0, 3)}
    return {"idle": False, "waited_s": round(clock() - t0, 3)}


def quartiles(xs: list[float]) -> list[float]:
    """[first, third] quartile (inclusive method); one value gives [x, x]."""
    if len(xs) < 2:
        return [round(xs[0], 4)] * 2 if xs else [0.0, 0.0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [round(q[0], 4), round(q[2], 4)]
