"""A conv net fed by a Dataset that does slow per-sample work, loaded in the main process."""
# doctor-expect: data-bound, dataloader-workers, channels-last
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class NoisyImages(Dataset):
    def __init__(self, n=512):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 8, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(0.001)  # stands in for reading and augmenting a file
        return self.x[i], self.y[i]


def make_model():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 8))


def main():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    loader = DataLoader(NoisyImages(), batch_size=16, shuffle=True)
    for epoch in range(5):
        for x, y in loader:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()


if __name__ == "__main__":
    main()
