"""A model wrapped in nn.DataParallel."""
# doctor-expect: data-parallel
import torch
from torch import nn

torch.manual_seed(0)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # DataParallel wants the model on cuda:0
model = nn.DataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(dev))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X, Y = torch.randn(512, 32, device=dev), torch.randint(0, 8, (512,), device=dev)
for epoch in range(3):
    for i in range(0, 512, 64):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[i:i + 64]), Y[i:i + 64]).backward()
        opt.step()
