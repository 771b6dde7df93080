"""The probe's host-device patches (T13, T16): `Tensor.to` / `.cuda` from the CPU to an accelerator timed as
copy time, host reads of device values from user code (`.item`, `.tolist`, `.numpy`, `.cpu`, `nonzero`)
counted and timed as syncs, and on CUDA every implicit sync counted through torch's sync debug mode.

`SyncPatches` is a part of `doctor._probe.Probe` (its base): it uses the probe's `_patch` (undone on exit),
its exclusive timer `_timed` and its counters (`syncs`, `sync_sites`, `cuda_sync_warnings`).
"""

from __future__ import annotations

import functools
import warnings

import torch

from torchspeed.doctor._sites import user_site

__all__ = ["SyncPatches"]


class SyncPatches:
    """The copy and sync patches of the probe (mixed into `Probe`)."""

    def _install_host_device_copies(self) -> None:
        """`Tensor.to` (from the CPU to an accelerator) and `Tensor.cuda` timed as copy time."""
        probe = self

        def wrap_to(orig):
            @functools.wraps(orig)
            def to(self, *a, **k):
                if self.device.type == "cpu" and probe._moves_to_accelerator(a, k):
                    return probe._timed("copy", orig, self, *a, **k)
                return orig(self, *a, **k)
            return to
        self._patch(torch.Tensor, "to", wrap_to)

        def wrap_cuda(orig):
            @functools.wraps(orig)
            def cuda(self, *a, **k):
                return probe._timed("copy", orig, self, *a, **k)
            return cuda
        self._patch(torch.Tensor, "cuda", wrap_cuda)

    def _install_sync_counters(self) -> None:
        """Host reads of device values from user code (`.item`, `.tolist`, `.numpy`, `.cpu`, `nonzero`)."""
        for name in ("item", "tolist", "numpy", "cpu", "nonzero"):
            self._patch(torch.Tensor, name, functools.partial(self._wrap_sync, name))
        self._patch(torch, "nonzero", functools.partial(self._wrap_sync, "nonzero"))

    def _install_cuda_sync_warnings(self) -> None:
        """Every implicit CUDA sync (also the ones we cannot patch: boolean-mask indexing, Python control
        flow on device values) emits a warning: count them, print none."""
        probe = self
        torch.cuda.set_sync_debug_mode("warn")

        def wrap_showwarning(orig):
            def showwarning(message, category, *a, **k):
                if "synchroniz" in str(message):
                    probe.cuda_sync_warnings += 1
                    return None
                return orig(message, category, *a, **k)
            return showwarning
        self._patch(warnings, "showwarning", wrap_showwarning)

    @staticmethod
    def _moves_to_accelerator(a, k) -> bool:
        dev = k.get("device")
        if dev is None and a:
            dev = a[0]
        if isinstance(dev, torch.Tensor):
            dev = dev.device
        if isinstance(dev, (str, torch.device)):
            try:
                return torch.device(dev).type != "cpu"
            except (RuntimeError, TypeError):
                return False
        return False

    def _wrap_sync(self, kind: str, orig):
        probe = self

        @functools.wraps(orig)
        def wrapper(*a, **k):
            t = a[0] if a and isinstance(a[0], torch.Tensor) else None
            # .cpu()/.numpy() of a CPU tensor is free: not a sync, not counted.
            if t is None or (kind in ("cpu", "numpy") and t.device.type == "cpu"):
                return orig(*a, **k)
            if t.device.type == "cpu" and any(c == "data" for c, _ in probe._stack):
                # inside a DataLoader's fetch (a Dataset's `torch.rand(1).item()` for an augmentation): host
                # tensors, in the loader's workers on an accelerator machine, where they never wait for it
                return orig(*a, **k)
            site = user_site()
            if site is None:
                return orig(*a, **k)
            probe.syncs[kind] += 1
            probe.sync_sites[site] += 1
            return probe._timed("sync", orig, *a, **k)
        return wrapper
