"""Host-to-device overlap (T07, T12) and a prefetcher.

- `to_device(batch, device)`: moves tensors in (nested) tuples/lists/dicts with
  `non_blocking=True`, element by element: a list of variable-size images and a list of
  target dicts (detection) arrive as lists, each tensor on the device; channels_last reaches
  4D float tensors only (a list of 3D images stays as it is: the model batches it). From
  pinned (page-locked) host memory the copy runs asynchronously and overlaps compute; from
  pageable memory it is a synchronous copy.
- `batch_layout(batch, channels_last)`: a device batch's 4D float tensors in one memory layout,
  either way; `map_tensors` is the walk over a batch both use.
- `Prefetcher(loader, device)`: on CUDA, copies batch i+1 on a side stream while batch i
  computes, and makes the compute stream wait on the copy (no host sync). On the CPU there
  is nothing to copy, so it iterates the loader as it is (and says so in `.mode`).
- `loader_kwargs(device, ...)`: the DataLoader settings that pay on `device`
  (`pin_memory` on CUDA only, `persistent_workers` with workers).

Example:
    >>> for x, y in Prefetcher(loader, device, channels_last=True):
    ...     loss = step(x, y)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from torchspeed.train.trial.memory_format import to_channels_last

__all__ = ["map_tensors", "to_device", "batch_layout", "trial_layout", "Prefetcher", "loader_kwargs"]


def map_tensors(batch, fn):
    """`fn` applied to every tensor in `batch` (nested tuples, lists and mappings; anything else as it is).
    A tuple stays a tuple and a named tuple the same named tuple (a step_fn reads `batch.inputs`); a list and a list
    of samples come back as lists, a mapping as a dict."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (list, tuple)):
        moved = [map_tensors(b, fn) for b in batch]
        if not isinstance(batch, tuple):
            return moved
        return batch._make(moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, Mapping):  # dicts, target dicts, Hugging Face's BatchEncoding (a UserDict)
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    return batch


def to_device(batch, device: torch.device, *, non_blocking: bool = True, channels_last: bool = False):
    """Move every tensor in `batch` to `device`; 4D float inputs optionally to channels_last."""
    def move(t: torch.Tensor) -> torch.Tensor:
        out = t.to(device, non_blocking=non_blocking)
        return to_channels_last(out) if channels_last and out.dim() == 4 and out.is_floating_point() else out
    return map_tensors(batch, move)


def _all_on(batch, device: torch.device) -> bool:
    """Whether every tensor in `batch` is on `device`."""
    found = []
    map_tensors(batch, lambda t: found.append(t.device == device))
    return all(found)


def batch_layout(batch, channels_last: bool):
    """The 4D float tensors of a device batch in the given memory layout, either way (a switch-trial candidate's,
    or the layout the trial chose); a tensor already in it is returned as is."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return map_tensors(batch, lambda t: t.contiguous(memory_format=fmt) if t.dim() == 4 and t.is_floating_point()
                       else t)


def trial_layout(trainer, batch, channels_last: bool):
    """A batch in a switch-trial candidate's layout: channels_last; or the plain one, which is the batch as its
    loader gave it (a script's channels_last input stays so, as it does in the script's own loop, and the plain
    settings' numbers stay the loop's), unless this epoch's batches were copied to channels_last
    (`Trainer.loader_layout`): those go back to NCHW."""
    if not channels_last and not getattr(trainer, "loader_layout", False):
        return batch
    return batch_layout(batch, channels_last)


def loader_kwargs(device: torch.device | str, *, num_workers: int) -> dict:
    """DataLoader options that pay on `device` with `num_workers` workers."""
    device = torch.device(device)
    kw: dict = {"num_workers": num_workers, "pin_memory": device.type == "cuda"}
    if num_workers > 0:
        kw.update(persistent_workers=True, prefetch_factor=2)
    return kw


class Prefetcher:
    """Iterate `loader`, with batch i+1 already on `device` while batch i computes."""

    def __init__(self, loader: Iterable, device: torch.device | str, *, channels_last: bool = False,
                 non_blocking: bool = True):
        self.loader = loader
        self.device = torch.device(device)
        self.channels_last = channels_last
        self.non_blocking = non_blocking
        self.mode = "cuda-stream" if self.device.type == "cuda" and torch.cuda.is_available() else "passthrough"

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _move(self, batch):
        return to_device(batch, self.device, non_blocking=self.non_blocking, channels_last=self.channels_last)

    def __iter__(self) -> Iterator:
        if self.mode == "passthrough":
            # On the CPU a batch whose tensors are all there already stays as it is: `.to("cpu")` of each would
            # return it unchanged. Read from the first batch (a loader keeps its tensors' device from batch to batch).
            stays = None
            for batch in self.loader:
                if stays is None:
                    stays = self.device.type == "cpu" and _all_on(batch, self.device)
                yield batch if stays and not self.channels_last else self._move(batch)
            return
        stream = torch.cuda.Stream(device=self.device)
        it = iter(self.loader)

        def preload():
            try:
                nxt = next(it)
            except StopIteration:
                return None
            with torch.cuda.stream(stream):
                return self._move(nxt)

        nxt = preload()
        while nxt is not None:
            # The compute stream waits for the copy on the GPU; the host does not block.
            torch.cuda.current_stream(self.device).wait_stream(stream)
            batch = nxt
            _record(batch, torch.cuda.current_stream(self.device))
            nxt = preload()
            yield batch


def _record(batch, stream) -> None:
    """Tell the caching allocator the batch is used on `stream` (so it is not freed early)."""
    if isinstance(batch, torch.Tensor):
        if batch.is_cuda:
            batch.record_stream(stream)
    elif isinstance(batch, (list, tuple)):
        for b in batch:
            _record(b, stream)
    elif isinstance(batch, Mapping):
        for b in batch.values():
            _record(b, stream)
