"""Large activations with glibc malloc: each step's blocks are mmapped, freed, and faulted in again."""
# doctor-expect: allocator
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(160_000, 64)  # 40 MiB per activation: above glibc's largest mmap threshold (32 MiB)
for step in range(60):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
