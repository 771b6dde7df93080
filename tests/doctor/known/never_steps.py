"""An optimizer is made but its step() is never called: the loop only runs backward, 200 times."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 8), torch.randn(32, 1)
for step in range(200):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
