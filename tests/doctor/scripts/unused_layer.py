"""A module that creates a large layer its forward never uses."""
# doctor-expect: unused-parameters
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
        self.head = nn.Linear(64, 8)
        self.aux_head = nn.Linear(64, 512)   # left over from an experiment

    def forward(self, x):
        return self.head(self.body(x))


torch.manual_seed(0)
model = Model()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
X, Y = torch.randn(512, 32), torch.randint(0, 8, (512,))
for epoch in range(3):
    for i in range(0, 512, 64):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[i:i + 64]), Y[i:i + 64]).backward()
        opt.step()
