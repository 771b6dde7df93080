"""A real-size script in the form of torchvision's classification reference (the doctor's `--fix` benchmark input).

torchvision's ResNet-18 at 64 px, batch 32, SGD with momentum. The forward already sits inside
`torch.cuda.amp.autocast(enabled=scaler is not None)`: off unless `--amp`, and a no-op on a CPU
anyway, so on a CPU with native bf16 the script trains in fp32. Plain PyTorch: it does not import
torchspeed. Synthetic, deterministic data (nothing is downloaded).
"""
import argparse

import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def get_args():
    p = argparse.ArgumentParser(description="classification training")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", default=32, type=int)
    p.add_argument("--epochs", default=1, type=int)
    p.add_argument("--lr", default=0.1, type=float)
    p.add_argument("--image-size", default=64, type=int)
    p.add_argument("--workers", default=0, type=int)
    p.add_argument("--amp", action="store_true", help="use torch.cuda.amp for mixed precision training")
    return p.parse_args()


def train_one_epoch(model, criterion, optimizer, data_loader, device, scaler=None):
    model.train()
    for image, target in data_loader:
        image, target = image.to(device), target.to(device)
        with torch.cuda.amp.autocast(enabled=scaler is not None):
            output = model(image)
            loss = criterion(output, target)
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()


def main(args):
    device = torch.device(args.device if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(1024, 3, args.image_size, args.image_size, generator=g),
                         torch.randint(0, 10, (1024,), generator=g))
    data_loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scaler = torch.cuda.amp.GradScaler() if args.amp else None
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, optimizer, data_loader, device, scaler)


if __name__ == "__main__":
    main(get_args())
