"""`CachedDataset` (T10): keep samples in RAM up to a byte budget, shared by all DataLoader workers.

What it does: wraps any map-style dataset. The first time item i is loaded it is stored in
a shared-memory pool; later reads (from any worker, in any epoch) copy it out instead of
reading and decoding the file again. The pool never holds more than `budget_bytes`: when
full, the least recently used items are evicted. It stores either the *decoded* sample
(`mode="decoded"`: skips decoding, the big win on a decode-bound dataset) or, for
`FastImageFolder`/`PackedDataset`, the *encoded* file bytes (`mode="encoded"`: ~10x more
images per byte, still decodes every time, helps when storage is slow).

The pool is one shared-memory arena split in fixed-size pages plus small shared tables
(page chains, last use, hit/miss counters) under one lock, created in the main process and
inherited (fork) or passed (spawn) to the workers, so N workers share one copy instead of
each caching its own.

When it helps: datasets that fit (or mostly fit) in RAM and are read many epochs; it turns
epoch 2+ from decode-bound to memcpy-bound. Cost: `budget_bytes` of shared memory (/dev/shm
must be that large, e.g. `docker --shm-size`), and a lock taken per item (microseconds).
Only cache *deterministic* items: random crops must run after the cache (`transform=`) or on
the device (`DeviceAugment`), or every epoch would see epoch 1's crops.

Example:
    >>> base = FastImageFolder("train/", size=256, crop="center")    # deterministic
    >>> ds = CachedDataset(base, budget_bytes=8 << 30)
    >>> loader = DataLoader(ds, batch_size=256, num_workers=8, collate_fn=uint8_collate)
    >>> ds.stats()   # CacheStats(hits=..., misses=..., bytes_used=..., budget_bytes=...)
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import pickle
import struct
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["CachedDataset", "CacheStats", "SharedLRUPool"]

_BIG = np.iinfo(np.int64).max


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    items: int
    bytes_used: int       # payload bytes of the cached items
    bytes_reserved: int   # pages in use (payload + page rounding), always <= budget_bytes
    budget_bytes: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


class SharedLRUPool:
    """A byte-budgeted LRU map from integer keys (0..n_keys-1) to byte strings, in shared memory."""

    def __init__(self, n_keys: int, budget_bytes: int, *, page_size: int = 16384):
        if budget_bytes < page_size:
            raise ValueError(f"budget_bytes={budget_bytes} is smaller than one page ({page_size} bytes)")
        self.page_size = page_size
        self.n_pages = budget_bytes // page_size
        self.budget_bytes = budget_bytes
        self.n_keys = n_keys
        # The arena is created directly in shared memory: its pages are committed only when written
        # (a budget larger than the dataset costs nothing), and never copied from private memory.
        arena = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(self.n_pages * page_size))
        self._t = {
            "arena": arena,
            "first": torch.full((n_keys,), -1, dtype=torch.int64),     # first page, -1 = not cached
            "nbytes": torch.zeros(n_keys, dtype=torch.int64),
            "last": torch.zeros(n_keys, dtype=torch.int64),            # LRU clock of last use
            "next": torch.full((self.n_pages,), -1, dtype=torch.int64),  # page chains
            "free": torch.arange(self.n_pages, dtype=torch.int64),     # stack of free pages
            # free_top, clock, hits, misses, items, bytes_used, evictions
            "state": torch.zeros(7, dtype=torch.int64),
        }
        for t in self._t.values():
            t.share_memory_()  # a no-op for the arena
        self._t["state"][0] = self.n_pages
        # A lock made in the spawn context pickles into spawn/forkserver workers and is inherited by
        # fork workers; one made in the fork context would refuse to go to spawned workers.
        self.lock = mp.get_context("spawn").Lock()
        self._v = None

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_v"] = None  # numpy views are rebuilt in each process
        return d

    def _views(self) -> dict:
        if self._v is None:
            self._v = {k: t.numpy() for k, t in self._t.items()}
        return self._v

    def get(self, key: int) -> np.ndarray | None:
        v = self._views()
        st = v["state"]
        with self.lock:
            p = int(v["first"][key])
            if p < 0:
                st[3] += 1
                return None
            st[2] += 1
            st[1] += 1
            v["last"][key] = st[1]
            n = int(v["nbytes"][key])
            out = np.empty(n, dtype=np.uint8)
            arena, nxt, ps = v["arena"], v["next"], self.page_size
            pos = 0
            while pos < n:
                k = min(ps, n - pos)
                out[pos:pos + k] = arena[p * ps:p * ps + k]
                pos += k
                p = int(nxt[p])
        return out

    def put(self, key: int, data) -> bool:
        """Store `data` under `key`, evicting least recently used items; False if it can never fit."""
        buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
        n, ps = buf.size, self.page_size
        need = max(1, -(-n // ps))
        if need > self.n_pages:
            return False
        v = self._views()
        st, first, last, nxt, free, arena = v["state"], v["first"], v["last"], v["next"], v["free"], v["arena"]
        with self.lock:
            if first[key] >= 0:  # another worker cached it meanwhile
                return True
            while st[0] < need:
                self._evict_some(v, need - int(st[0]))
            top = int(st[0])
            pages = free[top - need:top].copy()
            st[0] = top - need
            for j, p in enumerate(pages):
                k = min(ps, n - j * ps)
                if k > 0:
                    arena[p * ps:p * ps + k] = buf[j * ps:j * ps + k]
                nxt[p] = pages[j + 1] if j + 1 < need else -1
            first[key] = pages[0]
            v["nbytes"][key] = n
            st[1] += 1
            last[key] = st[1]
            st[4] += 1
            st[5] += n
        return True

    def _evict_some(self, v: dict, pages_needed: int) -> None:
        # Called with the lock held. O(n_keys) per call, so evict a few of the oldest at once.
        first, last = v["first"], v["last"]
        age = np.where(first >= 0, last, _BIG)
        k = min(int(v["state"][4]), max(8, pages_needed))
        victims = np.argpartition(age, k - 1)[:k] if k < age.size else np.arange(age.size)
        victims = victims[np.argsort(age[victims])]
        freed = 0
        for key in victims:
            if first[key] < 0 or freed >= pages_needed:
                break
            freed += self._drop(v, int(key))

    def _drop(self, v: dict, key: int) -> int:
        st, free, nxt = v["state"], v["free"], v["next"]
        p, count = int(v["first"][key]), 0
        while p >= 0:
            free[st[0]] = p
            st[0] += 1
            p_next = int(nxt[p])
            nxt[p] = -1
            p = p_next
            count += 1
        v["first"][key] = -1
        st[4] -= 1
        st[5] -= v["nbytes"][key]
        st[6] += 1
        v["nbytes"][key] = 0
        return count

    def stats(self) -> CacheStats:
        st = self._views()["state"]
        with self.lock:
            free_top, _, hits, misses, items, used, ev = (int(x) for x in st)
        return CacheStats(hits=hits, misses=misses, items=items, bytes_used=used,
                          bytes_reserved=(self.n_pages - free_top) * self.page_size, budget_bytes=self.budget_bytes,
                          evictions=ev)

    def reset_counters(self) -> None:
        st = self._views()["state"]
        with self.lock:
            st[2] = st[3] = st[6] = 0


# ---------------------------------------------------------------------- sample <-> bytes
def _dumps(sample) -> bytes:
    """Serialize a sample; tensors and arrays go out of band as raw bytes (their memory order kept)."""
    arrays: list[np.ndarray] = []

    def strip(obj):
        if isinstance(obj, torch.Tensor):
            # Keep the memory layout: store the strides-sorted (contiguous) view plus the permutation.
            perm = sorted(range(obj.dim()), key=lambda d: -obj.stride(d))
            base = obj.permute(perm).contiguous()
            arrays.append(base.numpy())
            return ("__tensor__", len(arrays) - 1, perm)
        if isinstance(obj, np.ndarray):
            arrays.append(np.ascontiguousarray(obj))
            return ("__ndarray__", len(arrays) - 1, None)
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(strip(o) for o in obj)
        if isinstance(obj, list):
            return [strip(o) for o in obj]
        if isinstance(obj, dict):
            return {k: strip(o) for k, o in obj.items()}
        return obj

    skeleton = strip(sample)
    meta = [(a.dtype.str, a.shape) for a in arrays]
    head = pickle.dumps((skeleton, meta), protocol=pickle.HIGHEST_PROTOCOL)
    return b"".join([struct.pack("<Q", len(head)), head, *(a.tobytes() for a in arrays)])


def _loads(buf: np.ndarray):
    (hlen,) = struct.unpack("<Q", buf[:8].tobytes())
    skeleton, meta = pickle.loads(buf[8:8 + hlen].tobytes())
    arrays, pos = [], 8 + hlen
    for dt, shape in meta:
        dtype = np.dtype(dt)
        n = int(np.prod(shape)) * dtype.itemsize
        arrays.append(buf[pos:pos + n].view(dtype).reshape(shape))
        pos += n

    def fill(obj):
        if isinstance(obj, tuple) and len(obj) == 3 and obj[0] in ("__tensor__", "__ndarray__"):
            a = arrays[obj[1]]
            if obj[0] == "__ndarray__":
                return a
            inv = sorted(range(len(obj[2])), key=lambda d: obj[2][d])
            return torch.from_numpy(a).permute(inv)  # T11: no copy
        if isinstance(obj, tuple):
            return tuple(fill(o) for o in obj)
        if isinstance(obj, list):
            return [fill(o) for o in obj]
        if isinstance(obj, dict):
            return {k: fill(o) for k, o in obj.items()}
        return obj

    return fill(skeleton)


class CachedDataset(Dataset):
    """Wrap `dataset`; cache its items (or, `mode="encoded"`, its files' bytes) in shared RAM.

    Options (keyword-only): `budget_bytes` (the pool's size; items beyond it are evicted, least
    recently used first), `mode` ("decoded" | "encoded"), `transform` (applied to the image of
    each (image, label) item *after* the cache: put random augmentation here), `page_size`.

    Example:
        >>> ds = CachedDataset(FastImageFolder(root, size=256, crop="center"), budget_bytes=2 << 30)
    """

    def __init__(self, dataset: Dataset, *, budget_bytes: int, mode: str = "decoded", transform=None,
                 page_size: int = 16384):
        if mode not in ("decoded", "encoded"):
            raise ValueError(f"mode must be 'decoded' or 'encoded', got {mode!r}")
        self.mode, self.transform = mode, transform
        self.pool = SharedLRUPool(len(dataset), budget_bytes, page_size=page_size)  # type: ignore[arg-type]
        if mode == "encoded":
            if not hasattr(dataset, "read"):
                raise TypeError("mode='encoded' needs a dataset with read(i) -> bytes (FastImageFolder, "
                                "PackedDataset); use mode='decoded' for other datasets")
            dataset = copy.copy(dataset)
            dataset.read = _CachedRead(dataset.read, self.pool)  # type: ignore[attr-defined]
        elif getattr(dataset, "deterministic", True) is False:
            raise ValueError("this dataset returns random crops/flips, so caching its items would freeze "
                             "epoch 1's augmentation: build it with crop='center' (or None) and flip=False and "
                             "augment after the cache (transform=..., or DeviceAugment on the device)")
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name):  # classes, targets, samples, summary() ... of the wrapped dataset
        if name in ("dataset", "pool", "mode", "transform"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, i: int):
        if self.mode == "encoded":
            item = self.dataset[i]
        else:
            buf = self.pool.get(i)
            if buf is not None:
                item = _loads(buf)
            else:
                item = self.dataset[i]
                self.pool.put(i, _dumps(item))
        if self.transform is not None:
            item = (self.transform(item[0]), *item[1:])
        return item

    def stats(self) -> CacheStats:
        return self.pool.stats()


class _CachedRead:
    def __init__(self, read, pool: SharedLRUPool):
        self.read, self.pool = read, pool

    def __call__(self, i: int):
        buf = self.pool.get(i)
        if buf is not None:
            return buf
        data = self.read(i)
        self.pool.put(i, data)
        return data
