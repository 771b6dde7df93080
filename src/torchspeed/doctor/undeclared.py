"""Keys an observation holds that its schema (`observation`) does not declare (T02): the check the tests run on
every gallery script's observation, so the probe cannot write a key no rule's reader knows of.
"""

from __future__ import annotations

import types
import typing

from torchspeed.doctor.observation import Observation

__all__ = ["undeclared_keys"]


def _typed_dict(tp) -> type | None:
    return tp if isinstance(tp, type) and typing.is_typeddict(tp) else None


def _unwrap(tp):
    """`X | None` -> X: the schema of a value that may be None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def undeclared_keys(obs: dict, schema: type = Observation, prefix: str = "") -> list[str]:
    """Keys in `obs` the schema does not declare: recursively through nested TypedDicts, lists of them,
    maps of them keyed by a name (`verify`, `env_fixes`) and optional ones (`X | None`)."""
    hints = typing.get_type_hints(schema)
    out = []
    for k, v in obs.items():
        if k not in hints:
            out.append(prefix + k)
            continue
        out += _undeclared_in(hints[k], v, prefix + k)
    return out


def _undeclared_in(tp, v, path: str) -> list[str]:
    tp = _unwrap(tp)
    if _typed_dict(tp) is not None:
        return undeclared_keys(v, tp, path + ".") if isinstance(v, dict) else []
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and args and isinstance(v, list):
        return [k for i, item in enumerate(v) for k in _undeclared_in(args[0], item, f"{path}[{i}]")]
    if origin is dict and len(args) == 2 and isinstance(v, dict):
        return [k for name, item in v.items() for k in _undeclared_in(args[1], item, f"{path}[{name!r}]")]
    return []
