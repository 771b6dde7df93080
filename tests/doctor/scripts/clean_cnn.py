"""A clean small CNN: conv without bias before BN, channels_last, normalized inputs, sizes in 8s."""
# doctor-expect: clean
import torch
from torch import nn

from _gallery_data import fast_bf16

torch.manual_seed(0)
images = torch.randn(512, 3, 16, 16)
labels = torch.randint(0, 8, (512,))
model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
    nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 8),
).to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
use_amp = fast_bf16()
for epoch in range(3):
    perm = torch.randperm(len(images))
    for i in range(0, len(images), 32):
        idx = perm[i:i + 32]
        xb = images[idx].contiguous(memory_format=torch.channels_last)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_amp):
            loss = nn.functional.cross_entropy(model(xb), labels[idx])
        loss.backward()
        opt.step()
