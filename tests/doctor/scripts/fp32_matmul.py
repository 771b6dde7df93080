"""A matmul-heavy MLP trained in fp32: on a CPU with AVX512-BF16/AMX its matmuls could run on bf16 math."""
# doctor-expect: cpu-bf16-math
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(4096, 256), torch.randint(0, 16, (4096,))
for epoch in range(3):
    for i in range(0, len(x), 128):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 128]), y[i:i + 128]).backward()
        opt.step()
