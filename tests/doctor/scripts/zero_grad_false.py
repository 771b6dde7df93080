"""argparse flags; gradients zeroed with a memset."""
# doctor-expect: zero-grad-memset
# doctor-args: --epochs 4 --lr 0.05
import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--batch", type=int, default=64)
args = parser.parse_args()

torch.manual_seed(0)
X, Y = torch.randn(1024, 32), torch.randint(0, 8, (1024,))
model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 8))
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
for epoch in range(args.epochs):
    for i in range(0, len(X), args.batch):
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(X[i:i + args.batch]), Y[i:i + args.batch]).backward()
        opt.step()
