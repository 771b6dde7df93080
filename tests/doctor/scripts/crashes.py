"""Raises after a few steps: the doctor must report the traceback."""
# doctor-expect: raises
import torch
from torch import nn

model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100):
    opt.zero_grad()
    model(torch.randn(8, 8)).sum().backward()
    opt.step()
    if step == 2:
        raise ValueError("planted failure in step 3")
