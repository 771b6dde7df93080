"""A typical hand-written CPU training script, slow in the usual ways (the doctor's benchmark input).

Per-sample numpy augmentation in the main process (num_workers=0), NCHW fp32 conv net with
conv biases in front of BatchNorm. Plain PyTorch: it does not import torchspeed.
"""
import argparse

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class AugmentedImages(Dataset):
    def __init__(self, n=2048, size=32, seed=0):
        rng = np.random.default_rng(seed)
        self.images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
        self.labels = rng.integers(0, 10, n)
        self.mean = np.array([125.3, 123.0, 113.9], np.float32)
        self.std = np.array([63.0, 62.1, 66.7], np.float32)
        self.rng = np.random.default_rng(seed + 1)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = np.pad(self.images[i], ((4, 4), (4, 4), (0, 0)), mode="reflect")
        y0, x0 = self.rng.integers(0, 9, 2)
        img = img[y0:y0 + 32, x0:x0 + 32]
        if self.rng.random() < 0.5:
            img = img[:, ::-1]
        img = (img.astype(np.float32) - self.mean) / self.std
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), int(self.labels[i])


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(block(3, 16), block(16, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    loader = DataLoader(AugmentedImages(), batch_size=args.batch_size, shuffle=True)
    for epoch in range(args.epochs):
        model.train()
        for x, y in loader:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()


if __name__ == "__main__":
    main()
