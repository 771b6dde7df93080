"""Random-number state and deterministic mode: what an exact resume needs besides the weights.

A run that resumes from a checkpoint continues bit for bit only if every random stream is
where it was when the checkpoint was written: torch's CPU generator (dropout, shuffling,
augmentation), each CUDA device's generator, numpy's and Python's global generators.
`capture_rng_state()` reads all four into a dict that `torch.load(..., weights_only=True)`
accepts (numpy's key array is stored as a tensor, not a pickled ndarray);
`restore_rng_state()` puts them back. A DataLoader or sampler with a `generator` of its own
draws its order from that one instead: `generator_states()` reads such generators (by name,
as uint8 tensors) and `set_generator_states()` puts them back (sampler.py's `DataPosition`
keeps them in the checkpoint's data position).

`enable_determinism()` is the "same inputs, same bits" switch: deterministic kernels
(`torch.use_deterministic_algorithms(True)`), no cuDNN autotuning (T22 off: its choice of
algorithm can differ run to run) and the cuBLAS workspace setting CUDA needs for
deterministic matrix products. It costs speed (some kernels have slower deterministic
versions, and a few raise an error instead), so the fast loop leaves it off unless
`TrainConfig(deterministic=True)`.

Example:
    >>> seed_everything(0)
    >>> state = capture_rng_state()
    >>> a = torch.rand(3)
    >>> restore_rng_state(state)
    >>> torch.equal(a, torch.rand(3))
    True
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state", "generator_states", "set_generator_states", "seed_everything",
           "enable_determinism"]

log = logging.getLogger("torchspeed")


def capture_rng_state() -> dict:
    """The state of the torch (CPU and every CUDA device), numpy and Python generators."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": _to_lists(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Put back a state from `capture_rng_state` (CUDA states only if the device count matches)."""
    torch.set_rng_state(state["torch"].cpu())
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])


def generator_states(generators: Mapping[str, torch.Generator]) -> dict[str, torch.Tensor]:
    """{name: state} of each generator, as uint8 CPU tensors (a `weights_only` load reads them)."""
    return {name: g.get_state().clone() for name, g in generators.items()}


def set_generator_states(generators: Mapping[str, torch.Generator], states: Mapping | None) -> None:
    """Put back states from `generator_states` by name; a generator without a saved state is left as it is,
    and one whose saved state does not fit (another kind of generator) is left with a warning."""
    for name, g in generators.items():
        state = (states or {}).get(name)
        if state is None:
            continue
        try:
            g.set_state(state.cpu())
        except RuntimeError as e:
            log.warning("resume: the saved state of the %s's generator does not fit it (%s); it continues from "
                        "its own state, so the data order is not the interrupted run's", name, e)


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy and Python's `random` with one number."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def enable_determinism(*, warn_only: bool = False) -> None:
    """Deterministic kernels, cuDNN autotuning off, cuBLAS workspace pinned (costs speed)."""
    # cuBLAS needs a fixed workspace for reproducible GEMMs; it reads this when it initialises.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def _to_lists(x):
    # weights_only loading accepts tuples, but keep Python's state plain and explicit.
    return [x[0], list(x[1]), x[2]]
