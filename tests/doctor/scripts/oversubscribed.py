"""Two DataLoader workers that compute hard per sample, on the cores where the model's threads run.

Each sample keeps a core busy for 30 ms (a stand-in for decoding and augmenting an image, timed so that
the workers are busy for most of each step however fast or loaded the machine is): the gallery runs on two
usable cores, where the two workers and the model's two intra-op threads contend.
"""
# doctor-expect: cpu-oversubscribed
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Augmented(Dataset):
    def __init__(self, n=4096):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 8, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        end = time.perf_counter() + 0.03  # stands in for decoding and augmenting an image
        while time.perf_counter() < end:
            pass
        return self.x[i], self.y[i]


def main():
    torch.set_num_threads(2)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(Augmented(), batch_size=32, shuffle=True, num_workers=2, persistent_workers=True)
    for epoch in range(2):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()


if __name__ == "__main__":
    main()
