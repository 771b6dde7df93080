"""Where a call comes from, as the doctor's probe sees it: user code or a library, the `file:line` of the user's
call, and `torch.tensor` calls on numpy data counted from user code (T03: a copy where `torch.from_numpy` shares).

Example:
    >>> copies = new_copy_counts()
    >>> torch.tensor = count_tensor_copies(copies, torch.tensor)   # the probe patches it, and restores it
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import time
from collections import defaultdict

import torch

__all__ = ["is_user_file", "user_site", "count_tensor_copies", "new_copy_counts"]


def _lib_prefixes() -> tuple[str, ...]:
    paths = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            paths.add(os.path.realpath(p))
    paths.add(os.path.dirname(os.path.realpath(torch.__file__)))
    paths.add(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # torchspeed itself
    for p in sys.path:
        if p and ("site-packages" in p or "dist-packages" in p):
            paths.add(os.path.realpath(p))
    return tuple(sorted(paths))


_LIBS = _lib_prefixes()


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return False
    return not os.path.realpath(filename).startswith(_LIBS)


def user_site(depth: int = 2) -> str | None:
    """'file:line' of the calling user frame, or None when the caller is library code."""
    f = sys._getframe(depth)
    if is_user_file(f.f_code.co_filename):
        return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"
    return None


def new_copy_counts() -> dict:
    return {"count": 0, "ms": 0.0, "bytes": 0, "float64": 0, "sites": defaultdict(int)}


def count_tensor_copies(copies: dict, orig):
    """`torch.tensor` that counts calls from user code on numpy data (an array, a list of arrays, a numpy
    scalar) into `copies` (`new_copy_counts()`): calls, time, bytes, float64 sources, sites."""
    @functools.wraps(orig)
    def tensor(data, *a, **k):
        import numpy as np
        first = data[0] if isinstance(data, (list, tuple)) and data else None
        if isinstance(data, (np.ndarray, np.generic)) or isinstance(first, np.ndarray):
            site = user_site()
            if site:
                t0 = time.perf_counter()
                out = orig(data, *a, **k)
                copies["count"] += 1
                copies["ms"] += (time.perf_counter() - t0) * 1e3
                copies["bytes"] += out.numel() * out.element_size()
                copies["float64"] += int(getattr(first if first is not None else data, "dtype", None) == np.float64)
                copies["sites"][site] += 1
                return out
        return orig(data, *a, **k)
    return tensor
