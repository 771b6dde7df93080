"""Batches of two samples."""
# doctor-expect: small-batch
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
ds = TensorDataset(torch.randn(64, 32), torch.randint(0, 8, (64,)))
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(2):
    for x, y in DataLoader(ds, batch_size=2, shuffle=True):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
