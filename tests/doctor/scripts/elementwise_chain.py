"""A model whose step is a long chain of element-wise ops around two small matmuls: compile would fuse it."""
# doctor-expect: elementwise-bound
import torch
from torch import nn


class Gated(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = self.a(x)
        for _ in range(6):  # a hand-written activation, normalisation and residual mix
            h = h * torch.sigmoid(h) * self.scale + 0.1 * torch.tanh(h)
            h = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, keepdim=True) + 1e-5)
        return self.b(h)


torch.manual_seed(0)
model = Gated()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(2048, 64), torch.randn(2048, 64)
for step in range(100):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
