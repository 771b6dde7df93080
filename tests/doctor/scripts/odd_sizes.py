"""Hidden sizes and a batch that are not multiples of 8."""
# doctor-expect: size-not-multiple-of-8
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 100), nn.ReLU(), nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X, Y = torch.randn(600, 32), torch.randint(0, 8, (600,))
for epoch in range(3):
    for i in range(0, 600, 30):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[i:i + 30]), Y[i:i + 30]).backward()
        opt.step()
