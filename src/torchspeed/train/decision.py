"""`Decision`: one automatic choice, its reason and what was measured (T01, T18, T21-T23, T25).

Every automatic switch of the loop (precision, channels_last, fused optimizer kernels,
compile, thread count, allocator settings, ...) records a `Decision(value, reason,
measured)` in `FitResult.decisions`, the progress header and metrics.json, so a reader sees
what was switched on, why, and the numbers behind it.

`TrialCache` keeps measured decisions in a small JSON file per (model signature, input shape,
machine, torch version), so a second run of the same model on the same machine does not pay
the trial again. Its folder is `$TORCHSPEED_CACHE_DIR`, else `$XDG_CACHE_HOME/torchspeed`,
else `~/.cache/torchspeed`; delete the file to measure afresh.

Example:
    >>> d = Decision("bf16", "measured 1.31x faster than fp32", {"fp32": 0.081, "bf16": 0.062})
    >>> str(d)
    'bf16 (measured 1.31x faster than fp32)'
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from torchspeed._io import write_json

__all__ = ["Decision", "Decisions", "DecisionConflict", "TrialCache", "cache_dir"]

log = logging.getLogger("torchspeed")
_WARNED: set = set()  # one warning per damaged file and process


class Decision(dict):
    """An automatic choice: its `value`, the `reason` in words, and what was `measured` (None: a rule).

    A dict underneath ({"value", "reason"[, "measured"]}), so `json.dump(result.decisions)` works as
    it is; the attributes read the same keys."""

    def __init__(self, value: object, reason: str = "", measured: dict | None = None):
        super().__init__(value=value, reason=reason)
        if measured is not None:
            self["measured"] = measured

    value = property(lambda self: self["value"])
    reason = property(lambda self: self["reason"])
    measured = property(lambda self: self.get("measured"))
    refines = property(lambda self: self.get("refines"))  # the Decision this one refined (`Decisions.refine`)

    def __str__(self) -> str:
        return f"{self.value} ({self.reason})" if self.reason else str(self.value)

    def __repr__(self) -> str:
        return f"Decision({self.value!r}, {self.reason!r}{', measured=...' if 'measured' in self else ''})"

    def to_dict(self) -> dict:
        return dict(self)


class DecisionConflict(KeyError):
    """A second writer to a decided key: a later stage refines the key (`Decisions.refine`), it does not overwrite."""

    def __str__(self) -> str:  # KeyError quotes its message
        return str(self.args[0])


class Decisions(dict):
    """The run's decisions, `{key: Decision}`, each key written once.

    `d[key] = Decision(...)` decides a key; a second write raises `DecisionConflict`, so two modules
    cannot both decide one value and the last writer silently win. A stage that knows more later (the
    switch trial measuring what the rule assumed, the LR measured in the run) calls
    `refine(key, decision)`: the new Decision keeps the earlier value and reason under "refines".
    Values that are not a `Decision` raise `TypeError` (nothing is wrapped after the fact). `planned` is True for
    the decisions of a plan (`plan.make_plan`): a Trainer given them applies them and decides nothing itself.

    Example:
        >>> d = Decisions(); d["lr"] = Decision(0.1, "prior")
        >>> d.refine("lr", Decision(0.4, "measured")).refines
        {'value': 0.1, 'reason': 'prior'}
    """

    planned = False  # set on the plan's own (make_plan): the Trainer applies them, and decides nothing

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.update(*args, **kwargs)

    def __setitem__(self, key: str, value: Decision) -> None:
        if not isinstance(value, Decision):
            raise TypeError(f"decisions[{key!r}] must be a Decision(value, reason), got {type(value).__name__}")
        if key in self:
            raise DecisionConflict(f"decisions[{key!r}] is already decided ({self[key]}); a later stage refines it "
                                   f"with decisions.refine({key!r}, Decision(...)) instead of writing it again")
        super().__setitem__(key, value)

    def update(self, *args, **kwargs) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def __ior__(self, other):
        self.update(other)
        return self

    def setdefault(self, key: str, default: Decision) -> Decision:
        if key not in self:
            self[key] = default
        return self[key]

    def refine(self, key: str, decision: Decision) -> Decision:
        """Replace the Decision at `key` with `decision`, which keeps the earlier one (value, reason, and what that
        refined) under "refines". A key not decided yet is simply decided."""
        if not isinstance(decision, Decision):
            raise TypeError(f"decisions.refine({key!r}, ...) takes a Decision, got {type(decision).__name__}")
        before = self.get(key)
        if before is not None and before is not decision:
            decision = Decision(decision.value, decision.reason, decision.measured)
            decision["refines"] = {k: v for k, v in before.items() if k != "measured"}
        super().__setitem__(key, decision)
        return decision

    def copy(self) -> "Decisions":
        out = Decisions()
        dict.update(out, self)  # (each key is decided once here already)
        return out


def cache_dir() -> Path:
    """Where measured decisions are cached (see the module docstring)."""
    if os.environ.get("TORCHSPEED_CACHE_DIR"):
        return Path(os.environ["TORCHSPEED_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torchspeed"


class TrialCache:
    """A JSON file of {key: measured result}. Reads never fail (a damaged file is an empty cache);
    writes are atomic (`_io.write_json`), so two processes at worst measure twice."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else cache_dir() / "trials.json"

    @staticmethod
    def key(parts: dict) -> str:
        blob = json.dumps(parts, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def _load(self) -> dict:
        try:
            text = self.path.read_text()
        except OSError:  # no cache yet (or unreadable): measure
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return data
        except ValueError as e:  # half-written by a killed run, or edited by hand: never stops a run
            if self.path not in _WARNED:
                _WARNED.add(self.path)
                log.warning("torchspeed: the decision cache %s is damaged (%s) and was ignored; it is rewritten "
                            "when this run caches", self.path, str(e).splitlines()[0][:80])
            return {}

    def get(self, key: str) -> dict | None:
        return self._load().get(key)

    def merge(self, key: str, parts: dict) -> None:
        """Add `parts` to the entry at `key` (kept: the parts an earlier writer put there)."""
        self.put(key, (self.get(key) or {}) | parts)

    def put(self, key: str, value: dict) -> None:
        data = self._load()
        data[key] = value
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.path, data)
        except OSError:  # a read-only home: measure again next time, never fail the run
            pass
