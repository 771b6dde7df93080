"""A compiled model with a graph break in forward (Python control flow on a tensor value, and a print)."""
# doctor-expect: compile-graph-breaks
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if h.mean() > 0.5:  # data-dependent branch: a graph break
            h = h * 0.5
        return self.fc2(h)


torch.manual_seed(0)
model = Net()
compiled = torch.compile(model, backend="eager")  # the eager backend: graph capture without code generation
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(40):
    x, y = torch.randn(64, 32), torch.randint(0, 8, (64,))
    opt.zero_grad()
    nn.functional.cross_entropy(compiled(x), y).backward()
    opt.step()
