"""Stateful parts in one list: what a training checkpoint holds, and how a resume puts each part back.

`Trainer.stateful` maps a name to an object with `state_dict()` and `load_state_dict(state)`
(Composer's `serialized_attributes` habit). A checkpoint holds each part's state under its
name (`collect_state`), next to a few keys that describe the run rather than belong to a part
(`RESERVED`: the format, the config, the switches in effect). A resume is one loop over the
parts (`restore_state`) plus policy:

- **A part the checkpoint lacks** (registered after the checkpoint was written) is an error
  naming the part and the fix, before anything is loaded; a part listed as `optional` gets
  `load_state_dict(None)` instead and starts afresh (the callbacks: each one that keeps state
  warns).
- **State for a part this run does not register** is left out, with a warning naming it.
- **Order.** Parts load in the order they were registered, except the RNG part, which loads
  last: nothing restored after it can draw from the generators it sets.

A part of your own joins the checkpoints and the resume by registering it, with no other
edit: `trainer.stateful["sampler_stats"] = obj`. Its state must be tensors and plain Python
values (checkpoints load with `torch.load(..., weights_only=True)`).

`attribute(owner, name)` is a part held in an attribute that may be replaced during the run
(the scheduler of an extended run, the precision after a switch trial): it reaches whatever
object the attribute holds when the state is read or written. `Part(state_dict, load_state_dict)`
makes a part of two functions, for state spread over plain attributes.

Example:
    >>> trainer.stateful["counter"] = counter          # any object with state_dict/load_state_dict
    >>> state = collect_state(trainer.stateful)        # {"model": {...}, ..., "counter": {...}}
    >>> restore_state(trainer.stateful, state, source="ckpt/step-00000100.pt")
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from torchspeed.train.state.checkpoint import CheckpointError, ResumeMismatchError
from torchspeed.train.trial.dynamo_deferred import deferred_dynamo

__all__ = ["Stateful", "Part", "attribute", "collect_state", "check_parts", "restore_state", "RESERVED", "MissingPartError"]

log = logging.getLogger("torchspeed")

# Top-level keys that describe the run, not a part: no part may take these names.
RESERVED = frozenset({"format", "config", "switches", "world_size", "train_model"})
_LAST = "rng"  # the RNG part loads after every other part


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class MissingPartError(CheckpointError, ValueError):
    """The checkpoint has no state for a part this run registers."""


class Part:
    """A part made of two functions: `state_dict()` returns its state, `load_state_dict(state)` puts it back."""

    def __init__(self, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]):
        self.state_dict, self.load_state_dict = state_dict, load_state_dict


def attribute(owner: object, name: str) -> Part:
    """The part `owner.<name>` holds at the time of the call (None: no state, and nothing to load into)."""
    def state():
        obj = getattr(owner, name)
        return None if obj is None else obj.state_dict()

    def load(state) -> None:
        obj = getattr(owner, name)
        if obj is not None and state is not None:
            obj.load_state_dict(state)
    return Part(state, load)


def collect_state(parts: Mapping[str, Stateful], *, skip: Iterable[str] = ()) -> dict:
    """{name: part.state_dict()} for every part but those in `skip` (their name is kept, with None)."""
    bad = sorted(RESERVED & set(parts))
    if bad:
        raise ValueError(f"stateful part name(s) {bad} are reserved for the checkpoint's own keys "
                         f"({sorted(RESERVED)}): register the part under another name")
    skip = set(skip)
    with deferred_dynamo():  # an optimizer's state_dict without importing torch._dynamo (1-2 s) where none is
        return {name: None if name in skip else part.state_dict() for name, part in parts.items()}


def check_parts(parts: Mapping[str, Stateful], state: Mapping, *, source: object, skip: Iterable[str] = (),
                optional: Iterable[str] = ()) -> list[str]:
    """Raise `MissingPartError` if `state` lacks a part that is neither skipped nor optional; return the
    optional parts it lacks. Call it before changing anything, so a resume that cannot work changes nothing."""
    missing = [n for n in parts if n not in state and n not in set(skip)]
    required = [n for n in missing if n not in set(optional)]
    if required:
        raise MissingPartError(
            f"{source} has no state for part(s) {required} registered in trainer.stateful: it was written by a run "
            "without them. Resume from a checkpoint of a run with the same parts, or remove them from "
            "trainer.stateful before fit to resume without them, or start a new checkpoint_dir")
    return missing


def restore_state(parts: Mapping[str, Stateful], state: Mapping, *, source: object, skip: Iterable[str] = (),
                  optional: Iterable[str] = ()) -> None:
    """Load each part from `state[name]` (RNG last); see the module docstring for the policy.

    `skip`: parts restored another way (sharded weights from their DCP folder) or not at all (the schedule
    of an extended run). `optional`: parts that may be missing from `state` (they start afresh)."""
    skip = set(skip)
    for name in check_parts(parts, state, source=source, skip=skip, optional=optional):
        parts[name].load_state_dict(None)  # an optional part told it has no state starts afresh
    extra = sorted(k for k in state if k not in parts and k not in RESERVED)
    if extra:
        log.warning("resume: %s holds state for part(s) %s that this run does not register; left out", source, extra)
    order = sorted((n for n in parts if n in state and n not in skip), key=lambda n: n == _LAST)
    with deferred_dynamo():  # the optimizer's load_state_dict too (collect_state)
        for name in order:
            try:
                parts[name].load_state_dict(state[name])
            except CheckpointError:
                raise
            except (ValueError, KeyError) as e:  # torch's bare "different number of parameter groups", a missing key
                raise ResumeMismatchError(
                    f"{source}: its {name!r} state does not fit this run's ({type(e).__name__}: {e}). It was written "
                    f"by a run set up otherwise (the optimizer's parameter groups, say: optimizer='adamw' splits off "
                    "the biases and norms, torch.optim.AdamW(model.parameters()) does not). Resume with the run's own "
                    "settings, or start a new checkpoint_dir from its weights (load_checkpoint)") from e
