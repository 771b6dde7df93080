"""Data already in memory is batched by slicing, not collated per sample (T10, T11).

A `DataLoader(TensorDataset(x, y), batch_size=100, shuffle=True)` calls `TensorDataset.__getitem__`
100 times a batch and stacks 100 one-sample tensors per field (`default_collate`). For a small
model whose step takes 1-3 ms that is 15-25% of the step. The same batch is `x[idx], y[idx]`: one
index per field. `sliced_loader` serves a plain DataLoader over a `TensorDataset` (or a `Subset`
of one, as `random_split` makes) that way:

- **the same batches, in the same order, from the same RNG**: the loader's own batch sampler
  gives the indices (its shuffling, `drop_last`, a `DistributedSampler` or `ResumableSampler`
  inside), and each pass draws the one number a DataLoader iterator draws from the loader's
  generator before its first batch, so the run after it sees the same random stream;
- the same batch type as `default_collate` (a list of tensors, one per field; a dict of them for dict samples);
- on CUDA the tensors move to the device once when they take at most `DEVICE_SHARE` of its free
  memory (then a batch is an index on the device: no host copy per step); else they stay on the
  host and the trainer's prefetcher copies each batch.

A Dataset of your own is sliced too when its `__getitem__` is nothing but indexing its own tensors
(`return self.x[i], self.y[i]` or `return {"input_ids": self.ids[i], ...}`, optionally through local
names; numpy arrays count, read as tensors; a dict sample gives dict batches, as `default_collate` does):
`plain_fields` reads that from the method's source (never by calling it, so a random transform, a side effect
or a computed sample always keeps the per-sample path) and checks the first sample against the slices.
Anything else (a custom collate_fn or batch sampler, a dataset that computes or transforms its samples, an
IterableDataset, a stateful loader) is returned as it is. `Trainer.fit` applies it to the training and
validation loaders (`InMemory`) and records `decisions["batching"]`.

Example:
    >>> loader = sliced_loader(DataLoader(TensorDataset(x, y), batch_size=100, shuffle=True), torch.device("cpu"))
    >>> xb, yb = next(iter(loader))
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import (BatchSampler, DataLoader, RandomSampler, SequentialSampler, Subset, TensorDataset,
                              default_collate)

from torchspeed.train.decision import Decision

__all__ = ["SlicedLoader", "sliced_loader", "in_memory_tensors", "plain_fields", "keep_on_device", "InMemory",
           "DEVICE_SHARE"]

DEVICE_SHARE = 0.25  # tensors that take at most this share of the accelerator's free memory move there once


def in_memory_tensors(dataset) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None, tuple[str, ...] | None] | None:
    """(the tensors, the index map or None, the sample's dict keys or None) behind a TensorDataset, a dataset
    `plain_fields` reads, or a (nested) Subset of one; None otherwise."""
    index = None
    while isinstance(dataset, Subset):
        sub = torch.as_tensor(dataset.indices, dtype=torch.long)
        index = sub if index is None else sub[index]
        dataset = dataset.dataset
    if type(dataset) is TensorDataset and dataset.tensors:
        return tuple(dataset.tensors), index, None
    fields = plain_fields(dataset)
    if fields is None:
        return None
    return tuple(fields.values()), index, tuple(fields) if isinstance(fields, _Keyed) else None


def _indexed_attr(node: ast.expr, self_name: str, idx_name: str) -> str | None:
    """`A` when `node` is `self.A[idx]`, else None."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name) and node.slice.id == idx_name \
            and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name) \
            and node.value.value.id == self_name:
        return node.value.attr
    return None


def _returned_attrs(fn: ast.FunctionDef) -> tuple[list[str], list[str] | None] | None:
    """(the attributes `return self.a[i], self.b[i]` reads (through `x = self.a[i]` names too), None); for
    `return {"x": self.a[i], ...}`, (those attributes, the dict's keys); None for any other body."""
    args = fn.args
    if fn.decorator_list or len(args.args) != 2 or args.vararg or args.kwarg or args.kwonlyargs:
        return None
    self_name, idx_name = args.args[0].arg, args.args[1].arg
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    bound: dict[str, str] = {}
    for st in body[:-1]:
        attr = _indexed_attr(st.value, self_name, idx_name) if isinstance(st, ast.Assign) else None
        if attr is None or len(st.targets) != 1 or not isinstance(st.targets[0], ast.Name):
            return None
        bound[st.targets[0].id] = attr
    last = body[-1] if body else None
    value = last.value if isinstance(last, ast.Return) else None
    if isinstance(value, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                           for k in value.keys):
        keys, elts = [k.value for k in value.keys], value.values
    elif isinstance(value, (ast.Tuple, ast.List)):
        keys, elts = None, value.elts
    else:
        return None
    names = [bound.get(e.id) if isinstance(e, ast.Name) else _indexed_attr(e, self_name, idx_name) for e in elts]
    return None if None in names or not names else (names, keys)


def plain_fields(dataset) -> dict[str, torch.Tensor] | None:
    """{attribute: tensor} a map-style Dataset's `__getitem__` returns, in order, when the method is nothing but
    `return self.a[i], self.b[i]` over tensors (or numpy arrays) of the dataset's length, and its first sample is
    those slices; {key: tensor} (a `_Keyed`) when it returns `{"key": self.a[i], ...}`; None for any other
    dataset."""
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(type(dataset).__getitem__))).body[0]
        n = len(dataset)
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):  # no source, no len(): not ours to read
        return None
    read = _returned_attrs(fn) if isinstance(fn, ast.FunctionDef) and n > 0 else None
    own = getattr(dataset, "__dict__", {})
    if read is None or any(a not in own for a in read[0]):
        return None
    names, keys = read
    try:  # strings, objects, negative strides: numpy arrays torch cannot view, served per sample as before
        tensors = [torch.from_numpy(own[a]) if isinstance(own[a], np.ndarray) else own[a] for a in names]
    except (TypeError, ValueError, RuntimeError):
        return None
    if any(not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n for t in tensors):
        return None
    fields = dict(zip(keys or names, tensors))
    if len(fields) != len(tensors):  # one key twice: not a sample this reads back
        return None
    try:
        first = dataset[0]
        if keys is not None:  # a dict sample: these keys, in this order
            values = [first[k] for k in keys] if isinstance(first, dict) and list(first) == keys else []
        else:
            values = [] if isinstance(first, dict) else first
        same = len(values) == len(tensors) and all(
            torch.equal(torch.as_tensor(v), t[0]) and torch.as_tensor(v).dtype == t.dtype
            for v, t in zip(values, tensors))
    except Exception:  # noqa: BLE001 - a sample this check cannot compare: the per-sample path
        return None
    return (_Keyed(fields) if keys is not None else fields) if same else None


class _Keyed(dict):
    """`plain_fields` of a dataset whose samples are dicts: {key: tensor}, batched as dicts (as `default_collate`
    batches them)."""


def keep_on_device(nbytes: int, free_bytes: int | None, *, share: float = DEVICE_SHARE) -> bool:
    """Whether tensors of `nbytes` move to an accelerator with `free_bytes` free (None: a CPU run, no move)."""
    return free_bytes is not None and nbytes <= share * free_bytes


def _permutation_batches(sampler: RandomSampler | None, n: int, batch: int, drop_last: bool) -> Iterator[torch.Tensor]:
    """What `BatchSampler(RandomSampler(...))` (or of a SequentialSampler, `sampler` None) yields, as index tensors.

    RandomSampler draws its seed from the global generator at its first index when it has no generator of its
    own, then one permutation; when the batch sampler pulls past the last index it draws a second permutation for
    the remainder (empty), before the last short batch (or the end). The same draws here, at the same points."""
    if sampler is None:
        perm = torch.arange(n)
    else:
        g = sampler.generator
        if g is None:
            g = torch.Generator()
            g.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        perm = torch.randperm(n, generator=g)
    full = n // batch * batch
    for i in range(0, full, batch):
        yield perm[i:i + batch]
    if sampler is not None:
        torch.randperm(n, generator=g)
    if full < n and not drop_last:
        yield perm[full:]


class SlicedLoader:
    """A DataLoader over in-memory tensors, served as index slices (see the module docstring).

    It keeps the loader's `dataset`, `sampler`, `batch_sampler`, `batch_size`, `drop_last` and
    `generator`, so `set_epoch`, `loader_length`, a resume's `ResumableSampler.start_at` and the
    batch ramp read it as they read the DataLoader it replaces (`loader`).
    """

    def __init__(self, loader: DataLoader, tensors: tuple[torch.Tensor, ...], index: torch.Tensor | None,
                 keys: tuple[str, ...] | None = None):
        self.loader = loader
        self.tensors, self.index, self.keys = tensors, index, keys  # keys: the samples are dicts, so are batches
        self.dataset, self.sampler, self.batch_sampler = loader.dataset, loader.sampler, loader.batch_sampler
        self.batch_size, self.drop_last, self.generator = loader.batch_size, loader.drop_last, loader.generator
        self.num_workers = 0

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        batches = self._index_batches()  # lazy, as a DataLoader iterator's sampler iterator is
        # The one draw a DataLoader iterator makes from its generator (its workers' base seed) when it is created,
        # not at its first batch, so that every random number drawn after iter() is the one the DataLoader leaves.
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        return self._slices(batches)

    def _index_batches(self) -> Iterator:
        """The batch sampler's batches of indices; for a plain RandomSampler or SequentialSampler, as tensor slices of
        the permutation it draws (no Python list per batch), drawing exactly what it draws, when it draws it."""
        bs, sampler = self.batch_sampler, self.batch_sampler.sampler
        plain_random = (type(sampler) is RandomSampler and not sampler.replacement
                        and sampler.num_samples == len(sampler.data_source))
        if not plain_random and type(sampler) is not SequentialSampler:
            return iter(bs)
        return _permutation_batches(sampler if plain_random else None, len(sampler.data_source), bs.batch_size,
                                    bs.drop_last)

    def _slices(self, batches: Iterator) -> Iterator[list[torch.Tensor] | dict[str, torch.Tensor]]:
        device, keys = self.tensors[0].device, self.keys
        same = self.index is None and device.type == "cpu"  # the permutation's slices index the tensors as they are
        for idx in batches:
            i = idx if same and type(idx) is torch.Tensor and idx.dtype is torch.long else self._on_device(idx, device)
            yield [t[i] for t in self.tensors] if keys is None else {k: t[i] for k, t in zip(keys, self.tensors)}

    def _on_device(self, idx, device: torch.device) -> torch.Tensor:
        """A batch sampler's indices as a long tensor on the tensors' device, through `index` (a Subset's)."""
        i = torch.as_tensor(idx, dtype=torch.long)
        if self.index is not None:
            i = self.index[i]
        return i if i.device == device else i.to(device, non_blocking=True)


def sliced_loader(loader: Iterable, device: torch.device, *, free_bytes: int | None = None) -> Iterable:
    """`loader` served as index slices when it is a plain DataLoader over in-memory tensors; else `loader` itself.

    `free_bytes`: the accelerator's free memory (read from CUDA when None and `device` is CUDA); the
    tensors move there once when `keep_on_device` says so.
    """
    if type(loader) is not DataLoader or loader.collate_fn is not default_collate:
        return loader
    if type(loader.batch_sampler) is not BatchSampler:  # a batch ramp or custom batch sampler: its own batches
        return loader
    found = in_memory_tensors(loader.dataset)
    if found is None:
        return loader
    tensors, index, keys = found
    if device.type == "cuda" and all(t.device.type == "cpu" for t in tensors):
        if free_bytes is None:
            free_bytes = torch.cuda.mem_get_info(device)[0]
        if keep_on_device(sum(t.numel() * t.element_size() for t in tensors), free_bytes):
            tensors = tuple(t.to(device) for t in tensors)
            index = index.to(device) if index is not None else None
    return SlicedLoader(loader, tensors, index, keys)


class InMemory:
    """The trainer's use of `sliced_loader`: the training loader served once per run (its decision recorded),
    the validation loader once per loader object (a device copy is made once, not every evaluation)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._eval: tuple[Iterable, Iterable] | None = None  # (the loader given, what serves it)

    def train(self, loader: Iterable, decisions: dict) -> Iterable:
        served = sliced_loader(loader, self.device)
        if served is not loader and "batching" not in decisions:  # (a second fit of one trainer: decided)
            where = "on the device" if served.tensors[0].device.type != "cpu" else "in host memory"
            base = served.dataset
            while isinstance(base, Subset):
                base = base.dataset
            kind = "TensorDataset" if type(base) is TensorDataset else \
                f"{type(base).__name__}.__getitem__ only indexes its tensors"
            decisions["batching"] = Decision("index slices", f"the DataLoader holds tensors {where} ({kind}): "
                                             "each batch is one index per tensor, in the loader's order, not a "
                                             "collate of per-sample reads")
        return served

    def eval(self, loader: Iterable) -> Iterable:
        if self._eval is None or self._eval[0] is not loader:
            self._eval = (loader, sliced_loader(loader, self.device))
        return self._eval[1]
