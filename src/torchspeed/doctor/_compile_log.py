"""Graph breaks and recompiles of `torch.compile` in the user's script (T25), with reasons and lines.

While the probe runs, Dynamo's `graph_breaks` and `recompiles` log artifacts are switched on and
their records are collected here instead of being printed. Each record names the user's file and
line (a graph break: "Graph break in user code at train.py:42" and its reason; a recompile: the
function, its line and the guard that failed). On exit the logging settings are reset from
`TORCH_LOGS`, as at start-up.
"""

from __future__ import annotations

import logging
import os
import re

__all__ = ["CompileLog"]

_LOGGERS = {"graph_break": "torch._dynamo.symbolic_convert.__graph_breaks",
            "recompile": "torch._dynamo.guards.__recompiles"}
_AT = re.compile(r"in user code at (\S+):(\d+)")
_FN = re.compile(r"Recompiling function (\S+) in (\S+):(\d+)")


def parse_record(kind: str, message: str) -> dict:
    """{kind, site ('file.py:line'), reason} from one Dynamo log message ({} when it is the probe's own)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if kind == "graph_break":
        m = _AT.search(message)
        site = f"{os.path.basename(m.group(1))}:{m.group(2)}" if m else "?"
        reason = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Graph Break Reason:")), "")
        detail = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Explanation:")), "")
        return {"kind": kind, "site": site, "reason": (reason + (f" ({detail})" if detail else ""))[:300]}
    m = _FN.search(message)
    site = f"{os.path.basename(m.group(2))}:{m.group(3)}" if m else "?"
    guards = [ln.lstrip("- ").split("#")[0].strip() for ln in lines if ln.startswith("- ") and "/" in ln[:8]]
    # guards on global module hooks are the doctor's own probe (its hooks are traced too): not the script's
    guards = [g for g in guards if "_global_forward" not in g and "_global_backward" not in g]
    if not guards:
        return {}
    fn = m.group(1) if m else "?"
    return {"kind": kind, "site": site, "reason": (f"{fn}: " + "; ".join(guards))[:300]}


class CompileLog(logging.Handler):
    """Collects Dynamo's graph-break and recompile records while installed (a context manager)."""

    def __init__(self, limit: int = 50):
        super().__init__(level=logging.DEBUG)
        self.records: list[dict] = []
        self.limit = limit
        self._saved: list[tuple[logging.Logger, bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) >= self.limit:
            return
        kind = next((k for k, name in _LOGGERS.items() if record.name == name), None)
        if kind is not None:
            try:
                rec = parse_record(kind, record.getMessage())
            except Exception:  # a message in a format we do not know: keep the rest
                return
            if rec:
                self.records.append(rec)

    def __enter__(self):
        try:
            import torch._logging
            torch._logging.set_logs(graph_breaks=True, recompiles=True)
        except Exception:
            return self
        for name in _LOGGERS.values():
            lg = logging.getLogger(name)
            self._saved.append((lg, lg.propagate))
            lg.addHandler(self)
            lg.propagate = False  # collected here, not printed into the script's output
        return self

    def __exit__(self, *exc):
        for lg, propagate in self._saved:
            lg.removeHandler(self)
            lg.propagate = propagate
        if self._saved:
            import torch._logging._internal as internal
            internal._init_logs()
        self._saved.clear()
        return False
