"""In the style of a reference classification script: the forward already sits inside
`torch.cuda.amp.autocast(enabled=scaler is not None)`, off unless `--amp`, and a no-op on a CPU anyway."""
# doctor-expect: no-amp
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def get_args():
    p = argparse.ArgumentParser(description="classification training")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", default=32, type=int)
    p.add_argument("--epochs", default=2, type=int)
    p.add_argument("--lr", default=0.1, type=float)
    p.add_argument("--workers", default=0, type=int)
    p.add_argument("--amp", action="store_true", help="use torch.cuda.amp for mixed precision training")
    return p.parse_args()


def build_model(num_classes=10):
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes))


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
    data = TensorDataset(torch.randn(512, 3, 16, 16), torch.randint(0, 10, (512,)))
    data_loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    model = build_model().to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scaler = torch.cuda.amp.GradScaler() if args.amp else None
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, optimizer, data_loader, device, scaler)


if __name__ == "__main__":
    main(get_args())
