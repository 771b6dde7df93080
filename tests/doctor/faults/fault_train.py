"""A small CNN trained on synthetic images, with one fault of known size injected, or none (its clean twin).

    python fault_train.py --fault NAME [--steps N]      # or TORCHSPEED_FAULT=NAME python fault_train.py
    python fault_train.py --fault NAME --workers 2 --report-ms   # a fix by hand, timed: prints {"ms_per_step": ...}

Faults (the clean twin, `--fault none`, has none of them: bf16 autocast where the CPU runs bf16 natively,
channels_last, no sleep, no per-step sync, threads = usable cores, glibc thresholds that keep freed blocks):
- sleep_getitem: `__getitem__` sleeps --sleep-ms per sample (num_workers=0): the data wait (T03, T06);
- host_sync: `loss.item()` every step (T13; on a CPU it costs next to nothing, and the doctor should say so);
- fp32_conv: no autocast on a CPU whose bf16 is native (T21);
- nchw: the model and its batches in NCHW instead of channels_last (T23);
- oversubscribed: 2 DataLoader workers that compute per sample beside threads = usable cores (T45);
- affinity: the process's CPU affinity collapsed to one core after torch started its threads (T45);
- malloc: glibc told to serve every block over 64 KiB with mmap and return it at free (T44), unless the
  environment sets MALLOC_MMAP_THRESHOLD_ (the doctor's fix), which wins as it does over glibc's defaults.
Under OMP_NUM_THREADS the affinity fault sizes its threads by it (the doctor's fix for it), else by the cores.
"""
import argparse
import ctypes
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--fault", default=os.environ.get("TORCHSPEED_FAULT", "none"), choices=["none", "sleep_getitem", "host_sync", "fp32_conv", "nchw",
                                                   "oversubscribed", "affinity", "malloc"])
p.add_argument("--steps", type=int, default=400)
p.add_argument("--sleep-ms", type=float, default=1.0)
p.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: 2 for oversubscribed, else 0)")
p.add_argument("--report-ms", action="store_true", help="print the mean ms per step after the first 5 (a JSON line)")
a = p.parse_args()

libc = ctypes.CDLL("libc.so.6")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
if "MALLOC_MMAP_THRESHOLD_" in os.environ:
    pass  # the environment's glibc settings win here, as they win over glibc's own defaults (the doctor's fix)
elif a.fault == "malloc":
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 0)
else:
    libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
    libc.mallopt(M_TRIM_THRESHOLD, 2**30)
if a.fault == "affinity" and hasattr(os, "sched_setaffinity"):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, len(os.sched_getaffinity(0)))))
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # after torch sized its thread pool


class Images(Dataset):
    def __init__(self, n=2048):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if a.fault == "sleep_getitem":
            time.sleep(a.sleep_ms / 1e3)
        elif a.fault == "oversubscribed":
            end = time.perf_counter() + 0.004  # CPU work per sample, in the workers
            while time.perf_counter() < end:
                pass
        return self.x[i], self.y[i]


torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
    nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 16))
fmt = torch.contiguous_format if a.fault == "nchw" else torch.channels_last
model = model.to(memory_format=fmt)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
use_amp = native_bf16 and a.fault != "fp32_conv"
workers = a.workers if a.workers is not None else 2 if a.fault == "oversubscribed" else 0
loader = DataLoader(Images(), batch_size=32, shuffle=True, num_workers=workers, persistent_workers=workers > 0)
step = 0
while step < a.steps:
    for x, y in loader:
        x = x.contiguous(memory_format=fmt)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_amp):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if a.fault == "host_sync":
            loss.item()
        step += 1
        if step == 5:
            t5 = time.perf_counter()
        if step == a.steps:
            break
if a.report_ms and a.steps > 5:
    import json
    print(json.dumps({"ms_per_step": (time.perf_counter() - t5) / (a.steps - 5) * 1e3, "steps": a.steps - 5}))
