"""Anomaly detection and deterministic algorithms left on from a debugging session."""
# doctor-expect: debug-mode-on
import torch
from torch import nn

from _gallery_data import digits_tensors

torch.autograd.set_detect_anomaly(True)
torch.use_deterministic_algorithms(True)
torch.manual_seed(0)
x, y = digits_tensors()
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(4):
    for i in range(0, len(x) - 64 + 1, 64):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 64]), y[i:i + 64]).backward()
        opt.step()
