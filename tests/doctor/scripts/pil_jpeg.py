"""An image-folder style Dataset that decodes JPEG files with Pillow."""
# doctor-expect: slow-jpeg-decode, data-bound
import os
import tempfile

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms


def write_jpegs(folder, n=48, size=256):
    rng = np.random.default_rng(0)
    base = np.linspace(0, 255, size * size * 3).reshape(size, size, 3)
    paths = []
    for i in range(n):
        arr = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        p = os.path.join(folder, f"{i:03d}.jpg")
        Image.fromarray(arr).save(p, quality=90)
        paths.append((p, i % 4))
    return paths


class JpegFolder(Dataset):
    def __init__(self, items):
        self.items = items
        self.tf = transforms.Compose([transforms.CenterCrop(64), transforms.ToTensor(),
                                      transforms.Normalize([0.5] * 3, [0.25] * 3)])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        img = Image.open(path).convert("RGB")
        return self.tf(img), label


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        ds = JpegFolder(write_jpegs(tmp))
        model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, bias=False), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                              nn.Flatten(), nn.Linear(8, 4)).to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for epoch in range(4):
            for x, y in DataLoader(ds, batch_size=16, shuffle=True):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y).backward()
                opt.step()
