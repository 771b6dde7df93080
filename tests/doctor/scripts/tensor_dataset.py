"""Tensors already in memory, fed one sample at a time through a DataLoader: per-sample indexing and
collate dominate the step. The fix is indexing whole batches, not adding workers."""
# doctor-expect: data-bound
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _gallery_data import digits_tensors

torch.manual_seed(0)
x, y = digits_tensors()
model = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
loader = DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True)
for epoch in range(20):
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
