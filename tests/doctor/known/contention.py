"""Three DataLoader workers that keep a core busy for a fixed time per sample, next to a model with one
intra-op thread; test_probe_known.py runs this under the probe with the process pinned to one core.

There the workers, always behind (each spins 100 ms per batch; the step computes for about 10 ms), are
runnable whenever the model computes: four processes share the core, so the model's compute in the script
takes about four times its time alone (timed by the doctor once the workers have filled their queues and
gone idle). Four, not two: the margin keeps the slow-down visible when the rest of the machine's load on
that core changes between the script's steps and the timing alone.
"""
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

SPIN_MS = 100.0
WORKERS = 3


class Spin(Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        end = time.perf_counter() + SPIN_MS / 1e3
        while time.perf_counter() < end:
            pass
        return i


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 512)
    for _ in DataLoader(Spin(), batch_size=1, num_workers=WORKERS):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


if __name__ == "__main__":
    main()
