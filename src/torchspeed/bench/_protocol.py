"""How the bench's worker processes answer their parents: `PREFIX`, `reply` (the worker's side: one JSON object per
line on stdout after `PREFIX`, so whatever else a library prints there is ignored) and `read_reply` (the parent's
side: the answer on a line, or the failure it reports raised).

The workers: bench/_worker.py (a throughput row, started by bench/config_process.py) and
bench/time_to_target_worker.py (a time-to-target run, started by bench/time_to_target.py). Both sides import this
module, so a parent reads its workers' answers without importing a worker's module.
"""

from __future__ import annotations

import json
import sys

__all__ = ["PREFIX", "reply", "read_reply"]

PREFIX = "@@torchspeed "


def reply(obj) -> None:
    """Write one answer on stdout (values JSON cannot hold as their `str`)."""
    sys.stdout.write(PREFIX + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def read_reply(line: str, what: str) -> dict | None:
    """The answer on `line` (None: the line is not one); RuntimeError naming `what` when the answer is a failure."""
    if not line.startswith(PREFIX):
        return None
    answer = json.loads(line[len(PREFIX):])
    if not answer.get("ok"):
        raise RuntimeError(f"{what} failed: {answer.get('error')}\n{answer.get('traceback', '')}")
    return answer
