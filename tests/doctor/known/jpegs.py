"""Two JPEG datasets whose decode share of `__getitem__` is known by construction; test_probe_known.py runs
this under the probe.

`DecodeOnly` opens and decodes a 384x384 JPEG and does nothing else: decoding is nearly all of its
`__getitem__`. `DecodeThenSleep` decodes an 8x8 JPEG, then sleeps 5 ms: decoding is nearly none of it.
"""
import os
import tempfile
import time

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

SLEEP_MS = 5.0


def write_jpegs(folder, name, size, n=16):
    rng = np.random.default_rng(0)
    base = np.linspace(0, 255, size * size * 3).reshape(size, size, 3)
    paths = []
    for i in range(n):
        p = os.path.join(folder, f"{name}{i:02d}.jpg")
        Image.fromarray(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)).save(p, quality=90)
        paths.append(p)
    return paths


class DecodeOnly(Dataset):
    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with Image.open(self.paths[i]) as img:
            img.load()
        return i


class DecodeThenSleep(DecodeOnly):
    def __getitem__(self, i):
        super().__getitem__(i)
        time.sleep(SLEEP_MS / 1e3)
        return i


def main():
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        big = DataLoader(DecodeOnly(write_jpegs(tmp, "big", 384)), batch_size=2)
        small = DataLoader(DecodeThenSleep(write_jpegs(tmp, "small", 8)), batch_size=2)
        model = nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(16, 8)
        for epoch in range(10):
            for _ in zip(big, small):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()


if __name__ == "__main__":
    main()
