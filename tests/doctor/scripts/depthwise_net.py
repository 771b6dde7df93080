"""A MobileNet-like stack of depthwise-separable convolutions."""
# doctor-expect: model-design, channels-last
import torch
from torch import nn


def dw_block(c):  # 5x5 depthwise over many channels: few FLOPs, much memory traffic
    return nn.Sequential(nn.Conv2d(c, c, 5, padding=2, groups=c, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                         nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU())


torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU(),
                      *[dw_block(128) for _ in range(4)], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(40):
    x = torch.randn(8, 3, 16, 16)
    y = torch.randint(0, 8, (8,))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
