"""Which malloc this machine offers and this process runs (T01's allocator facts): `find_tcmalloc` looks for a
tcmalloc library by file name in the library folders (`TCMALLOC_DIRS`, their multiarch folders, the Python
environment's and LD_LIBRARY_PATH's), and `allocator_in_use` reads the one this process was started with.

`env.detect` reports both; the bench's processes and the backends' decision read them too.
"""

from __future__ import annotations

import os
import sys

__all__ = ["TCMALLOC_DIRS", "find_tcmalloc", "allocator_in_use"]

TCMALLOC_DIRS = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/lib")  # and their multiarch folders (x86_64-linux-gnu)


def _multiarch(base: str) -> list[str]:
    try:
        return [e.path for e in os.scandir(base) if "-linux-" in e.name and e.is_dir()]
    except OSError:
        return []

def find_tcmalloc() -> str | None:
    """Path of a tcmalloc shared library on this machine, or None.

    On Debian/Ubuntu: `apt-get install libtcmalloc-minimal4`. Looked for in the system's library folders, the
    Python environment's own (a conda env's gperftools) and those on LD_LIBRARY_PATH, by file name only:
    `ctypes.util.find_library` would start `ldconfig` and `gcc` processes, 35-50 ms of every `fit`'s first call.
    """
    dirs = [d for base in TCMALLOC_DIRS for d in [base] + _multiarch(base)]
    dirs += [os.path.join(sys.prefix, "lib")] + [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for d in dict.fromkeys(dirs):
        try:
            names = sorted(n for n in os.listdir(d) if n.startswith("libtcmalloc") and ".so" in n)
        except OSError:
            continue
        if names:  # libtcmalloc_minimal before libtcmalloc.so, as the patterns used to rank them
            return os.path.join(d, min(names, key=lambda n: ("minimal" not in n, n)))
    return None

def allocator_in_use() -> str:
    """'tcmalloc', 'jemalloc' or 'glibc': which malloc this process was started with."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            maps = f.read()
    except OSError:
        return "unknown"
    if "tcmalloc" in maps:
        return "tcmalloc"
    if "jemalloc" in maps:
        return "jemalloc"
    return "glibc (tuned)" if os.environ.get("MALLOC_MMAP_THRESHOLD_") else "glibc"
