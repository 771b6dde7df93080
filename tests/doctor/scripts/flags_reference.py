"""In the style of a reference training script whose own options give the common fixes: `--amp` (autocast
on the device the script runs on), `-j/--workers`, `--compile`, `--channels-last`; run without them."""
# doctor-expect: no-amp, channels-last, dataloader-workers
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


def get_args():
    p = argparse.ArgumentParser(description="image classification")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", default=16, type=int)
    p.add_argument("--epochs", default=2, type=int)
    p.add_argument("-j", "--workers", default=0, type=int, metavar="N", help="data loading workers")
    p.add_argument("--amp", action="store_true", help="mixed precision (bf16 autocast)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    return p.parse_args()


class Images(Dataset):
    """Decoded and augmented one sample at a time, slowly (a stand-in for JPEG decoding)."""

    def __init__(self, n=512):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(0.002)
        return self.x[i].flip(-1), self.y[i]


def main(args):
    device = torch.device(args.device)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.compile:
        model = torch.compile(model)
    loader = DataLoader(Images(), batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(args.epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            if args.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=args.amp):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()


if __name__ == "__main__":
    main(get_args())
