"""One file per rule. `discover()` imports every module in this folder (and in any folder appended to
`__path__`); a module whose name does not start with `_` must register at least one rule with
`torchspeed.doctor.registry.register`, or loading fails naming the file. There is no list to edit.
"""

from __future__ import annotations

import importlib
import pkgutil

__all__ = ["discover"]


def discover() -> list[str]:
    """Import every rule module; return their names. Raises RuleError for a file that registers nothing."""
    from torchspeed.doctor.registry import RULES, RuleError

    names = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        name = f"{__name__}.{info.name}"
        importlib.import_module(name)
        if not any(r.module == name for r in RULES.values()):
            raise RuleError(f"{info.name}.py in the doctor's rules folder registers no rule: decorate its check "
                            "with @register(rule_id, priority=..., techniques=..., summary=...) or rename it "
                            f"_{info.name}.py if it is a helper")
        names.append(name)
    return names
