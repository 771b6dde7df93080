"""A loop with no torch optimizer: the weights are updated by hand after each backward, as PyTorch's
word-language-model example does (`p.data.add_(p.grad, alpha=-lr)`). Each step reads the loss twice."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
x, y = torch.randn(32, 8), torch.randn(32, 1)
for step in range(200):
    model.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-0.05)
    loss.item()
    loss.item()
